"""Refused calls and backwards change nothing; the next good one gives exact gradients.

Every check is against NumPy copies taken before the call and closed forms (float64).
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import pydiff
from refused_calls import AlwaysRaises, N, bad_broadcast, fresh_module, upstream, with_grad

SOURCE = """
[Differentiable] float prod2(float a, float b) { return a * b; }
[Differentiable] float tri(float a, float b, float c) { return a * b * c; }
[Differentiable] float cube(float a) { return a * a * a; }
"""


@pytest.fixture
def mod(device):
    return fresh_module(device, "s40_brkg", SOURCE)


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


A = np.arange(1, N + 1, dtype=np.float64)
B = np.arange(2, N + 2, dtype=np.float64)


@pytest.mark.parametrize("then", ["reset", "accumulate", "strict"])
def test_refused_reset_then_each_policy_resets_once(device, mod, then):
    x, w, y = with_grad(device, A, 7.0), with_grad(device, B, 9.0), upstream(device)
    before = _state(x, w, y)
    for _ in range(3):
        with pydiff.zero_policy("reset"):
            with pytest.raises(ValueError):
                mod.prod2.bwds(x, bad_broadcast(device), _result=y)
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
    x, w, y = with_grad(device, A, 0.0), with_grad(device, B, 0.0), upstream(device)
    mod.prod2.bwds(x, w, _result=y)
    assert x.grad.storage.holds_result_of is not None
    before = _state(x, w, y)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.prod2.bwds(x, bad_broadcast(device), _result=y)
    _same(before, x, w, y)
    with pydiff.zero_policy("strict"):
        with pytest.raises(pydiff.StaleGradientError):
            mod.prod2.bwds(x, w, _result=y)
    _same(before, x, w, y)


def test_same_tensor_twice_refused_then_reset(device, mod):
    """tri(x, x, bad) refused under RESET; tri(x, x, w): d(x^2 w)/dx = 2 x w, reset once."""
    x, w, y = with_grad(device, A, 7.0), with_grad(device, B, 9.0), upstream(device)
    before = _state(x, w, y)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, x, bad_broadcast(device), _result=y)
        _same(before, x, w, y)
        mod.tri.bwds(x, x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * A * B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), A * A, rtol=1e-6)


def test_view_and_base_refused_then_reset(device, mod):
    """tri(x, x.reshape(N), bad) refused under RESET, then tri(x.reshape(2, 2)-shaped...)
    with the view as the second argument: d(x^2 w)/dx = 2 x w, the buffer reset once."""
    x, w, y = with_grad(device, A, 7.0), with_grad(device, B, 9.0), upstream(device)
    before = _state(x, w, y)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, x.reshape((N,)), bad_broadcast(device), _result=y)
        _same(before, x, w, y)
        mod.tri.bwds(x.reshape((N,)), x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * A * B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), A * A, rtol=1e-6)


def test_pending_zero_grad_kept_by_refused_call(device, mod):
    """x.zero_grad() (recorded, not yet run) then a refused RESET call: the user's zeroing
    still happens; w's gradient stays 9."""
    x, w, y = with_grad(device, A, 7.0), with_grad(device, B, 9.0), upstream(device)
    x.zero_grad()
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.prod2.bwds(w, bad_broadcast(device), _result=y)
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(N, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(N, 9.0, np.float32))
    mod.prod2.bwds(x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), B, rtol=1e-6)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_result_that_is_an_input(device, mod, policy):
    """cube.bwds(x, _result=x): the upstream and the gradient in one buffer. Refused (the
    threads would add into what others read) or exact; if refused, nothing changed."""
    x = with_grad(device, A, 2.0)
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
    x, w, y = with_grad(device, A, 7.0), with_grad(device, B, 9.0), upstream(device)
    bad = bad_broadcast(device)
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
    x = with_grad(device, A, 7.0)
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
    xs = [with_grad(device, A, 7.0), with_grad(device, B, 9.0)]
    ws = [with_grad(device, B, 3.0), with_grad(device, A, 4.0)]
    ys = [upstream(device), upstream(device)]
    bad = bad_broadcast(device)
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
    x = with_grad(device, xs, 0.0)
    out = upstream(device, 16)

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
    x, w, y = with_grad(device, A, 7.0), with_grad(device, B, 9.0), upstream(device)
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
    x, w, y = with_grad(device, a, 7.0), with_grad(device, b, 9.0), upstream(device, n)
    bad = with_grad(device, np.ones(n - 1), 5.0)
    before = _state(x, w, y)
    with pydiff.zero_policy(policy):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, w, bad, _result=y)
        _same(before, x, w, y)
        mod.tri.bwds(x, w, 2.0, _result=y)
    base_x, base_w = (0.0, 0.0) if policy == "reset" else (7.0, 9.0)
    np.testing.assert_allclose(x.grad.numpy(), base_x + 2 * b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), base_w + 2 * a, rtol=1e-5)


