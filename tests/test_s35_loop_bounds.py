"""A loop whose trip count is a tensor parameter's length, run past its ``[MaxIters(n)]``:
Slang's backward keeps at most n iterations' values, so ``.bwds`` (and a tape's backward) came
out wrong without an error while the forward stayed right (hunt35: the dense layer of
docs/forward-mode.md given 1100 inputs under ``[MaxIters(1024)]``, dW off by 100%). pydiff now
refuses such a ``.bwds`` naming the loop's line and the count; within the bound the
gradients match the closed form.
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import loop_bounds

SOURCE = """import slangpy;
[Differentiable]
float wsum(float a, IDiffTensor<float, 1> x)
{
    float acc = 0.0;
    int n = x.shape[0];  // (a condition reading x.shape hangs .bwds: traps.md)
    [MaxIters(32)]
    for (int k = 0; k < n; k++) acc += a * x[k] * x[k];
    return acc;
}
[Differentiable]
float wsum_le(float a, IDiffTensor<float, 1> x)
{
    float acc = 0.0;
    const int last = int(x.shape[0]) - 1;
    int n = int(x.shape[0]);
    [MaxIters(32)]
    for (int k = 0; k <= n; k++) acc += a * x[min(k, last)] * x[min(k, last)] * float(k < n);
    return acc;
}
"""


def _run(device, name, k):
    m = pydiff.load_module_from_source(f"s35_loops_{name}", SOURCE, device=device)
    a = np.linspace(0.5, 2.0, 4)
    xs = np.linspace(-1.0, 1.0, k)
    at = pydiff.tensor(a.astype(np.float32), device=device)
    x = pydiff.tensor(xs.astype(np.float32), device=device, requires_grad=True)
    y = getattr(m, name)(at, x, _result="tensor")
    np.testing.assert_allclose(y.numpy(), a * np.sum(xs * xs), rtol=1e-5)  # forward right
    getattr(m, name).bwds(at, x, _result=y.with_grads(ones=True))
    return x.grad.numpy(), 2.0 * np.sum(a) * xs


@pytest.mark.parametrize("name, k", [("wsum", 32), ("wsum_le", 31)])
def test_within_the_bound_matches_the_closed_form(device, name, k):
    got, want = _run(device, name, k)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, runs", [("wsum", 40), ("wsum_le", 41)])
def test_past_the_bound_is_refused(device, name, runs):
    with pytest.raises(ValueError, match=rf"loop at .*:\d+ runs {runs} times.*MaxIters\(32\)"):
        _run(device, name, 40)


def test_past_the_bound_on_a_tape_is_refused(device):
    m = pydiff.load_module_from_source("s35_loops_tape", SOURCE, device=device)
    at = pydiff.tensor(np.ones(4, np.float32), device=device)
    x = pydiff.tensor(np.ones(33, np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.wsum(at, x, _result="tensor")
    with pytest.raises(ValueError, match=r"runs 33 times.*x\.dim\(0\) = 33"):
        tape.backward(y, grad=np.ones(4))


def test_scan_follows_macros_casts_offsets_and_batched_axes():
    """break35's misses and false refusals: a macro bound, a C cast, `<= n - 1`, `#if 0`, a
    step of 2, a bound computed from the length, a local set again, an overloaded name."""
    found = loop_bounds.scan(
        """
        #define NMAX 8
        float f(float a, IDiffTensor<float, 1> x) {
            int n = (int)x.shape[0];
            uint last = x.shape[0] - 1;
            [MaxIters(NMAX)] for (int i = 0; i < n; i++) {}
            [MaxIters(8)] for (int i = 0; i <= last; ++i) {}
            [MaxIters(8)] for (int i = 0; i < n; i += 2) {}
            [MaxIters(8)] for (int i = 0; i < n / 2; i++) {}
            int m = x.shape[0];
            m = min(m, 8);
            [MaxIters(8)] for (int i = 0; i < m; i++) {}
        #if 0
            [MaxIters(2)] for (int i = 0; i < n; i++) {}
        #endif
        }
        float g(IDiffTensor<float, 1> x) { [MaxIters(2)] for (int i = 0; i < x.dim(0); i++) {} }
        float g(IDiffTensor<float, 1> x, float b) { return b; }
        """
    )
    assert found == {"f": [("x", 0, 1, 8, 0, 6), ("x", 0, 1, 8, 0, 7)]}


def test_batched_tensor_checks_its_own_axis(device):
    """A (B, L) tensor at an IDiffTensor<float, 1> parameter: the call vectorises over B and
    the loop runs L times (break35: B = 3, L = 12 was let through with wrong gradients; B =
    12, L = 4 refused)."""
    m = pydiff.load_module_from_source("s35_loops_batched", SOURCE, device=device)
    a = pydiff.tensor(np.ones(3, np.float32), device=device)
    x = pydiff.tensor(np.ones((3, 40), np.float32), device=device, requires_grad=True)
    y = m.wsum(a, x, _result="tensor")
    with pytest.raises(ValueError, match=r"runs 40 times"):
        m.wsum.bwds(a, x, _result=y.with_grads(ones=True))
    a = pydiff.tensor(np.linspace(0.5, 2.0, 40).astype(np.float32), device=device)
    xs = np.linspace(-1.0, 1.0, 40 * 4).reshape(40, 4)
    x = pydiff.tensor(xs.astype(np.float32), device=device, requires_grad=True)
    y = m.wsum(a, x, _result="tensor")
    m.wsum.bwds(a, x, _result=y.with_grads(ones=True))  # 4 iterations: within the bound
    want = 2.0 * np.linspace(0.5, 2.0, 40)[:, None] * xs
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)


def test_scan_finds_the_pattern_only_on_own_parameters():
    found = loop_bounds.scan(
        """
        float f(float a, IDiffTensor<float, 2> w) {
            [MaxIters(8)] for (int i = 0; i < w.dim(1); i++) {}
            [MaxIters(4)] while (j < w.shape[0]) {}
            [MaxIters(4)] for (int i = 0; i < other.dim(0); i++) {}  // not a parameter
            // [MaxIters(2)] for (int i = 0; i < w.dim(0); i++) {}   (a comment)
            uint rows = w.shape[0];
            [MaxIters(16)] for (uint i = 0; i <= rows; i++) {}
            [MaxIters(16)] for (uint i = 0; i < rows.x; i++) {}  // (not the local itself)
        }
        """
    )
    assert found == {"f": [("w", 1, 2, 8, 0, 3), ("w", 0, 2, 4, 0, 4), ("w", 0, 2, 16, 1, 8)]}
