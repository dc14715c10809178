"""Forward calls over a grid take a generated kernel (pydiff.generated_grid): the pattern of
SlangPy's differentiable-tensor docs, ``m.polynomial(spy.grid(x.shape), 2, 8, -1, x, y)``,
ran 59 ms on SlangPy's generic kernel for 2^22 floats and 18 ms so on lavapipe. Values are
checked against float64 NumPy and bit for bit against SlangPy's path (PYDIFF_GENERATED=0);
what the generator does not cover keeps SlangPy's path with the same results.
"""

from __future__ import annotations

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated

SOURCE = """import slangpy;
[Differentiable]
void polynomial(int idx, float a, float b, float c, IDiffTensor<float, 1> x,
                IWDiffTensor<float, 1> result)
{
    float xval = x[idx];
    result[idx] = a * xval * xval + b * xval + c;
}
void row_sums(int idx, ITensor<float, 2> x, IWTensor<float, 1> y)
{
    float s = 0.0;
    for (int j = 0; j < int(x.shape[1]); j++)
    {
        int at[2] = { idx, j };
        s += x[at];
    }
    y[idx] = s;
}
void add_one(uint idx, IRWTensor<float, 1> z) { z[idx] = z[idx] + 1.0; }
void pair(int2 idx, ITensor<float, 2> x, IWTensor<float, 2> y) { y[idx] = 2.0 * x[idx]; }
"""
N = 4096 + 44  # past generated.MIN_ELEMENTS


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s33_grid_forward", SOURCE, device=device)


def _grid_calls() -> int:
    return generated.stats().get("forward: grid", 0)


def _poly64(xs):
    x = xs.astype(np.float64)
    return 2.0 * x * x + 8.0 * x - 1.0


def test_the_seed_pattern_takes_the_generated_kernel(mod, device, monkeypatch):
    xs = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((N,), device=device)
    before = _grid_calls()
    assert mod.polynomial(spy.grid((N,)), 2.0, 8, -1.0, x, y) is None
    assert _grid_calls() == before + 1
    got = y.numpy()
    np.testing.assert_allclose(got, _poly64(xs), rtol=1e-6, atol=1e-5)
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    z = pydiff.zeros((N,), device=device)
    mod.polynomial(spy.grid((N,)), 2.0, 8, -1.0, x, z)
    assert _grid_calls() == before + 1
    np.testing.assert_array_equal(got, z.numpy())


def test_the_gradient_after_a_generated_forward(mod, device):
    xs = np.linspace(-2.0, 2.0, N, dtype=np.float32)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros((N,), device=device)
    mod.polynomial(spy.grid((N,)), 2.0, 8.0, -1.0, x, y)
    y = y.with_grads(ones=True)
    mod.polynomial.bwds(spy.grid((N,)), 2.0, 8.0, -1.0, x, y)
    np.testing.assert_allclose(y.numpy(), _poly64(xs), rtol=1e-6, atol=1e-5)
    want = 4.0 * xs.astype(np.float64) + 8.0
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6, atol=1e-5)


def test_two_dimensional_tensors_and_strided_views(mod, device):
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((N, 3)).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    y = pydiff.zeros((N,), device=device)
    before = _grid_calls()
    mod.row_sums(spy.grid((N,)), x, y)
    assert _grid_calls() == before + 1
    np.testing.assert_allclose(y.numpy(), xs.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    # The transpose of a (3, N) tensor's storage, viewed in place: strides (1, N), offset N.
    base = pydiff.tensor(rng.standard_normal((4, N)).astype(np.float32), device=device)
    n = base.native
    view = pydiff.Tensor(spy.Tensor(n.storage, n.dtype, [N, 3], [1, N], N), device)
    mod.row_sums(spy.grid((N,)), view, y)
    assert _grid_calls() == before + 2
    want = base.numpy()[1:].astype(np.float64).sum(0)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)


def test_read_write_tensors_in_place(mod, device):
    zs = np.arange(N, dtype=np.float32)
    z = pydiff.tensor(zs, device=device)
    before = _grid_calls()
    mod.add_one(spy.grid((N,)), z)
    mod.add_one(spy.grid((N,)), z)
    assert _grid_calls() == before + 2
    np.testing.assert_array_equal(z.numpy(), zs + 2.0)


def test_calls_it_does_not_cover_keep_slangpys_path(mod, device, monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 4096)  # (--pydiff-generated=force: 1)
    before = _grid_calls()
    xs = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    y = pydiff.zeros((64,), device=device)
    mod.polynomial(spy.grid((64,)), 2.0, 8.0, -1.0, x, y)  # small
    np.testing.assert_allclose(y.numpy(), _poly64(xs), rtol=1e-6, atol=1e-5)
    x2 = pydiff.tensor(np.ones((128, 64), np.float32), device=device)
    y2 = pydiff.zeros((128, 64), device=device)
    mod.pair(spy.grid((64, 64), stride=(2, 1)), x2, y2)  # a strided grid (2-D: covered)
    np.testing.assert_array_equal(y2.numpy()[::2], 2.0)
    np.testing.assert_array_equal(y2.numpy()[1::2], 0.0)
    big = pydiff.tensor(np.ones(N, np.float32), device=device, requires_grad=True)
    out = pydiff.zeros((N,), device=device)
    with pydiff.Tape():
        mod.polynomial(spy.grid((N,)), 1.0, 1.0, 1.0, big, out)  # on a tape
    np.testing.assert_array_equal(out.numpy(), 3.0)
    assert _grid_calls() == before


# --- .bwds over a grid (the generated backward, through the store-counting wrapper) -------