MORE = """import slangpy;
[Differentiable] void scale(inout float a, float b) { a = a * b; }
[Differentiable] void race(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ y[0] = x[idx]; }
"""


@pytest.fixture
def more(device):
    return fresh_module(device, "s40_brkg_more", MORE)


def test_inout_refused_under_reset_then_exact(device, more):
    """scale(inout a, b): a' = a b. x.grad holds the upstream 2; refused with a bad b, then
    good: x.grad = 2 b (dL/d a before), w.grad = 2 a (RESET: from zero)."""
    x, w = with_grad(device, A, 2.0), with_grad(device, B, 9.0)
    before = _state(x, w)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            more.scale.bwds(x, bad_broadcast(device))
        _same(before, x, w)
        more.scale.bwds(x, w)
    np.testing.assert_allclose(x.grad.numpy(), 2 * B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), 2 * A, rtol=1e-6)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_counted_race_refused_under_policy(device, more, policy):
    import slangpy as spy

    x = with_grad(device, A, 7.0)
    y = with_grad(device, np.zeros(N), 1.0)
    before = _state(x, y)
    with pydiff.zero_policy(policy):
        for _ in range(2):
            with pytest.raises(ValueError):
                more.race.bwds(spy.grid((N,)), x, y)
            _same(before, x, y)


def test_deterministic_broadcast_refused_under_reset(device, mod):
    """x of shape (1,) broadcast in deterministic mode (summed apart): refused, then good."""
    x, w, y = with_grad(device, [1.5], 7.0), with_grad(device, B, 9.0), upstream(device)
    before = _state(x, w, y)
    with pydiff.deterministic(), pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, w, bad_broadcast(device), _result=y)
        _same(before, x, w, y)
        mod.tri.bwds(x, w, 2.0, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), [2 * B.sum()], rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), np.full(N, 3.0), rtol=1e-6)


def test_replay_refused_for_policy_then_exact(device, mod):
    """A tape step captured under RESET, replayed under ACCUMULATE: refused, nothing ran;
    under RESET again: d(x^3)/dx = 3x^2 from zero."""
    xs = np.linspace(0.5, 1.5, 16)
    x = with_grad(device, xs, 0.0)

    def step():
        with pydiff.Tape() as tape:
            y = mod.cube(x, _result="tensor")
        tape.backward(y, grad=np.ones(16, np.float32), retain_graph=False)

    with pydiff.zero_policy("reset"):
        step()
        captured = pydiff.capture(step)
    x.grad.copy_from_numpy(np.full(16, 5.0, np.float32))
    before = _state(x)
    with pytest.raises(pydiff.CaptureError):
        captured.replay()
    _same(before, x)
    with pydiff.zero_policy("reset"):
        captured.replay()
    np.testing.assert_allclose(x.grad.numpy(), 3 * xs**2, rtol=1e-6)


