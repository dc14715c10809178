"""A hand-written [BackwardDerivative] that never sets one of its inout DifferentialPair
derivatives: the gradient was NaN through SlangPy's kernels and 0 through the generated ones
(silently); now .bwds of the function and of its callers is refused at the backward's line,
and backwards that set every derivative (directly, through a helper, or to an explicit zero)
are accepted and right against closed forms."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pydiff
from pydiff import lint_custom

_names = itertools.count()

_UNSET = """
void f_bwd(inout DifferentialPair<float> a, inout DifferentialPair<float> b, float dOut) {
    a = diffPair(a.p, dOut * b.p);
}
[BackwardDerivative(f_bwd)]
float f(float a, float b) { return a * b; }
[Differentiable]
float g(float a, float b) { return 2.0 * f(a, b); }
"""


def _load(device, source):
    return pydiff.load_module_from_source(f"s29_unset_{next(_names)}", source, device=device)


@pytest.mark.parametrize("n", [8, 5000])  # SlangPy's path (NaN) and the generated one (0)
def test_unset_derivative_is_refused_with_the_backward_line(device, n):
    m = _load(device, _UNSET)
    a = pydiff.tensor(np.ones(n, np.float32), requires_grad=True, device=device)
    b = pydiff.tensor(np.full(n, 2.0, np.float32), requires_grad=True, device=device)
    with pytest.raises(pydiff.ShaderTrapError, match=r":2: in f\(\).*f_bwd\(\).*'b'"):
        with pydiff.Tape() as tape:
            y = m.f(a, b)
        tape.backward(y, grad=np.ones(n))
    with pytest.raises(pydiff.ShaderTrapError, match=r"custom|f_bwd\(\)"):
        y = pydiff.tensor(np.ones(n, np.float32), device=device)
        m.g.bwds(a, b, _result=y.with_grads(ones=True))
    assert "f_bwd() never sets the derivative of 'b'" in str(
        next(f for f in lint_custom.scan_source(_UNSET, "x.slang"))
    )


_SET = """
void zero_b(inout DifferentialPair<float> b) { b = diffPair(b.p, 0.0); }
void f_bwd(inout DifferentialPair<float> a, float c, inout DifferentialPair<float> b,
           float dOut) {
    a = diffPair(a.p, dOut * 3.0 * a.p * a.p);
    b = diffPair(b.p, 0.0);
}
[BackwardDerivative(f_bwd)]
float f(float a, no_diff float c, float b) { return a * a * a + c; }
void h_bwd(inout DifferentialPair<float> a, inout DifferentialPair<float> b, float dOut) {
    a = diffPair(a.p, dOut * cos(a.p));
    zero_b(b);
}
[BackwardDerivative(h_bwd)]
float h(float a, float b) { return sin(a); }
"""


@pytest.mark.parametrize("n", [8, 5000])
def test_backwards_setting_every_derivative_are_accepted_and_right(device, n):
    assert not [
        f for f in lint_custom.scan_source(_SET, "x.slang") if f.kind == lint_custom.UNSET_KIND
    ]
    m = _load(device, _SET)
    rng = np.random.default_rng(n)
    av = rng.uniform(-2, 2, n)
    bv = rng.uniform(-2, 2, n)
    a = pydiff.tensor(av.astype(np.float32), requires_grad=True, device=device)
    b = pydiff.tensor(bv.astype(np.float32), requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        y = m.f(a, 0.5, b) + m.h(a, b)
    tape.backward(y, grad=np.ones(n))
    a32 = av.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(a.grad.numpy(), 3 * a32**2 + np.cos(a32), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(b.grad.numpy(), np.zeros(n))
