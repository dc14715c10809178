"""Planned generated calls keep the bound object of their last call (planned_kernels'
``held``, kernels.dispatch_split): its uniforms and buffers must follow every change of the
call's values (new tensors, new numbers, -0.0 against 0.0, a number repeated as another
object), larger calls must not pin their buffers, and gradients stay right against float64
closed forms while tensors alternate."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import pydiff
from pydiff import generated, planned_kernels
from pydiff.planned_kernels import BackwardLaunch, ForwardLaunch

SOURCE = """
[Differentiable] float s32_scale(float a, float x) { return a * x; }
[Differentiable] float s32_affine(float a, float b, float x, float y) { return a * x * y + b * y; }
"""
N = 16


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s32_held", SOURCE, device=device)


@pytest.fixture
def soon(second_call_generated):
    """Plans switch to generated kernels at their second call (conftest)."""


def _launches(fn) -> tuple[list, list]:
    """The generated launches of ``fn``'s call plans: forward ones, backward ones."""
    forward = [p.launch for p in fn.plans.values() if isinstance(p.launch, ForwardLaunch)]
    backward = [p.launch for p in fn.bwds_plans.values() if isinstance(p.launch, BackwardLaunch)]
    return forward, backward


def test_uniforms_follow_each_call_even_zero_signs(device, mod, soon):
    xs = np.linspace(-1, 1, N).astype(np.float32)
    xs[3] = 0.0
    x = pydiff.tensor(xs, device=device)
    y = pydiff.zeros((N,), device=device)
    values = [2.0, 2.0, float("2.0"), -0.0, 0.0, -0.0, 3.5, 3, -1e-30, 7.25]
    before = generated.stats().get("forward", 0)
    for a in values * 2:
        mod.s32_scale(a, x, _result=y)
        got = y.numpy()
        want = np.float32(a) * xs  # float32 product: its sign of zero too
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    # (the int 3 is a layout of its own: its plan's first two calls take SlangPy's path)
    assert generated.stats().get("forward", 0) - before == len(values) * 2 - 4


def test_buffers_follow_alternating_tensors_forward_and_backward(device, mod, soon):
    rng = np.random.default_rng(32)
    xs = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
    ys = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
    xt = [pydiff.tensor(v, device=device, requires_grad=True) for v in xs]
    yt = [pydiff.tensor(v, device=device, requires_grad=True) for v in ys]
    out = [pydiff.zeros((N,), device=device).with_grads(ones=True) for _ in range(2)]
    expected_gx = [np.zeros(N) for _ in range(3)]
    expected_gy = [np.zeros(N) for _ in range(3)]
    for step in range(12):
        i, j, k = step % 3, (step * 2 + 1) % 3, step % 2
        a, b = 0.5 + step, -1.25 * step
        r = mod.s32_affine(a, b, xt[i], yt[j], _result=out[k])
        assert r is out[k]
        x64, y64 = xs[i].astype(np.float64), ys[j].astype(np.float64)
        np.testing.assert_allclose(out[k].numpy(), a * x64 * y64 + b * y64, rtol=2e-6, atol=1e-5)
        mod.s32_affine.bwds(a, b, xt[i], yt[j], _result=out[k])
        expected_gx[i] += a * y64  # upstream gradient 1
        expected_gy[j] += a * x64 + b
        for t, g in zip(xt + yt, expected_gx + expected_gy):
            np.testing.assert_allclose(t.grad.numpy(), g, rtol=1e-5, atol=1e-4)
    assert generated.stats().get("forward", 0) >= 8
    assert generated.stats().get("backward", 0) >= 8
    held = [launch.held for launch in _launches(mod.s32_affine)[0] if launch.held]
    assert held, "the planned forward keeps its last call's object"


def test_held_max_keeps_large_calls_unpinned_by_default():
    # calls of generated.MIN_ELEMENTS (4096) elements and more take the launch from their
    # first call: they must not be held (a loop over such shapes would pin every plan's)
    if generated.MIN_ELEMENTS == 1:
        pytest.skip("--pydiff-generated=force sends every call from its first: no default")
    assert planned_kernels.HELD_MAX < 4 * generated.MIN_ELEMENTS