RACE_VEC = """import slangpy;
[Differentiable] void race_v(float v, IWDiffTensor<float, 1> y) { y[0] = v; }
"""


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_counted_vectorised_race_refused(device, policy):
    """No grid (RESET's zeroing held back and the stores counted): every thread stores y[0],
    refused after the kernel; v's gradient and y's upstream as they were."""
    m = fresh_module(device, "s40_brkg_rv", RACE_VEC)
    v = with_grad(device, A, 7.0)
    y = with_grad(device, np.zeros(N), 1.0)
    before = _state(v, y)
    with pydiff.zero_policy(policy):
        for _ in range(2):
            with pytest.raises(ValueError):
                m.race_v.bwds(v, y)
            _same(before, v, y)


class _StrGrad(pydiff.Function):
    @staticmethod
    def forward(ctx, a, b):
        return pydiff.tensor(a.numpy() * b.numpy(), device=a.device)

    @staticmethod
    def backward(ctx, g):
        return np.ones(N, np.float32), np.array(["x"] * N)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_function_gradient_that_cannot_be_added(device, policy):
    """Input 1's gradient has the right shape but strings: input 0's must not be added."""
    x, w = with_grad(device, A, 7.0), with_grad(device, B, 9.0)
    before = _state(x, w)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            y = _StrGrad.apply(x, w)
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            tape.backward(y, grad=np.ones(N, np.float32))
    _same(before, x, w)


@pytest.mark.parametrize("policy", ["reset", "accumulate", "strict"])
def test_tape_bad_seed_changes_nothing(device, mod, policy):
    x = with_grad(device, A, 7.0)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            y = mod.cube(x, _result="tensor")
        before = _state(x)
        with pytest.raises((ValueError, TypeError)):
            tape.backward(y, grad=np.ones(N + 1, np.float32))
        _same(before, x)
        if policy == "strict":
            x.grad.copy_from_numpy(np.full(N, 7.0, np.float32))
        tape.backward(y, grad=np.ones(N, np.float32))
    base = 0.0 if policy == "reset" else 7.0
    np.testing.assert_allclose(x.grad.numpy(), base + 3 * A**2, rtol=1e-6)


def test_strict_after_refused_tape_backward(device, mod):
    """A good backward marks x.grad; zero_grad clears the mark; a refused backward (a
    Function refusing) must not leave a mark: the next STRICT backward runs."""
    _FailsOnce.fail = True
    x = with_grad(device, A, 0.0)
    with pydiff.zero_policy("strict"):
        with pydiff.Tape() as tape:
            h = _FailsOnce.apply(x)
            y = mod.prod2(x, h, _result="tensor")
        with pytest.raises(ValueError, match="refused once"):
            tape.backward(y, grad=np.ones(N, np.float32), retain_graph=True)
        assert x.grad.storage.holds_result_of is None
        tape.backward(y, grad=np.ones(N, np.float32), retain_graph=True)
        np.testing.assert_allclose(x.grad.numpy(), 4 * A, rtol=1e-6)
        with pytest.raises(pydiff.StaleGradientError):
            tape.backward(y, grad=np.ones(N, np.float32), retain_graph=True)
    np.testing.assert_allclose(x.grad.numpy(), 4 * A, rtol=1e-6)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_refused_without_retain_graph_then_retry(device, mod, policy):
    """retain_graph=False and the backward refused: the recording must be kept for a retry
    (or the retry refused loudly), never a silent wrong gradient."""
    _FailsOnce.fail = True
    x = with_grad(device, A, 7.0)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            h = _FailsOnce.apply(x)
            y = mod.prod2(x, h, _result="tensor")
        with pytest.raises(ValueError, match="refused once"):
            tape.backward(y, grad=np.ones(N, np.float32), retain_graph=False)
        try:
            tape.backward(y, grad=np.ones(N, np.float32), retain_graph=False)
        except RuntimeError:
            np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
            return
    base = 0.0 if policy == "reset" else 7.0
    np.testing.assert_allclose(x.grad.numpy(), base + 4 * A, rtol=1e-6)


