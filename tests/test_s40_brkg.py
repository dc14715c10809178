"""Refused calls and backwards change nothing; the next good one gives exact gradients.

Every check is against NumPy copies taken before the call and closed forms (float64).
"""

from __future__ import annotations

import gc
import itertools
import threading

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] float prod2(float a, float b) { return a * b; }
[Differentiable] float tri(float a, float b, float c) { return a * b * c; }
[Differentiable] float cube(float a) { return a * a * a; }
"""
_names = itertools.count()
N = 4


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source(f"s40_brkg_{next(_names)}", SOURCE, device=device)


def _t(device, values, grad_fill):
    t = pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=True)
    t.grad.copy_from_numpy(np.full(t.shape, grad_fill, np.float32))
    return t


def _bad(device):  # a later argument SlangPy refuses when it binds the call
    return _t(device, np.arange(N - 1), 5.0)


def _state(*ts):
    return [
        (t.numpy().copy(), t.grad.numpy().copy(), t.grad.storage.version, t.storage.version)
        for t in ts
    ]


def _same(before, *ts):
    for (v, g, gv, sv), t in zip(before, ts):
        np.testing.assert_array_equal(t.numpy(), v)
        np.testing.assert_array_equal(t.grad.numpy(), g)
        assert t.grad.storage.version == gv
        assert t.storage.version == sv


def _up(device, n=N):
    return pydiff.zeros((n,), device=device).with_grads(ones=True)


A = np.arange(1, N + 1, dtype=np.float64)
B = np.arange(2, N + 2, dtype=np.float64)


@pytest.mark.parametrize("then", ["reset", "accumulate", "strict"])
def test_refused_reset_then_each_policy_resets_once(device, mod, then):
    x, w, y = _t(device, A, 7.0), _t(device, B, 9.0), _up(device)
    before = _state(x, w, y)
    for _ in range(3):
        with pydiff.zero_policy("reset"):
            with pytest.raises(ValueError):
                mod.prod2.bwds(x, _bad(device), _result=y)
        _same(before, x, w, y)
    if then == "strict":  # the buffers hold upstreams the user wrote: not stale
        with pydiff.zero_policy("strict"):
            mod.prod2.bwds(x, w, _result=y)
        base_x, base_w = 7.0, 9.0
    else:
        with pydiff.zero_policy(then):
            mod.prod2.bwds(x, w, _result=y)
            mod_seen = x.grad.numpy().copy()
        base_x, base_w = (0.0, 0.0) if then == "reset" else (7.0, 9.0)
        np.testing.assert_allclose(mod_seen, base_x + B, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), base_x + B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), base_w + A, rtol=1e-6)


def test_strict_mark_survives_a_refused_reset(device, mod):
    """A good call marks x.grad as a result; a refused RESET call must not clear the mark:
    STRICT still refuses afterwards."""
    x, w, y = _t(device, A, 0.0), _t(device, B, 0.0), _up(device)
    mod.prod2.bwds(x, w, _result=y)
    assert x.grad.storage.holds_result_of is not None
    before = _state(x, w, y)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.prod2.bwds(x, _bad(device), _result=y)
    _same(before, x, w, y)
    with pydiff.zero_policy("strict"):
        with pytest.raises(pydiff.StaleGradientError):
            mod.prod2.bwds(x, w, _result=y)
    _same(before, x, w, y)


def test_same_tensor_twice_refused_then_reset(device, mod):
    """tri(x, x, bad) refused under RESET; tri(x, x, w): d(x^2 w)/dx = 2 x w, reset once."""
    x, w, y = _t(device, A, 7.0), _t(device, B, 9.0), _up(device)
    before = _state(x, w, y)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, x, _bad(device), _result=y)
        _same(before, x, w, y)
        mod.tri.bwds(x, x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * A * B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), A * A, rtol=1e-6)


def test_view_and_base_refused_then_reset(device, mod):
    """tri(x, x.reshape(N), bad) refused under RESET, then tri(x.reshape(2, 2)-shaped...)
    with the view as the second argument: d(x^2 w)/dx = 2 x w, the buffer reset once."""
    x, w, y = _t(device, A, 7.0), _t(device, B, 9.0), _up(device)
    before = _state(x, w, y)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, x.reshape((N,)), _bad(device), _result=y)
        _same(before, x, w, y)
        mod.tri.bwds(x.reshape((N,)), x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * A * B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), A * A, rtol=1e-6)


def test_pending_zero_grad_kept_by_refused_call(device, mod):
    """x.zero_grad() (recorded, not yet run) then a refused RESET call: the user's zeroing
    still happens; w's gradient stays 9."""
    x, w, y = _t(device, A, 7.0), _t(device, B, 9.0), _up(device)
    x.zero_grad()
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.prod2.bwds(w, _bad(device), _result=y)
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(N, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(N, 9.0, np.float32))
    mod.prod2.bwds(x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), B, rtol=1e-6)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_result_that_is_an_input(device, mod, policy):
    """cube.bwds(x, _result=x): the upstream and the gradient in one buffer. Refused (the
    threads would add into what others read) or exact; if refused, nothing changed."""
    x = _t(device, A, 2.0)
    before = _state(x)
    with pydiff.zero_policy(policy):
        try:
            mod.cube.bwds(x, _result=x)
        except (ValueError, TypeError):
            _same(before, x)
            return
    # with a shared buffer the only sound answer is a refusal; an answer must be exact
    base = 0.0 if policy == "reset" else 2.0
    np.testing.assert_allclose(x.grad.numpy(), base + 2.0 * 3 * A * A, rtol=1e-6)