def test_large_calls_keep_no_object_pinning_their_buffers(device, mod, soon, monkeypatch):
    monkeypatch.setattr(planned_kernels, "HELD_MAX", 256)  # bytes: 16 floats pass, 128 not
    for n, kept in ((N, True), (128, False)):
        xs = np.arange(n, dtype=np.float32)
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = pydiff.zeros((n,), device=device).with_grads(ones=True)
        for _ in range(4):
            mod.s32_scale(1.5, x, _result=y)
            mod.s32_scale.bwds(1.5, x, _result=y)
        np.testing.assert_allclose(y.numpy(), 1.5 * xs.astype(np.float64), rtol=1e-6)
        np.testing.assert_allclose(x.grad.numpy(), np.full(n, 4 * 1.5), rtol=1e-6)
        forward, backward = _launches(mod.s32_scale)
        fwd = [lnch for lnch in forward if lnch.shape == (n,)]
        assert fwd, "the call took the planned generated kernel"
        assert bool(fwd[-1].held) is kept
        held = [lnch.held for lnch in forward]
        held += [h for lnch in backward for h in lnch.held.values()]
        pinned = [b.size for h in held if h for b in h[2]]
        assert pinned and max(pinned) <= 256  # the 16-float calls' only


# (found by the breaker of this change: plans' held objects pinned freed tensors' buffers)
@pytest.mark.parametrize("n", [16, 8192])  # a call held, and one past HELD_MAX
def test_empty_cache_releases_buffers_of_freed_tensors_after_planned_calls(device, mod, soon, n):
    x = pydiff.tensor(np.linspace(-1, 1, n).astype(np.float32), device=device, requires_grad=True)
    y = pydiff.tensor(np.full(n, 2.0, np.float32), device=device, requires_grad=True)
    for _ in range(4):
        out = mod.s32_affine(1.5, 0.5, x, y, _result="tensor").with_grads(ones=True)
        mod.s32_affine.bwds(1.5, 0.5, x, y, _result=out)
    np.testing.assert_allclose(x.grad.numpy(), np.full(n, 4 * 1.5 * 2.0), rtol=1e-6)
    assert generated.stats().get("forward", 0) >= 2, "the planned generated kernel ran"
    assert generated.stats().get("backward", 0) >= 2
    control = pydiff.tensor(np.zeros(n, np.float32), device=device)  # never in a call
    kept = [x.buffer, y.buffer, out.buffer, x.grad.buffer, y.grad.buffer]
    unused = control.buffer
    del x, y, out, control
    gc.collect()
    pydiff.empty_cache(device)
    gc.collect()
    # A freed tensor's buffer we still refer to is referred to as an unused one is (ours,
    # the pool's); more references mean something pydiff keeps (a call plan's held object)
    # still pins its device memory past empty_cache.
    refs = [sys.getrefcount(b) for b in [*kept, unused]]
    assert refs[:-1] == refs[-1:] * len(kept), f"references (the unused one last): {refs}"


def test_calls_past_held_max_reuse_the_shared_object_cache(device, mod, soon):
    """A launch whose buffers are too large to hold binds through the kernel cache's shared
    objects (as before objects were held), not a new object per call: 8192 floats (32 KiB,
    past HELD_MAX) called again and again adds one object, and the values stay right."""
    n = 8192
    xs = np.linspace(-3, 3, n).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device).with_grads(ones=True)
    device.kernels.release_objects()
    for _ in range(3):  # the plan, then its launch
        mod.s32_scale(0.75, x, _result=y)
    assert device.kernels.sizes()["objects"] == 1  # the launch's, shared (not bound anew)
    before = device.kernels.sizes()["objects"]
    for k in range(6):
        mod.s32_scale(0.75 + k, x, _result=y)
        np.testing.assert_allclose(y.numpy(), (0.75 + k) * xs.astype(np.float64), rtol=1e-6)
    assert generated.stats().get("forward", 0) >= 6
    assert device.kernels.sizes()["objects"] == before  # the same shared object each call
    assert not _launches(mod.s32_scale)[0][-1].held