def test_shared_grads_refused_then_reset_once(device, mod):
    """u shares x's gradient buffers: tri(x, u, bad) refused; tri(x, u, w) under RESET adds
    both parameters' gradients into the one buffer from zero: u w + x w."""
    x, w, y = with_grad(device, A, 7.0), with_grad(device, B, 9.0), upstream(device)
    u = pydiff.tensor(np.float32(3 * A), device=device)
    u.share_grads(x)
    before = _state(x, w, y)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, u, bad_broadcast(device), _result=y)
        _same(before, x, w, y)
        mod.tri.bwds(x, u, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 3 * A * B + A * B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), 3 * A * A, rtol=1e-6)


def test_mixed_own_policies_strict_refuses_first(device, mod):
    """x RESET (its own), w STRICT (its own) holding a result: refused before x is zeroed."""
    x, w, y = with_grad(device, A, 0.0), with_grad(device, B, 0.0), upstream(device)
    mod.prod2.bwds(x, w, _result=y)  # marks both
    x.zero_policy, w.zero_policy = "reset", "strict"
    before = _state(x, w, y)
    for _ in range(2):
        with pytest.raises(pydiff.StaleGradientError):
            mod.prod2.bwds(x, w, _result=y)
        _same(before, x, w, y)
    w.zero_grad()
    mod.prod2.bwds(x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), A, rtol=1e-6)


def test_pending_forward_runs_despite_refused_call(device, mod):
    """Planned forward calls (deferred) then a refused RESET .bwds: the forwards still run,
    in order, and the next good .bwds reads their results."""
    x, y = with_grad(device, A, 7.0), upstream(device)
    out = pydiff.zeros((N,), device=device)
    for _ in range(3):  # (the layout's plan: deferred from the second call)
        mod.cube(x, _result=out)
    x.copy_from_numpy(np.float32(2 * A))
    mod.cube(x, _result=out)
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.prod2.bwds(x, bad_broadcast(device), _result=y)
        np.testing.assert_allclose(out.numpy(), 8 * A**3, rtol=1e-6)
        mod.cube.bwds(x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 12 * A**2, rtol=1e-6)


class _CallsBwds(pydiff.Function):
    """backward adds d(a^3)/da through a shader .bwds into ctx.grad_target(0); mode 'bad'
    passes an argument SlangPy refuses."""

    mod = None
    bad = None

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return pydiff.tensor(a.numpy() ** 3, device=a.device)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        target = ctx.grad_target(0)
        arg = a.detach().with_grads(grad_in=target, grad_out=target)
        up = pydiff.zeros(g.shape, device=g.device).with_grads(grad_in=g, grad_out=g)
        if _CallsBwds.bad is not None:
            _CallsBwds.mod.prod2.bwds(arg, _CallsBwds.bad, _result=up)
        else:
            _CallsBwds.mod.cube.bwds(arg, _result=up)
        return None


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_function_backward_with_refused_bwds(device, mod, policy):
    _CallsBwds.mod, _CallsBwds.bad = mod, bad_broadcast(device)
    x, w = with_grad(device, A, 7.0), with_grad(device, B, 9.0)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            h = _CallsBwds.apply(x)
            y = mod.prod2(w, h, _result="tensor")
        before = _state(x, w)
        with pytest.raises(ValueError):
            tape.backward(y, grad=np.ones(N, np.float32), retain_graph=True)
        _same(before, x, w)
        _CallsBwds.bad = None
        tape.backward(y, grad=np.ones(N, np.float32), retain_graph=True)
    base_x, base_w = (0.0, 0.0) if policy == "reset" else (7.0, 9.0)
    np.testing.assert_allclose(w.grad.numpy(), base_w + A**3, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), base_x + 3 * A**2 * B, rtol=1e-6)