BACKWARD = """import slangpy;
[Differentiable]
void poly(int idx, float a, float b, float c, IDiffTensor<float, 1> x,
          IWDiffTensor<float, 1> result)
{
    float xval = x[idx];
    result[idx] = a * xval * xval + b * xval + c;
}
[Differentiable]
void collide(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> result)
{
    result[idx / 2] = x[idx];
}
[Differentiable]
void row_dot(int idx, IDiffTensor<float, 2> x, IDiffTensor<float, 1> w,
             IWDiffTensor<float, 1> y)
{
    float s = 0.0;
    int n = x.shape[1];
    [MaxIters(8)]
    for (int j = 0; j < n; j++)
        s += x[idx, j] * w[j];
    y[idx] = s;
}
"""


@pytest.fixture
def bmod(device):
    return pydiff.load_module_from_source("s33_grid_backward", BACKWARD, device=device)


def _grid_backwards() -> int:
    return generated.stats().get("backward: grid", 0)


def test_a_bwds_over_a_grid_takes_the_generated_kernel(bmod, device, monkeypatch):
    rng = np.random.default_rng(3)
    xs = rng.standard_normal(N).astype(np.float32)
    up = rng.standard_normal(N).astype(np.float32)
    grads = []
    for generated_on in ("1", "0"):
        monkeypatch.setenv("PYDIFF_GENERATED", generated_on)
        x = pydiff.tensor(xs, device=device).with_grads(zero=True)
        y = pydiff.zeros((N,), device=device).with_grads(grad_in=pydiff.tensor(up, device=device))
        before = _grid_backwards()
        bmod.poly.bwds(spy.grid((N,)), 2.0, 8.0, -1.0, x, y)
        assert _grid_backwards() == before + (generated_on == "1")
        grads.append(x.grad.numpy())
    want = (4.0 * xs.astype(np.float64) + 8.0) * up
    np.testing.assert_allclose(grads[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(grads[0], grads[1])  # SlangPy's kernel, the same bits


def test_gradients_accumulate_and_a_reset_policy_holds(bmod, device):
    xs = np.linspace(-1.0, 1.0, N, dtype=np.float32)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros((N,), device=device).with_grads(ones=True)
    for _ in range(2):
        bmod.poly.bwds(spy.grid((N,)), 1.0, 0.0, 0.0, x, y)
    np.testing.assert_allclose(x.grad.numpy(), 4.0 * xs, rtol=1e-6, atol=1e-6)
    pydiff.set_zero_policy("reset")
    bmod.poly.bwds(spy.grid((N,)), 1.0, 0.0, 0.0, x, y)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * xs, rtol=1e-6, atol=1e-6)


def test_two_threads_storing_one_element_are_still_refused(bmod, device):
    x = pydiff.tensor(np.ones(N, np.float32), device=device).with_grads(zero=True)
    y = pydiff.zeros((N // 2,), device=device).with_grads(ones=True)
    before = _grid_backwards()
    with pytest.raises(ValueError, match="stored 2 times"):
        bmod.collide.bwds(spy.grid((N,)), x, y)
    assert _grid_backwards() == before + 1  # (the generated kernel counted the stores)


def test_a_tape_over_grid_calls(bmod, device):
    rng = np.random.default_rng(4)
    rows = N
    xs = rng.standard_normal((rows, 4)).astype(np.float32)
    ws = rng.standard_normal(4).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    w = pydiff.tensor(ws, device=device, requires_grad=True)
    y = pydiff.zeros((rows,), device=device)
    before = _grid_backwards()
    with pydiff.Tape() as tape:
        bmod.row_dot(spy.grid((rows,)), x, w, y)
    tape.backward(y, grad=pydiff.tensor(np.ones(rows, np.float32), device=device))
    assert _grid_backwards() == before + 1  # (tape.backward ran the generated kernel)
    np.testing.assert_allclose(y.numpy(), xs.astype(np.float64) @ ws, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), np.tile(ws, (rows, 1)), rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), xs.astype(np.float64).sum(0), rtol=1e-4)


def test_a_tensor_without_gradients_in_a_grid_bwds(bmod, device):
    xs = np.linspace(-1.0, 1.0, N, dtype=np.float32)
    x = pydiff.tensor(xs, device=device)  # no gradient wanted: a throwaway buffer
    w = pydiff.tensor(np.ones(1, np.float32), device=device)
    y = pydiff.zeros((N,), device=device).with_grads(ones=True)
    bmod.poly.bwds(spy.grid((N,)), 1.0, 1.0, 1.0, x, y)
    assert x.grad is None and w.grad is None


def test_more_elements_than_the_dispatch_limit_loop_over_the_grid(bmod, device, monkeypatch):
    """A GPU dispatches at most 65,535 groups: past that the threads walk the grid (here
    the limit lowered to two groups, 512 threads, for 4,140 elements)."""
    from pydiff import generated_grid

    monkeypatch.setattr(generated_grid, "MAX_GROUPS", 2)
    xs = np.linspace(-2.0, 2.0, N, dtype=np.float32)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros((N,), device=device).with_grads(ones=True)
    before = _grid_calls(), _grid_backwards()
    bmod.poly(spy.grid((N,)), 2.0, 8.0, -1.0, x, y)
    bmod.poly.bwds(spy.grid((N,)), 2.0, 8.0, -1.0, x, y)
    assert (_grid_calls(), _grid_backwards()) == (before[0] + 1, before[1] + 1)
    np.testing.assert_allclose(y.numpy(), _poly64(xs), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), 4.0 * xs + 8.0, rtol=1e-6, atol=1e-5)
