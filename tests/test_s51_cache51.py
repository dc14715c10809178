"""Session 51 (cache51): ``empty_cache`` drops the generated kernels (their memos and the call
plans holding them) and the broadcast-gradient kernels' entry, and the calls after it compute
the same gradients; a seed tensor made after a held forward keeps the fused step."""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_hold

SOURCE = """
import slangpy;
[Differentiable] float c51_f(float a, float x) { return a * x * x + sin(x); }
[Differentiable] float c51_g(float a, float x) { return a * exp(0.5 * x) - x; }
"""

_n = iter(range(10**6))
N = 5000


@pytest.fixture
def m(device, monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(generated_hold, "HOLD_FORWARD", True)
    generated.reset_stats()
    return pydiff.load_module_from_source(f"s51_cache51_{next(_n)}", SOURCE, device=device)


def _data(seed: int = 51):
    rng = np.random.default_rng(seed)
    return rng.uniform(-2, 2, N).astype(np.float32), rng.uniform(-1, 1, N).astype(np.float32)


def _f_closed(a, x, g):
    """f = a x^2 + sin x (float64): values, df/dx * g, sum(df/da * g)."""
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    return a * x64**2 + np.sin(x64), g64 * (2 * a * x64 + np.cos(x64)), float(np.sum(g64 * x64**2))


def _bwds_step(device, fn, a_value, xs, g, broadcast=True):
    """One forward (a new result) and ``.bwds``, ``a`` a broadcast one-element parameter (or
    a number: the layout call plans take)."""
    a = pydiff.tensor(np.array([a_value], np.float32), device=device, requires_grad=True)
    a = a if broadcast else a_value
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = fn(a, x, _result="tensor")
    up = pydiff.tensor(g, device=device)
    fn.bwds(a, x, _result=y.with_grads(up))
    return y.numpy(), x.grad.numpy(), float(a.grad.numpy()[0]) if broadcast else None


def _check_f(got, a_value, xs, g):
    want_y, want_dx, want_da = _f_closed(a_value, xs, g)
    np.testing.assert_allclose(got[0], want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want_dx, rtol=1e-5, atol=1e-5)
    if got[2] is not None:
        assert got[2] == pytest.approx(want_da, rel=1e-5, abs=1e-3)


def test_empty_cache_drops_generated_kernels_and_plans_and_gradients_stay_right(device, m):
    xs, g = _data()
    for _ in range(2):  # the second call of each layout runs its call plan
        _check_f(_bwds_step(device, m.c51_f, 1.5, xs, g, broadcast=False), 1.5, xs, g)
    assert generated.stats().get("forward", 0) >= 1, generated.stats()
    assert m.c51_f.plans and m.c51_f.bwds_plans
    kernels = list(device.cached("pydiff.generated", dict).values())
    assert kernels and all(k is not None for k in kernels)
    pydiff.empty_cache(device)
    gc.collect()
    assert not m.c51_f.plans and not m.c51_f.bwds_plans
    # nothing of pydiff's holds the old kernels any more (only this list, and the argument)
    assert [sys.getrefcount(k) for k in kernels] == [3] * len(kernels)
    del kernels
    generated.reset_stats()
    for _ in range(2):  # built again, then planned again
        _check_f(_bwds_step(device, m.c51_f, -0.75, xs, g, broadcast=False), -0.75, xs, g)
    _check_f(_bwds_step(device, m.c51_f, -0.75, xs, g), -0.75, xs, g)
    assert generated.stats().get("forward", 0) >= 1, generated.stats()
    assert m.c51_f.plans and m.c51_f.bwds_plans


def test_empty_cache_frees_modules_only_the_generated_memo_held(device, monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    mod = pydiff.load_module_from_source(f"s51_cache51_free_{next(_n)}", SOURCE, device=device)
    xs, g = _data(7)
    _check_f(_bwds_step(device, mod.c51_f, 0.5, xs, g), 0.5, xs, g)
    ref = weakref.ref(mod)
    del mod
    gc.collect()
    assert ref() is not None  # the generated-kernel memo's keys hold its function
    pydiff.empty_cache(device)
    gc.collect()
    assert ref() is None


def test_broadcast_gradient_kernels_made_again_after_empty_cache(device, m):
    xs, g = _data(3)
    _check_f(_bwds_step(device, m.c51_f, 2.0, xs, g), 2.0, xs, g)
    key = ("broadcast-grad", "kernels")
    before = device.cached(key, lambda: None)
    assert before is not None  # the broadcast reduction ran
    pydiff.empty_cache(device)
    _check_f(_bwds_step(device, m.c51_f, 2.0, xs, g), 2.0, xs, g)
    after = device.cached(key, lambda: None)
    assert after is not None and after is not before


def test_tape_step_after_empty_cache_fused_and_right(device, m):
    xs, g = _data(11)

    def step():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = m.c51_g(1.25, x)
        tape.backward(y, grad=g)
        return y.numpy(), x.grad.numpy()

    x64, g64 = xs.astype(np.float64), g.astype(np.float64)
    want_y = 1.25 * np.exp(0.5 * x64) - x64
    want_dx = g64 * (0.625 * np.exp(0.5 * x64) - 1.0)
    for clear in (False, True, True):
        if clear:
            pydiff.empty_cache(device)
        generated.reset_stats()
        y, dx = step()
        assert generated.stats().get("forward+backward fused") == 1, generated.stats()
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)


# -- a seed tensor made after a held forward ---------------------------------------------------


def _g_closed(a, x, g):
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    return a * np.exp(0.5 * x64) - x64, g64 * (0.5 * a * np.exp(0.5 * x64) - 1.0)


@pytest.mark.parametrize("n", [3000, 40000])  # (12 KB: joins the deferred list; 160 KB: not)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_seed_tensor_made_after_the_call_keeps_the_fused_step(device, m, n, requires_grad):
    rng = np.random.default_rng(n)
    xs = rng.uniform(-2, 2, n).astype(np.float32)
    g = rng.uniform(-1, 1, n).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    generated.reset_stats()
    with pydiff.Tape() as tape:
        y = m.c51_g(0.75, x)
    assert device.queue.held is not None
    seed = pydiff.tensor(g, device=device, requires_grad=requires_grad)
    assert device.queue.held is not None  # (the upload left the forward held)
    tape.backward(y, grad=seed)
    assert generated.stats().get("forward+backward fused") == 1, generated.stats()
    assert device.queue.held is None
    want_y, want_dx = _g_closed(0.75, xs, g)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(seed.numpy(), g)


def test_write_into_the_held_calls_input_records_the_forward_first(device, m):
    xs, g = _data(5)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.c51_g(0.75, x)
    assert device.queue.held is not None
    x.copy_from_numpy(np.zeros_like(xs))  # the held forward reads x: it runs before this
    assert device.queue.held is None
    np.testing.assert_allclose(y.numpy(), _g_closed(0.75, xs, g)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x.numpy(), np.zeros_like(xs))
    with pytest.raises(Exception, match="overwritten|modified|written"):
        tape.backward(y, grad=pydiff.tensor(g, device=device))


def test_write_into_the_held_result_and_copies_of_it_see_the_forward(device, m):
    xs, g = _data(6)
    want_y, want_dx = _g_closed(0.75, xs, g)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape():
        y = m.c51_g(0.75, x)
    copy = pydiff.tensor(y, device=device)  # a new tensor from the held result: read first
    np.testing.assert_allclose(copy.numpy(), want_y, rtol=1e-5, atol=1e-5)
    with pydiff.Tape():
        y2 = m.c51_g(0.75, x)
    assert device.queue.held is not None
    y2.copy_from_numpy(np.ones_like(xs))  # the held forward writes y2: it runs before this
    np.testing.assert_array_equal(y2.numpy(), np.ones_like(xs))
    # a fresh tensor between the call and a read of its result: the forward still lands
    with pydiff.Tape() as tape:
        y3 = m.c51_g(0.75, x)
    other = pydiff.tensor(g, device=device)
    np.testing.assert_allclose(y3.numpy(), want_y, rtol=1e-5, atol=1e-5)
    tape.backward(y3, grad=other)
    np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)