def test_many_refused_calls_hold_no_memory(device, mod):
    x, w, y = _t(device, A, 7.0), _t(device, B, 9.0), _up(device)
    bad = _bad(device)
    before = _state(x, w, y)

    def refuse(k):
        for _ in range(k):
            with pydiff.zero_policy("reset"):
                with pytest.raises(ValueError):
                    mod.prod2.bwds(x, bad, _result=y)

    refuse(20)
    gc.collect()
    pool = device.pool.bytes
    objects = len(gc.get_objects())
    refuse(200)
    gc.collect()
    assert device.pool.bytes == pool
    assert len(gc.get_objects()) - objects < 200
    _same(before, x, w, y)
    with pydiff.zero_policy("reset"):
        mod.prod2.bwds(x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), B, rtol=1e-6)


class _FailsOnce(pydiff.Function):
    fail = True

    @staticmethod
    def forward(ctx, a):
        return pydiff.tensor(2 * a.numpy(), device=a.device)

    @staticmethod
    def backward(ctx, g):
        if _FailsOnce.fail:
            _FailsOnce.fail = False
            raise ValueError("refused once")
        return 2 * np.asarray(g.numpy() if hasattr(g, "numpy") else g, np.float32)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_tape_refused_with_retain_graph_then_again(device, mod, policy):
    """y = x * (2x) through a Function that refuses once: the retained graph's second
    backward gives d(2x^2)/dx = 4x on top of what was there (ACCUMULATE) or alone (RESET)."""
    _FailsOnce.fail = True
    x = _t(device, A, 7.0)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            h = _FailsOnce.apply(x)
            y = mod.prod2(x, h, _result="tensor")
        before = _state(x)
        with pytest.raises(ValueError, match="refused once"):
            tape.backward(y, grad=np.ones(N, np.float32), retain_graph=True)
        _same(before, x)
        tape.backward(y, grad=np.ones(N, np.float32), retain_graph=True)
    base = 0.0 if policy == "reset" else 7.0
    np.testing.assert_allclose(x.grad.numpy(), base + 4 * A, rtol=1e-6)


