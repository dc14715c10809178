"""The per-call shortcuts of repeated small calls (twentieth session: context variables read
without a frame, ``.bwds`` going to its layout's plan first, a forward launch's kept bindings
standing for the plan's device and aliasing checks, numbers only range-checked for generated
kernels) keep every check of the call. Each test repeats a call until its plan (and, on the
generated path, its launch's kept bindings) is hot, then changes the one thing a too-eager
shortcut would miss: a jvp trace, a capture, the zeroing policy, a tensor's own policy, an
input written since the forward call, an aliased or another tensor, another device. Values
against float64 closed forms."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff.planned_kernels import ForwardLaunch
from pydiff.plan_layout import layout_key

SOURCE = """
[Differentiable] float s40_affine(float a, float b, float x, float y) { return a * x * y + b * y; }
"""
N = 16
REPEAT = 4  # past the plan (second call) and, generated, the launch's kept bindings
A, B = 1.5, 0.5


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s40_percall", SOURCE, device=device)


def _want(xs, ys):
    """(value, d/dx, d/dy) of a * x * y + b * y, in float64."""
    xs, ys = np.float64(xs), np.float64(ys)
    return A * xs * ys + B * ys, A * ys, A * xs + B


def _inputs(device, seed=0):
    rng = np.random.default_rng(seed)
    xs, ys = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.tensor(ys, device=device, requires_grad=True)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    return xs, ys, x, y, out


def _hot_bwds(mod, x, y, out, times=REPEAT):
    for _ in range(times):
        mod.s40_affine.bwds(A, B, x, y, _result=out)
    assert mod.s40_affine.bwds_plans  # (the layout's plan ran the later calls)


def _close(t, want):
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-5, atol=1e-5)


def test_bwds_inside_jvp_is_refused_though_its_plan_is_hot(device, mod, plan_path):
    """A plan run first for every ``.bwds`` would add the gradients silently inside
    ``pydiff.jvp``, where the call must be refused (its gradients carry no tangent)."""
    xs, ys, x, y, out = _inputs(device)
    _hot_bwds(mod, x, y, out)

    def f(x):
        mod.s40_affine.bwds(A, B, x, y, _result=out)
        return x * 2.0

    with pytest.raises(NotImplementedError, match=r"s40_affine\.bwds inside pydiff\.jvp"):
        pydiff.jvp(f, (x,), (np.ones(N, np.float32),))
    _, dx, dy = _want(xs, ys)
    _close(x.grad, REPEAT * dx)  # nothing added by the refused call
    _close(y.grad, REPEAT * dy)


def test_library_bwds_in_a_capture_is_refused_though_its_plan_is_hot(device, plan_path):
    """pydiff's own library functions stay refused in a capture: the plan of a layout run
    eagerly before must not take the call first (it would record it)."""
    lib = pydiff.module.library(device)
    xs, ys, x, y, out = _inputs(device)
    for _ in range(REPEAT):
        lib.op_add.bwds(x, y, _result=out)
    assert lib.op_add.bwds_plans
    key = layout_key((x, y), {"_result": out})
    assert key in lib.op_add.bwds_plans  # (the capture's call has that very layout)

    def step():
        lib.op_add.bwds(x, y, _result=out)
        return out

    with pytest.raises(pydiff.CaptureError, match=r"op_add\.bwds \(SlangPy\)"):
        pydiff.capture(step)
    _close(x.grad, np.full(N, REPEAT))  # d(x + y)/dx = 1 per call, the refused one none
    _close(y.grad, np.full(N, REPEAT))


def test_policy_change_between_two_identical_bwds(device, mod, plan_path):
    """The zeroing policy is read at every call of a hot plan: RESET zeroes the buffers
    before adding, STRICT refuses a buffer holding an earlier backward's result."""
    xs, ys, x, y, out = _inputs(device)
    _, dx, dy = _want(xs, ys)
    _hot_bwds(mod, x, y, out)
    _close(x.grad, REPEAT * dx)
    with pydiff.zero_policy("reset"):
        mod.s40_affine.bwds(A, B, x, y, _result=out)
    _close(x.grad, dx)
    _close(y.grad, dy)
    mod.s40_affine.bwds(A, B, x, y, _result=out)  # ACCUMULATE again: the plan
    _close(x.grad, 2 * dx)
    with pydiff.zero_policy("strict"):
        with pytest.raises(pydiff.StaleGradientError):
            mod.s40_affine.bwds(A, B, x, y, _result=out)
    _close(x.grad, 2 * dx)  # unchanged by the refusal
    _close(y.grad, 2 * dy)


