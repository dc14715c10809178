"""A repeated small call with the very same tensors reuses what they decided (planned_kernels'
``last``: the bindings; call_plan.ForwardPlan.last: the device and aliasing checks). What may
change between calls with the same tensor objects must still be seen: their values, their
gradient buffers (new ones attached), the upstream, a tensor dropped and a new one made (an
id reused), the result given, another thread's tensors. Values against NumPy in float64."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import pydiff
from pydiff import generated, kernels as kernels_module
from pydiff.planned_kernels import BackwardLaunch, ForwardLaunch

SOURCE = """
[Differentiable] float s39_affine(float a, float b, float x, float y) { return a * x * y + b * y; }
"""
N = 16


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s39_memo", SOURCE, device=device)


@pytest.fixture
def soon(second_call_generated):
    """Plans switch to generated kernels at their second call (conftest)."""


def _want(a, b, xs, ys):
    xs, ys = np.float64(xs), np.float64(ys)
    return a * xs * ys + b * ys, a * ys, a * xs + b  # value, d/dx, d/dy


def _tensors(device, rng, grads=True):
    xs, ys = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    x = pydiff.tensor(xs, device=device, requires_grad=grads)
    y = pydiff.tensor(ys, device=device, requires_grad=grads)
    return xs, ys, x, y


def test_the_same_tensors_reuse_their_bindings(device, mod, soon, monkeypatch):
    """The launch's second and later calls with the same tensors pass the very bindings list
    of the first (not built again), and the forward plan keeps the tensors it checked."""
    rng = np.random.default_rng(0)
    xs, ys, x, y = _tensors(device, rng)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    seen = []
    real = kernels_module.KernelCache.dispatch_split

    def spy(self, kernel, threads, buffers, scalars, **kw):
        seen.append(buffers)
        return real(self, kernel, threads, buffers, scalars, **kw)

    monkeypatch.setattr(kernels_module.KernelCache, "dispatch_split", spy)
    for _ in range(5):
        mod.s39_affine(1.5, 0.25, x, y, _result=out)
        mod.s39_affine.bwds(1.5, 0.25, x, y, _result=out)
    assert generated.stats().get("forward", 0) >= 3 and generated.stats().get("backward", 0) >= 3
    forward = [b for b in seen if b[-1][0] == "pydiff_result"]
    backward = [b for b in seen if b[-1][0] == "pydiff_up"]
    assert len({id(b) for b in forward[-3:]}) == 1, "forward bindings built again"
    assert len({id(b) for b in backward[-3:]}) == 1, "backward bindings built again"
    launches = [p.launch for p in mod.s39_affine.plans.values()]
    assert any(isinstance(lnch, ForwardLaunch) and lnch.last for lnch in launches)
    assert any(p.last for p in mod.s39_affine.plans.values())
    blaunch = [p.launch for p in mod.s39_affine.bwds_plans.values()]
    assert any(isinstance(lnch, BackwardLaunch) and lnch.last for lnch in blaunch)
    value, dx, dy = _want(1.5, 0.25, xs, ys)
    np.testing.assert_allclose(out.numpy(), value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 5 * dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.grad.numpy(), 5 * dy, rtol=1e-5, atol=1e-5)


def test_values_new_gradients_and_upstreams_between_calls_are_followed(device, mod, soon):
    rng = np.random.default_rng(1)
    xs, ys, x, y = _tensors(device, rng)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    for _ in range(3):  # past the switch: the memo holds these tensors
        mod.s39_affine(2.0, -1.0, x, y, _result=out)
        mod.s39_affine.bwds(2.0, -1.0, x, y, _result=out)
    # new values in the same tensors
    xs2 = rng.standard_normal(N).astype(np.float32)
    x.copy_from_numpy(xs2)
    mod.s39_affine(2.0, -1.0, x, y, _result=out)
    np.testing.assert_allclose(out.numpy(), _want(2.0, -1.0, xs2, ys)[0], rtol=1e-5, atol=1e-6)
    # new gradient buffers on the same tensors: the gradient goes there, the old ones stay
    old_gx, old_gy = x.grad, y.grad
    kept = old_gx.numpy().copy(), old_gy.numpy().copy()
    x.requires_grad_(False)
    x.requires_grad_(True)
    # the same values with other gradient buffers (with_grads: a new tensor on y's storage)
    y2 = y.with_grads(
        grad_in=pydiff.zeros((N,), device=device), grad_out=pydiff.zeros((N,), device=device)
    )
    assert x.grad is not old_gx and y2.grad_out is not old_gy
    # a new upstream on the same result's values: 3 everywhere
    out2 = out.with_grads(
        grad_in=pydiff.tensor(np.full(N, 3.0, np.float32), device=device),
        grad_out=pydiff.zeros((N,), device=device),
    )
    mod.s39_affine.bwds(2.0, -1.0, x, y2, _result=out2)
    _, dx, dy = _want(2.0, -1.0, xs2, ys)
    np.testing.assert_allclose(x.grad.numpy(), 3 * dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y2.grad_out.numpy(), 3 * dy, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(old_gx.numpy(), kept[0])
    np.testing.assert_array_equal(old_gy.numpy(), kept[1])


def test_new_tensors_in_a_loop_reusing_ids(device, mod, soon):
    """Tensors dropped and made anew each step (Python may reuse their ids and pydiff its
    pooled buffers): every step's values and gradients its own."""
    rng = np.random.default_rng(2)
    for step in range(12):
        xs, ys, x, y = _tensors(device, rng)
        out = pydiff.zeros((N,), device=device).with_grads(ones=True)
        a = 0.5 + step
        mod.s39_affine(a, 0.75, x, y, _result=out)
        mod.s39_affine.bwds(a, 0.75, x, y, _result=out)
        value, dx, dy = _want(a, 0.75, xs, ys)
        np.testing.assert_allclose(out.numpy(), value, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y.grad.numpy(), dy, rtol=1e-5, atol=1e-5)
        del x, y, out
        gc.collect()