def test_threads_one_refused(device, mod):
    """Two threads at once under RESET: one's calls all refused, the other's all good."""
    xs, ws = [_t(device, A, 7.0), _t(device, B, 9.0)], [_t(device, B, 3.0), _t(device, A, 4.0)]
    ys = [_up(device), _up(device)]
    bad = _bad(device)
    before = _state(xs[0], ws[0], ys[0])
    errors, got = [], []
    barrier = threading.Barrier(2)

    def refused():
        barrier.wait()
        for _ in range(40):
            with pydiff.zero_policy("reset"):
                try:
                    mod.prod2.bwds(xs[0], bad, _result=ys[0])
                except ValueError:
                    continue
            errors.append("not refused")

    def good():
        barrier.wait()
        for _ in range(40):
            with pydiff.zero_policy("reset"):
                mod.prod2.bwds(xs[1], ws[1], _result=ys[1])
            got.append(xs[1].grad.numpy().copy())

    th = [threading.Thread(target=refused), threading.Thread(target=good)]
    for t in th:
        t.start()
    for t in th:
        t.join(120)
    assert not errors
    _same(before, xs[0], ws[0], ys[0])
    for g in got:
        np.testing.assert_allclose(g, A, rtol=1e-6)
    np.testing.assert_allclose(ws[1].grad.numpy(), B, rtol=1e-6)


def test_deterministic_toggled_between_capture_replay_eager(device, mod):
    xs = np.linspace(0.5, 1.5, 16)
    x = _t(device, xs, 0.0)
    out = _up(device, 16)

    def step():
        mod.cube(x, _result=out)
        mod.cube.bwds(x, _result=out)

    captured = pydiff.capture(step)
    g1 = 3 * xs**2
    np.testing.assert_allclose(x.grad.numpy(), g1, rtol=1e-6)
    before = _state(x, out)
    with pydiff.deterministic():
        with pytest.raises(pydiff.CaptureError):
            captured.replay()
        _same(before, x, out)
        mod.cube.bwds(x, _result=out)  # eager, in the mode
    np.testing.assert_allclose(x.grad.numpy(), 2 * g1, rtol=1e-6)
    captured.replay()
    np.testing.assert_allclose(x.grad.numpy(), 3 * g1, rtol=1e-6)


def test_capture_of_reset_bwds_refused_or_exact(device, mod):
    x, w, y = _t(device, A, 7.0), _t(device, B, 9.0), _up(device)
    with pydiff.zero_policy("reset"):
        mod.prod2.bwds(x, w, _result=y)  # eager once
    x.grad.copy_from_numpy(np.full(N, 7.0, np.float32))
    w.grad.copy_from_numpy(np.full(N, 9.0, np.float32))
    before = _state(x, w, y)

    def step():
        mod.prod2.bwds(x, w, _result=y)

    with pydiff.zero_policy("reset"):
        try:
            captured = pydiff.capture(step)
        except pydiff.CaptureError:
            _same(before, x, w, y)
            return
        x.grad.copy_from_numpy(np.full(N, 7.0, np.float32))
        captured.replay()
    np.testing.assert_allclose(x.grad.numpy(), B, rtol=1e-6)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_large_call_refused_then_exact(device, mod, policy):
    """Past the generated kernels' threshold (4096)."""
    n = 4096
    a = np.linspace(0.5, 2.0, n)
    b = np.linspace(-1.0, 1.0, n)
    x, w, y = _t(device, a, 7.0), _t(device, b, 9.0), _up(device, n)
    bad = _t(device, np.ones(n - 1), 5.0)
    before = _state(x, w, y)
    with pydiff.zero_policy(policy):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, w, bad, _result=y)
        _same(before, x, w, y)
        mod.tri.bwds(x, w, 2.0, _result=y)
    base_x, base_w = (0.0, 0.0) if policy == "reset" else (7.0, 9.0)
    np.testing.assert_allclose(x.grad.numpy(), base_x + 2 * b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), base_w + 2 * a, rtol=1e-5)