def test_a_tensors_own_policy_set_between_two_identical_bwds(device, mod, plan_path):
    """x's own policy (RESET) set after the plan is hot: x's gradient is zeroed before the
    add, y's (the global ACCUMULATE) still accumulates."""
    xs, ys, x, y, out = _inputs(device)
    _, dx, dy = _want(xs, ys)
    _hot_bwds(mod, x, y, out)
    x.zero_policy = "reset"
    mod.s40_affine.bwds(A, B, x, y, _result=out)
    _close(x.grad, dx)
    _close(y.grad, (REPEAT + 1) * dy)


def test_an_input_written_since_the_forward_call_is_refused_when_hot(device, mod, plan_path):
    """The forward call's record of the versions it read is checked at every ``.bwds`` of a
    hot plan: x filled from the host since is refused, and nothing is added."""
    xs, ys, x, y, out = _inputs(device)
    _, dx, dy = _want(xs, ys)
    for _ in range(REPEAT):  # forward and backward, both on their plans
        mod.s40_affine(A, B, x, y, _result=out)
        mod.s40_affine.bwds(A, B, x, y, _result=out)
    _close(out, _want(xs, ys)[0])
    x.fill(2.0)
    with pytest.raises(ValueError, match=r"s40_affine\.bwds: parameter 'x'.*a host write"):
        mod.s40_affine.bwds(A, B, x, y, _result=out)
    _close(x.grad, REPEAT * dx)
    _close(y.grad, REPEAT * dy)


def test_forward_with_another_or_an_aliased_input_after_the_kept_bindings(
    device, mod, plan_path, monkeypatch
):
    """The forward launch's kept bindings stand for the plan's checks only for the very
    tensors they bind: another x (same layout) binds its own buffer, and the result passed
    as x (read and written: aliased) is declined by the plan (the full path's call)."""
    xs, ys, x, y, out = _inputs(device)
    for _ in range(REPEAT):
        mod.s40_affine(A, B, x, y, _result=out)
    _close(out, _want(xs, ys)[0])
    xs2 = (xs * 3.0 - 1.0).astype(np.float32)
    x2 = pydiff.tensor(xs2, device=device, requires_grad=True)
    mod.s40_affine(A, B, x2, y, _result=out)
    _close(out, _want(xs2, ys)[0])
    before = out.numpy().astype(np.float64)
    assert layout_key((A, B, out, y), {"_result": out}) in mod.s40_affine.plans  # same layout
    launched = []  # the plans' launches (the full path dispatches its kernels otherwise)
    real = ForwardLaunch.run
    monkeypatch.setattr(ForwardLaunch, "run", lambda *a: launched.append(1) or real(*a))
    mod.s40_affine(A, B, out, y, _result=out)
    _close(out, A * before * ys + B * ys)
    assert not launched  # (not the plan's kernel: declined)
    mod.s40_affine(A, B, x, y, _result=out)  # the first tensors again
    _close(out, _want(xs, ys)[0])


def test_another_device_is_refused_when_hot(device, mod, plan_path, tmp_path):
    """A tensor of another device, same layout, after the plans are hot: the full path names
    the parameter, forward and ``.bwds``."""
    xs, ys, x, y, out = _inputs(device)
    for _ in range(REPEAT):
        mod.s40_affine(A, B, x, y, _result=out)
        mod.s40_affine.bwds(A, B, x, y, _result=out)
    other = pydiff.create_device(device.type, include_paths=[str(tmp_path)])  # (not cached)
    assert other != device
    x_other = pydiff.tensor(xs, device=other, requires_grad=True)
    with pytest.raises(ValueError, match="parameter 'x' is on device"):
        mod.s40_affine(A, B, x_other, y, _result=out)
    with pytest.raises(ValueError, match="parameter 'x'"):
        mod.s40_affine.bwds(A, B, x_other, y, _result=out)
    _, dx, dy = _want(xs, ys)
    _close(y.grad, REPEAT * dy)
    np.testing.assert_array_equal(x_other.grad.numpy(), 0.0)


def test_bwds_is_one_object_per_function(device, mod):
    """``fn.bwds`` (an attribute now, not a property) is the same callable at every read."""
    f = mod.s40_affine
    assert f.bwds is f.bwds
    assert repr(f.bwds) == f"<pydiff bwds of {f!r}>"