INPLACE = """
[Differentiable] void scale(inout float a, float b) { a = a * b; }
[Differentiable] float prod2(float a, float b) { return a * b; }
"""


def test_overwritten_leaves_all_checked_before_reset(device):
    """Two leaves a tape's calls overwrite: x1 under RESET, x2 STRICT holding a result. The
    backward refuses x2: x1's gradient must not have been zeroed (it was, before the fix:
    the leaves were checked and reset one by one). After x2.zero_grad(): x1' = x1 w,
    x2' = x2 w, y = x1' x2': dx1 = x2 w^2, dx2 = x1 w^2, dw = 2 x1 x2 w."""
    m = fresh_module(device, "s40_brkg_ip", INPLACE)
    m.scale.bwds(with_grad(device, A, 1.0), with_grad(device, A, 0.0))  # (both ran: no keeper)
    m.prod2.bwds(with_grad(device, A, 0.0), with_grad(device, A, 0.0), _result=upstream(device))
    x1, x2, w = with_grad(device, A, 7.0), with_grad(device, B, 0.0), with_grad(device, A, 9.0)
    m.prod2.bwds(x2, 2.0, _result=upstream(device))  # x2.grad holds a result: 2
    x2.zero_policy = "strict"
    with pydiff.zero_policy("reset"):
        with pydiff.Tape() as tape:
            m.scale(x1, w)
            m.scale(x2, w)
            y = m.prod2(x1, x2, _result="tensor")
        before = _state(x1, x2, w)
        with pytest.raises(pydiff.StaleGradientError, match="overwritten"):
            tape.backward(y, grad=np.ones(N, np.float32))
        _same(before, x1, x2, w)
        x2.zero_grad()
        tape.backward(y, grad=np.ones(N, np.float32))
    np.testing.assert_allclose(x1.grad.numpy(), B * A**2, rtol=1e-6)
    np.testing.assert_allclose(x2.grad.numpy(), A * A**2, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), 2 * A * B * A, rtol=1e-6)


class _Prod(pydiff.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return pydiff.tensor(a.numpy() * b.numpy(), device=a.device)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g = g.numpy()
        return g * b.numpy(), g * a.numpy()


def test_function_inputs_reset_then_strict_refused(device, mod):
    """A Function's inputs: x RESET (global), w STRICT (its own) holding a result: refused,
    x's gradient as it was; after w.zero_grad(): d(ab)/da = b, d/db = a."""
    x, w = with_grad(device, A, 7.0), with_grad(device, B, 0.0)
    mod.prod2.bwds(w, 2.0, _result=upstream(device))
    w.zero_policy = "strict"
    with pydiff.zero_policy("reset"):
        with pydiff.Tape() as tape:
            y = _Prod.apply(x, w)
        before = _state(x, w)
        with pytest.raises(pydiff.StaleGradientError):
            tape.backward(y, grad=np.ones(N, np.float32))
        _same(before, x, w)
        w.zero_grad()
        tape.backward(y, grad=np.ones(N, np.float32))
    np.testing.assert_allclose(x.grad.numpy(), B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), A, rtol=1e-6)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_threads_tape_backwards_one_refused(device, mod, policy):
    """Two threads' tape backwards at once: one always refused (its gradients as they were),
    the other exact each time: y = x * x (through prod2) and a Function-free path."""
    xa, xb = with_grad(device, A, 7.0), with_grad(device, B, 3.0)
    before = _state(xa)
    errors, got = [], []
    barrier = threading.Barrier(2)

    def refused():
        barrier.wait()
        for _ in range(15):
            with pydiff.zero_policy(policy):
                with pydiff.Tape() as tape:
                    h = AlwaysRaises.apply(xa)
                    y = mod.prod2(xa, h, _result="tensor")
                try:
                    tape.backward(y, grad=np.ones(N, np.float32), retain_graph=False)
                except ValueError:
                    continue
            errors.append("not refused")

    def good():
        barrier.wait()
        for _ in range(15):
            with pydiff.zero_policy("reset"):
                with pydiff.Tape() as tape:
                    y = mod.prod2(xb, xb, _result="tensor")
                tape.backward(y, grad=np.ones(N, np.float32), retain_graph=False)
            got.append(xb.grad.numpy().copy())

    th = [threading.Thread(target=refused), threading.Thread(target=good)]
    for t in th:
        t.start()
    for t in th:
        t.join(300)
    assert not errors and len(got) == 15
    _same(before, xa)
    for g in got:
        np.testing.assert_allclose(g, 2 * B, rtol=1e-6)