# -- kernel builds outside the locks every dispatch takes ----------------------------------------


def _dispatch_meanwhile(x, done):
    """Dispatch a warm kernel from another thread and wait (10 s at most) for it: a build
    holding a lock that dispatches take would keep it waiting until the build ends."""
    finished = threading.Event()

    def other():
        pydiff.ops.relu(x)
        finished.set()

    threading.Thread(target=other, daemon=True).start()
    done.append(finished.wait(10))


def test_op_kernel_build_leaves_other_threads_dispatching(device, monkeypatch):
    from pydiff.kernels import KernelCache

    x = pydiff.tensor(np.linspace(-1, 1, 256, dtype=np.float32), device=device)
    pydiff.ops.relu(x).numpy()  # (its kernel warm)
    done: list = []
    build = KernelCache._build

    def watched(self, *args, **kwargs):
        _dispatch_meanwhile(x, done)
        return build(self, *args, **kwargs)

    monkeypatch.setattr(KernelCache, "_build", watched)
    w = 4 * (97 + next(_n) % 50)  # (a width no other test multiplies: a new kernel)
    rng = np.random.default_rng(w)
    a_host = rng.uniform(-1, 1, (64, w)).astype(np.float32)
    b_host = rng.uniform(-1, 1, (w, w + 4)).astype(np.float32)
    a = pydiff.tensor(a_host, device=device)
    b = pydiff.tensor(b_host, device=device)
    y = pydiff.ops.matmul(a, b).numpy()
    assert done, "no kernel was built"
    assert all(done), "a dispatch of another thread waited for the whole build"
    want = a_host.astype(np.float64) @ b_host.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_slangpy_build_of_a_backward_leaves_other_threads_dispatching(device, monkeypatch):
    from slangpy.core.function import FunctionNode

    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1 << 30)  # (SlangPy's kernels)
    mod = pydiff.load_module_from_source(f"s51_cache51_b_{next(_n)}", SOURCE, device=device)
    x = pydiff.tensor(np.linspace(-1, 1, 256, dtype=np.float32), device=device)
    pydiff.ops.relu(x).numpy()
    xs, g = _data(13)
    xs, g = xs[:64], g[:64]
    a = pydiff.tensor(np.array([0.5], np.float32), device=device, requires_grad=True)
    t = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = mod.c51_f(a, t)  # (a broadcast: .bwds takes the scope's general path)
    y.numpy()
    done: list = []
    generate = FunctionNode.generate_call_data

    def watched(self, *args, **kwargs):
        _dispatch_meanwhile(x, done)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(FunctionNode, "generate_call_data", watched)
    idle = threading.Event()  # (another thread alive: built before the lock only then)
    companion = threading.Thread(target=idle.wait, daemon=True)
    companion.start()
    try:
        tape.backward(y, grad=g)
    finally:
        idle.set()
        companion.join()
    assert done, "no SlangPy kernel was built"
    assert all(done), "a dispatch of another thread waited for the whole build"
    x64, g64 = xs.astype(np.float64), g.astype(np.float64)
    np.testing.assert_allclose(t.grad.numpy(), g64 * (x64 + np.cos(x64)), rtol=1e-5, atol=1e-5)
    assert a.grad.numpy()[0] == pytest.approx(float(np.sum(g64 * x64**2)), rel=1e-5, abs=1e-4)