def test_aliasing_after_the_memo_still_takes_the_full_path(device, mod, soon):
    """After calls with separate tensors, the same x given as the result too: the plan's
    aliasing check must run again (it did not pass for these tensors): the values are those
    of the inputs before the call."""
    rng = np.random.default_rng(3)
    xs, ys, x, y = _tensors(device, rng, grads=False)
    out = pydiff.zeros((N,), device=device)
    for _ in range(3):
        mod.s39_affine(1.25, 0.5, x, y, _result=out)
    mod.s39_affine(1.25, 0.5, x, y, _result=x)  # x read and written by one call
    np.testing.assert_allclose(x.numpy(), _want(1.25, 0.5, xs, ys)[0], rtol=1e-5, atol=1e-6)
    mod.s39_affine(1.25, 0.5, y, y, _result=out)  # one tensor at two read parameters
    np.testing.assert_allclose(out.numpy(), _want(1.25, 0.5, ys, ys)[0], rtol=1e-5, atol=1e-6)


def test_threads_with_their_own_tensors(device, mod, soon):
    """Four threads calling the same plan with their own tensors (each thread's memo entry
    replaced by the others' between its calls): every result and gradient its own."""
    errors = []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            xs, ys, x, y = _tensors(device, rng)
            out = pydiff.zeros((N,), device=device).with_grads(ones=True)
            for _ in range(20):
                mod.s39_affine(1.5, float(seed), x, y, _result=out)
                mod.s39_affine.bwds(1.5, float(seed), x, y, _result=out)
            value, dx, dy = _want(1.5, float(seed), xs, ys)
            np.testing.assert_allclose(out.numpy(), value, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(x.grad.numpy(), 20 * dx, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(y.grad.numpy(), 20 * dy, rtol=1e-4, atol=1e-4)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def test_empty_cache_forgets_the_bindings(device, mod, soon):
    rng = np.random.default_rng(4)
    _, _, x, y = _tensors(device, rng)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    for _ in range(3):
        mod.s39_affine(1.0, 1.0, x, y, _result=out)
        mod.s39_affine.bwds(1.0, 1.0, x, y, _result=out)
    launches = [p.launch for p in mod.s39_affine.plans.values()]
    launches += [p.launch for p in mod.s39_affine.bwds_plans.values()]
    assert any(getattr(lnch, "last", None) for lnch in launches)
    pydiff.empty_cache(device)
    assert not any(getattr(lnch, "last", None) for lnch in launches)


def test_a_new_gradient_buffer_on_the_same_tensor(device, mod, soon):
    """Only x's gradient buffer changes (requires_grad_ off and on: a new one on the same
    tensor object), with the same y, result and upstream: the gradient goes into the new one."""
    rng = np.random.default_rng(5)
    xs, ys, x, y = _tensors(device, rng)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    for _ in range(3):
        mod.s39_affine.bwds(0.5, 2.0, x, y, _result=out)
    old = x.grad
    kept = old.numpy().copy()
    x.requires_grad_(False)
    x.requires_grad_(True)
    assert x.grad is not old
    mod.s39_affine.bwds(0.5, 2.0, x, y, _result=out)
    _, dx, dy = _want(0.5, 2.0, xs, ys)
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.grad.numpy(), 4 * dy, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(old.numpy(), kept)