def test_tape_after_refused_eager_call_is_exact(device, mod):
    """A refused eager .bwds between a tape's forward and its backward changes no version
    the tape checks: the backward runs, exact."""
    x, w = with_grad(device, A, 7.0), with_grad(device, B, 9.0)
    with pydiff.Tape() as tape:
        y = mod.tri(x, w, 2.0, _result="tensor")
    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError):
            mod.tri.bwds(x, w, bad_broadcast(device), _result=upstream(device))
        tape.backward(y, grad=np.ones(N, np.float32))
    np.testing.assert_allclose(x.grad.numpy(), 2 * B, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), 2 * A, rtol=1e-6)


def test_many_refused_backwards_hold_no_memory(device, mod, more):
    """Refused tape backwards (their gradient copies) and refused counted calls, in loops:
    the buffer pool and the live objects stay flat."""
    import slangpy as spy

    x = with_grad(device, A, 7.0)
    v, yv = with_grad(device, A, 3.0), with_grad(device, np.zeros(N), 1.0)
    before = _state(x, v, yv)

    def refuse(k):
        for _ in range(k):
            with pydiff.zero_policy("reset"):
                with pydiff.Tape() as tape:
                    h = AlwaysRaises.apply(x)
                    y = mod.prod2(x, h, _result="tensor")
                with pytest.raises(ValueError):
                    tape.backward(y, grad=np.ones(N, np.float32), retain_graph=False)
                with pytest.raises(ValueError):
                    more.race.bwds(spy.grid((N,)), v, yv)

    sizes = []
    for _ in range(6):
        refuse(25)
        gc.collect()
        sizes.append((device.pool.bytes, len(gc.get_objects())))
    assert sizes[-1][0] <= sizes[2][0]  # (the pool warms up: cycles freed by the collector)
    assert sizes[-1][1] - sizes[2][1] < 300
    _same(before, x, v, yv)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_fixed_point_adjoint_refused_then_exact(device, policy):
    """y = x* b with x* = a x* - 1 (a = 2: found at once from 1, the adjoint diverges):
    b's gradient (added before the adjoint solve) and a's as they were. Then a = 0.5,
    x* = a x* + 1 = 2: dy/da = b / (1 - a)^2 = 4 b, dy/db = 2."""
    a = pydiff.tensor(np.float32([2.0]), device=device, requires_grad=True)
    b = pydiff.tensor(np.float32([3.0]), device=device, requires_grad=True)
    a.grad.copy_from_numpy(np.float32([7.0]))
    b.grad.copy_from_numpy(np.float32([9.0]))
    before = _state(a, b)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            x = pydiff.fixed_point(lambda x, a: a * x - 1.0, np.ones(1), a)
            y = x * b
        with pytest.raises(pydiff.ConvergenceError):
            tape.backward(y)
        _same(before, a, b)
        a.copy_from_numpy(np.float32([0.5]))
        with pydiff.Tape() as tape:
            x = pydiff.fixed_point(lambda x, a: a * x + 1.0, np.zeros(1), a)
            y = x * b
        tape.backward(y)
    base_a, base_b = (0.0, 0.0) if policy == "reset" else (7.0, 9.0)
    np.testing.assert_allclose(a.grad.numpy(), [base_a + 12.0], rtol=1e-4)
    np.testing.assert_allclose(b.grad.numpy(), [base_b + 2.0], rtol=1e-4)


