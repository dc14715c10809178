"""Breaker gridbwd33: ``.bwds`` over a grid as a generated kernel (pydiff.generated_grid
``backward``, hooked in generated_calls.grid_backward), on its own and in ``tape.backward``.

Every case runs twice where it matters, generated (``generated.MIN_ELEMENTS`` = 1, counted by
``stats()["backward: grid"]``) and on SlangPy's path (``PYDIFF_GENERATED=0``); gradients are
compared bit for bit between the two and against float64 closed forms or PyTorch.

Failing (bugs, on both paths: not the generator's own, found on its calls):
- ``test_a_no_diff_interface_tensor_gets_no_gradient``: a ``no_diff IDiffTensor`` parameter
  still gets the gradient (x.grad = w for ``y[idx] = x[idx] * w[idx]``) and nothing warns;
  docs/tape.md "Where no gradient flows" says such a tensor gets none and its buffer is left
  as it was (signature.describe_function drops ``no_diff`` for tensor kinds).
- ``test_bwds_of_a_namespaced_grid_function``: ``getattr(m, "A::f")`` (and ``"S::g"``, a
  static method) runs forward, generated too, but its ``.bwds`` with an ``IWDiffTensor``
  raises ``ValueError: name='pydiff_masked_y_A::f_...': a module name must be a Slang
  identifier`` (the store-counting wrapper's module is named after ``fn.name``).

The others are cheap regression cases that pass.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated, ops

SOURCE = """import slangpy;
[Differentiable]
void poly(int idx, float a, float b, float c, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = a * v * v + b * v + c; }
[Differentiable]
void evens(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ y[idx * 2] = x[idx * 2] * x[idx * 2]; }
[Differentiable]
void sq(uint idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y) { y[idx] = x[idx] * x[idx]; }
[Differentiable]
void mul2(int idx, IDiffTensor<float, 1> x, IDiffTensor<float, 1> w, IWDiffTensor<float, 1> y)
{ y[idx] = x[idx] * w[idx]; }
[Differentiable]
void nd(int idx, no_diff IDiffTensor<float, 1> x, IDiffTensor<float, 1> w,
        IWDiffTensor<float, 1> y)
{ y[idx] = x[idx] * w[idx]; }
[Differentiable]
void row_dot(int idx, IDiffTensor<float, 2> x, IDiffTensor<float, 1> w, IWDiffTensor<float, 1> y)
{
    float s = 0.0;
    int n = x.shape[1];
    [MaxIters(8)]
    for (int j = 0; j < n; j++)
        s += x[idx, j] * w[j];
    y[idx] = s;
}
float sq_p(float v) { return v * v; }
[BackwardDerivativeOf(sq_p)]
void sq_b(inout DifferentialPair<float> v, float d) { v = diffPair(v.p, 10.0 * v.p * d); }
[Differentiable]
void use_custom(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ y[idx] = sq_p(x[idx]); }
namespace A {
[Differentiable]
void f(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y) { y[idx] = 7.0 * x[idx]; }
}
struct S {
[Differentiable]
static void g(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y) { y[idx] = 5.0 * x[idx]; }
}
"""

_modules: dict = {}


@pytest.fixture
def mod(device):
    key = id(device)
    if key not in _modules:
        _modules[key] = pydiff.load_module_from_source("s33_gridbwd33", SOURCE, device=device)
    return _modules[key]


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)


GENERATES = True  # (False on CUDA, which keeps SlangPy's kernel for grid calls)


@pytest.fixture(autouse=True)
def _grid_generation(device):
    global GENERATES
    GENERATES = device.type != "cuda"


def _grid_backwards() -> int:
    return generated.stats().get("backward: grid", 0)


def _both(monkeypatch, call, taken: int = 1):
    """``call()`` (a list of arrays) generated, then on SlangPy's path; asserts the generated
    run took ``taken`` generated grid backwards and the two agree bit for bit; returns the
    generated arrays."""
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    before = _grid_backwards()
    gen = call()
    assert _grid_backwards() == before + taken * GENERATES
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    try:
        ref = call()
    finally:
        monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    for g, r in zip(gen, ref):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(r).view(np.uint32))
    return gen


def _view(base: pydiff.Tensor, shape, strides, offset) -> pydiff.Tensor:
    n = base.native
    return pydiff.Tensor(
        spy.Tensor(n.storage, n.dtype, list(shape), list(strides), offset), base.device
    )


# --- bugs ------------------------------------------------------------------------------------


def test_a_no_diff_interface_tensor_gets_no_gradient(mod, device, forced, monkeypatch):
    n = 16
    xs = np.arange(n, dtype=np.float32)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        w = pydiff.tensor(np.full(n, 3.0, np.float32), device=device, requires_grad=True)
        y = pydiff.zeros((n,), device=device).with_grads(ones=True)
        mod.nd.bwds(spy.grid((n,)), x, w, y)
        return [x.grad.numpy(), w.grad.numpy()]

    gx, gw = _both(monkeypatch, run)
    np.testing.assert_array_equal(gw, xs)
    # docs/tape.md: a tensor at a no_diff parameter gets no gradient, its buffer left as it was
    np.testing.assert_array_equal(gx, np.zeros(n, np.float32))


@pytest.mark.parametrize("name, scale", [("A::f", 7.0), ("S::g", 5.0)])
def test_bwds_of_a_namespaced_grid_function(mod, device, forced, name, scale):
    n = 8
    fn = getattr(mod, name)
    x = pydiff.tensor(np.arange(n, dtype=np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device)
    fn(spy.grid((n,)), x, y)  # the forward works
    np.testing.assert_array_equal(y.numpy(), scale * np.arange(n, dtype=np.float32))
    y = y.with_grads(ones=True)
    fn.bwds(spy.grid((n,)), x, y)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(n, scale, np.float32))


# --- regression cases (pass) -----------------------------------------------------------------


def test_a_partial_overwrite_on_a_tape_passes_the_rest_through(mod, device, forced, monkeypatch):
    n, rng = 37, np.random.default_rng(1)
    xs = rng.standard_normal(n).astype(np.float32)
    ws = rng.standard_normal(n).astype(np.float32)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        leaf = pydiff.tensor(ws, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = pydiff.zeros((n,), device=device)
            mod.sq(spy.grid((n,)), x, y)  # y = x^2
            mod.evens(spy.grid(((n + 1) // 2,)), x, y)  # y[even] = x^2 again (prior)
            mod.evens(spy.grid(((n + 1) // 2,)), x, leaf)  # a leaf overwritten at evens
            z = pydiff.zeros((n,), device=device)
            mod.mul2(spy.grid((n,)), y, leaf, z)
        tape.backward(z, grad=np.ones(n, np.float32))
        return [x.grad.numpy(), leaf.grad.numpy()]

    gx, gleaf = _both(monkeypatch, run, taken=4)
    x64, w64, even = xs.astype(np.float64), ws.astype(np.float64), np.arange(n) % 2 == 0
    np.testing.assert_allclose(gx, np.where(even, 4 * x64**3, 2 * x64 * w64), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gleaf, np.where(even, 0.0, x64**2), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("policy", ["accumulate", "reset", "strict"])
def test_tape_backward_twice_under_each_policy(mod, device, forced, monkeypatch, policy):
    n = 24
    xs = np.random.default_rng(9).standard_normal(n).astype(np.float32)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = pydiff.zeros((n,), device=device)
            mod.poly(spy.grid((n,)), 1.0, 0.0, 0.0, x, y)
            z = pydiff.zeros((n,), device=device)
            mod.mul2(spy.grid((n,)), y, x, z)
            mod.evens(spy.grid((n // 2,)), x, z)
        with pydiff.zero_policy(policy):
            tape.backward(z, grad=np.ones(n, np.float32))
            first = x.grad.numpy().copy()
            if policy == "strict":
                with pytest.raises(pydiff.StaleGradientError):
                    tape.backward(z, grad=np.ones(n, np.float32))
            else:
                tape.backward(z, grad=np.ones(n, np.float32))
        return [first, x.grad.numpy()]

    first, second = _both(monkeypatch, run, taken=3 if policy == "strict" else 6)
    x64 = xs.astype(np.float64)
    want = np.where(np.arange(n) % 2 == 0, 2 * x64, 3 * x64**2)
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-6)
    again = {"accumulate": 2 * want, "reset": want, "strict": want}[policy]
    np.testing.assert_allclose(second, again, rtol=1e-5, atol=1e-6)


def test_strided_views_and_strided_gradient_buffers(mod, device, forced, monkeypatch):
    n = 20
    vals = np.random.default_rng(3).standard_normal(3 * n + 5).astype(np.float32)

    def run():
        x = _view(pydiff.tensor(vals, device=device), (n,), (3,), 2)
        grads = pydiff.zeros((3 * n,), device=device)
        g = _view(grads, (n,), (3,), 1)
        x = x.with_grads(grad_in=g, grad_out=g)
        ybase = pydiff.zeros((3 * n + 5,), device=device)
        ups = pydiff.tensor(np.arange(2 * n, dtype=np.float32), device=device)
        u = _view(ups, (n,), (2,), 1)
        y = _view(ybase, (n,), (2,), 1).with_grads(grad_in=u, grad_out=u)
        mod.sq.bwds(spy.grid((n,)), x, y)
        return [grads.numpy(), ybase.numpy()]

    grads, ybase = _both(monkeypatch, run)
    want = np.zeros(3 * n)
    want[1::3][:n] = 2 * vals[2::3][:n].astype(np.float64) * np.arange(2 * n)[1::2]
    np.testing.assert_allclose(grads, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ybase, np.zeros(3 * n + 5, np.float32))  # .bwds writes no values


def test_rows_of_a_reshaped_view_and_a_custom_derivative(mod, device, forced, monkeypatch):
    n, k, rng = 40, 4, np.random.default_rng(2)
    xs = rng.standard_normal((n, k)).astype(np.float32)
    ws = rng.standard_normal(k).astype(np.float32)

    def run():
        base = pydiff.tensor(xs.reshape(-1), device=device, requires_grad=True)
        w = pydiff.tensor(ws, device=device, requires_grad=True)
        y = pydiff.zeros((n,), device=device).with_grads(ones=True)
        mod.row_dot.bwds(spy.grid((n,)), base.reshape(n, k), w, y)
        x = pydiff.tensor(xs[:, 0], device=device, requires_grad=True)
        mod.use_custom.bwds(spy.grid((n,)), x, y)
        return [base.grad.numpy(), x.grad.numpy()]

    gbase, gx = _both(monkeypatch, run, taken=2)
    np.testing.assert_allclose(gbase.reshape(n, k), np.tile(ws, (n, 1)), rtol=1e-6)
    np.testing.assert_allclose(gx, 10.0 * xs[:, 0].astype(np.float64), rtol=1e-6)


def test_grid_calls_between_ops_on_a_tape_against_torch(mod, device, forced, monkeypatch):
    torch = pytest.importorskip("torch")
    n, rng = 50, np.random.default_rng(7)
    xs = rng.standard_normal(n).astype(np.float32)
    ts = rng.standard_normal(n).astype(np.float32)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        t = pydiff.tensor(ts, device=device)
        with pydiff.Tape() as tape:
            y = pydiff.zeros((n,), device=device)
            mod.poly(spy.grid((n,)), 1.0, 2.0, 3.0, x, y)
            z = pydiff.zeros((n,), device=device)
            mod.mul2(spy.grid((n,)), y, ops.sin(x), z)
            mod.evens(spy.grid((n // 2,)), y, z)
            loss = ops.mse_loss(ops.mul(z, x), t)
        tape.backward(loss)
        return [x.grad.numpy()]

    (got,) = _both(monkeypatch, run, taken=3)
    xt = torch.tensor(xs.astype(np.float64), requires_grad=True)
    y = xt * xt + 2 * xt + 3
    z = y * torch.sin(xt)
    z = torch.where(torch.arange(n) % 2 == 0, y * y, z)
    (((z * xt) - torch.tensor(ts.astype(np.float64))) ** 2).mean().backward()
    np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_grid_backwards_from_several_threads(mod, device, forced):
    n, errors = 300, []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(8):
            xs = rng.standard_normal(n).astype(np.float32)
            x = pydiff.tensor(xs, device=device, requires_grad=True)
            with pydiff.Tape() as tape:
                y = pydiff.zeros((n,), device=device)
                mod.poly(spy.grid((n,)), 1.0, 2.0, 3.0, x, y)
            tape.backward(y, grad=np.ones(n, np.float32))
            err = np.abs(x.grad.numpy() - (2 * xs.astype(np.float64) + 2)).max()
            if err > 1e-5:
                errors.append((seed, err))

    before = _grid_backwards()
    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _grid_backwards() == before + 24 * GENERATES
