"""Breaking the memo of calls with the very same tensors (planned_kernels' ``last``): another
thread's call, or an ``empty_cache``, landing between a launch's check of its memo and its use
of the bindings kept there. Those points are forced here (a hook at the check lets the other
thread run to completion, as a thread switch there would), so the interleaving is certain
rather than rare. Values and gradients against NumPy in float64."""

from __future__ import annotations

import threading
import types
import weakref

import numpy as np
import pytest

import pydiff
from pydiff import planned_kernels

SOURCE = """
[Differentiable] float s39_brk(float a, float b, float x, float y) { return a * x * y + b * y; }
"""
N = 16


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s39_brk39", SOURCE, device=device)


@pytest.fixture
def soon(second_call_generated):
    """Plans switch to generated kernels at their second call (conftest)."""


def _want(a, b, xs, ys):
    xs, ys = np.float64(xs), np.float64(ys)
    return a * xs * ys + b * ys, a * ys, a * xs + b  # value, d/dx, d/dy


def _side(device, rng):
    xs, ys = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.tensor(ys, device=device, requires_grad=True)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    return xs, ys, x, y, out


class _Other:
    """Another thread that runs ``work`` once, when ``run_now`` is called (from the hook, in
    the calling thread, which waits for it to finish: a thread switch at that point)."""

    def __init__(self, work):
        self.go, self.done, self.errors = threading.Event(), threading.Event(), []
        self.armed = False

        def body():
            self.go.wait(60)
            try:
                work()
            except Exception as exc:  # noqa: BLE001 (reported by the test)
                self.errors.append(exc)
            self.done.set()

        self.thread = threading.Thread(target=body)
        self.thread.start()

    def run_now(self):
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            self.go.set()
            assert self.done.wait(60), "the other thread did not finish"

    def join(self):
        self.go.set()
        self.thread.join(60)
        assert not self.errors, self.errors


def test_forward_memo_replaced_by_another_thread_after_its_check(device, mod, soon, monkeypatch):
    """Thread A's call passed the check of the forward launch's memo (its own tensors); thread
    B's call with other tensors replaces the memo before A reads the bindings kept there.
    fast (before the fix): A dispatched B's buffers with A's numbers: B's result took A's
    values and A's result kept its old ones. main: no memo, both right."""
    rng = np.random.default_rng(11)
    xa, ya, x_a, y_a, out_a = _side(device, rng)
    xb, yb, x_b, y_b, out_b = _side(device, rng)
    for _ in range(3):  # past the switch: the memo holds A's tensors
        mod.s39_brk(1.5, 0.25, x_a, y_a, _result=out_a)
    other = _Other(lambda: mod.s39_brk(1.5, -2.0, x_b, y_b, _result=out_b))
    real = getattr(planned_kernels, "same_tensors", None)  # (main has no memo)

    def hooked(refs, args):
        same = real(refs, args)
        if same:
            other.run_now()  # (B's call, then A goes on)
        return same

    monkeypatch.setattr(planned_kernels, "same_tensors", hooked, raising=False)
    other.armed = True
    mod.s39_brk(1.5, 4.0, x_a, y_a, _result=out_a)
    other.join()
    _hook_ran(other)
    np.testing.assert_allclose(out_a.numpy(), _want(1.5, 4.0, xa, ya)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_b.numpy(), _want(1.5, -2.0, xb, yb)[0], rtol=1e-5, atol=1e-5)


def _hook_ran(other):
    """The forced point was reached (where a launch keeps a memo: not on main, which has
    none, and where the call is simply right)."""
    if hasattr(planned_kernels, "LAST_MAX_ELEMENTS"):
        assert not other.armed, "the hook never ran: the memo was not used"


class _HookRef(weakref.ref):
    """A weak reference that calls ``hook`` with its object whenever it is read."""

    hook = None

    def __call__(self):
        obj = super().__call__()
        if _HookRef.hook is not None:
            _HookRef.hook(obj)
        return obj


def test_backward_memo_replaced_by_another_thread_after_its_check(device, mod, soon, monkeypatch):
    """As the forward case, for ``.bwds``: B's call replaces the backward launch's memo while A
    checks its last gradient buffer against it. fast (before the fix): A's gradient added into
    B's buffers (with A's numbers) and none into A's. main: both right."""
    monkeypatch.setattr(
        planned_kernels, "weakref", types.SimpleNamespace(ref=_HookRef), raising=False
    )
    monkeypatch.setattr(_HookRef, "hook", None)
    rng = np.random.default_rng(12)
    xa, ya, x_a, y_a, out_a = _side(device, rng)
    xb, yb, x_b, y_b, out_b = _side(device, rng)
    for _ in range(3):  # past the switch: the memo holds A's tensors and gradient buffers
        mod.s39_brk.bwds(1.5, 0.25, x_a, y_a, _result=out_a)
    for t in (x_a, y_a, x_b, y_b):
        t.zero_grad()
    other = _Other(lambda: mod.s39_brk.bwds(0.5, -2.0, x_b, y_b, _result=out_b))
    last_grad = y_a.grad

    def hook(obj):
        if obj is last_grad:  # A's memo check, at its last gradient buffer
            other.run_now()

    monkeypatch.setattr(_HookRef, "hook", staticmethod(hook))
    other.armed = True
    mod.s39_brk.bwds(1.5, 4.0, x_a, y_a, _result=out_a)
    other.join()
    _hook_ran(other)
    _, dxa, dya = _want(1.5, 4.0, xa, ya)
    _, dxb, dyb = _want(0.5, -2.0, xb, yb)
    np.testing.assert_allclose(x_a.grad.numpy(), dxa, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_a.grad.numpy(), dya, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x_b.grad.numpy(), dxb, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_b.grad.numpy(), dyb, rtol=1e-5, atol=1e-5)


def test_empty_cache_in_another_thread_after_the_memo_check(device, mod, soon, monkeypatch):
    """Another thread's ``pydiff.empty_cache`` (which empties the launches' memos) between a
    call's check of the memo and its read of the bindings. fast (before the fix): IndexError
    out of the user's call. main: no memo, the call right."""
    rng = np.random.default_rng(13)
    xa, ya, x_a, y_a, out_a = _side(device, rng)
    for _ in range(3):
        mod.s39_brk(1.5, 0.25, x_a, y_a, _result=out_a)
    other = _Other(lambda: pydiff.empty_cache(device))
    real = getattr(planned_kernels, "same_tensors", None)  # (main has no memo)

    def hooked(refs, args):
        same = real(refs, args)
        if same:
            other.run_now()
        return same

    monkeypatch.setattr(planned_kernels, "same_tensors", hooked, raising=False)
    other.armed = True
    mod.s39_brk(1.5, 4.0, x_a, y_a, _result=out_a)
    other.join()
    _hook_ran(other)
    np.testing.assert_allclose(out_a.numpy(), _want(1.5, 4.0, xa, ya)[0], rtol=1e-5, atol=1e-5)