FIXED = """import pydiff;
[Differentiable] float gather_first(FwdDiffTensor<1> w, float x) { return w.load({0}) * x; }
[Differentiable] float prod2(float a, float b) { return a * b; }
"""


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_fixed_point_overflow_refused_leaves_gradients(device, policy):
    """gather_first(w, x) = w[0] x: x of 3e9 puts w's fixed-point sum out of range, refused
    (GradientOverflowError) after the kernels ran: x's gradient (added, or RESET zeroed and
    added, before the fix) and w's as they were, unmarked. Then x of 1, 2: dw = 3, dx = w."""
    m = fresh_module(device, "s40_brkg_fx", FIXED)
    w = with_grad(device, [1.5], 7.0)
    x = pydiff.tensor(np.float32([3e9, 3e9]), device=device, requires_grad=True)
    x.grad.copy_from_numpy(np.float32([9.0, 9.0]))
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    before = _state(w, x, y)
    with pydiff.zero_policy(policy):
        for _ in range(3):  # (later calls: a plan for the layout, if any)
            with pytest.raises(pydiff.GradientOverflowError):
                m.gather_first.bwds(w, x, _result=y)
            _same(before, w, x, y)
            assert x.grad.storage.holds_result_of is None
        x.copy_from_numpy(np.float32([1.0, 2.0]))
        m.gather_first.bwds(w, x, _result=y)
    base_w, base_x = (0.0, 0.0) if policy == "reset" else (7.0, 9.0)
    np.testing.assert_allclose(w.grad.numpy(), [base_w + 3.0], rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), [base_x + 1.5] * 2, rtol=1e-6)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_fixed_point_overflow_in_tape_backward_leaves_gradients(device, policy):
    """z = prod2(gather_first(w, x), v): the backward adds v's gradient, then w's fixed-point
    sum overflows: every gradient put back. Then small x: dz/dw = sum x v, dz/dv = w x."""
    m = fresh_module(device, "s40_brkg_fxt", FIXED)
    w = with_grad(device, [1.5], 7.0)
    x = pydiff.tensor(np.float32([3e9, 3e9]), device=device, requires_grad=True)
    v = pydiff.tensor(np.float32([1.0, 1.0]), device=device, requires_grad=True)
    x.grad.copy_from_numpy(np.float32([9.0, 9.0]))
    v.grad.copy_from_numpy(np.float32([5.0, 5.0]))
    m.gather_first.bwds(w.detach(), pydiff.tensor(np.float32([1, 1]), device=device), _result=1.0)
    w.grad.copy_from_numpy(np.float32([7.0]))
    before = _state(w, x, v)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            z = m.prod2(m.gather_first(w, x, _result="tensor"), v, _result="tensor")
        with pytest.raises(pydiff.GradientOverflowError):
            tape.backward(z, grad=np.ones(2, np.float32))
        _same(before, w, x, v)
        x.copy_from_numpy(np.float32([1.0, 2.0]))
        v.copy_from_numpy(np.float32([3.0, 4.0]))
        with pydiff.Tape() as tape:
            z = m.prod2(m.gather_first(w, x, _result="tensor"), v, _result="tensor")
        tape.backward(z, grad=np.ones(2, np.float32))
    base = (0.0, 0.0, 0.0) if policy == "reset" else (7.0, 9.0, 5.0)
    np.testing.assert_allclose(w.grad.numpy(), [base[0] + 11.0], rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), base[1] + 1.5 * np.array([3.0, 4.0]), rtol=1e-6)
    np.testing.assert_allclose(v.grad.numpy(), base[2] + 1.5 * np.array([1.0, 2.0]), rtol=1e-6)
