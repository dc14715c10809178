"""pydiff.capture of steps that call a user's Slang function: calls its call plan runs on
pydiff's generated kernel are recorded (a layout's first call too) and replay as NumPy's
float64 closed forms say; Python numbers are frozen at capture; zeroing policies on replay
(ACCUMULATE adds per replay, zero_grad in the step resets, RESET re-zeroes, STRICT refused);
whatever SlangPy's kernel would run is refused, naming the function and why."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import optim

SOURCE = """
[Differentiable] float cu_sq(float a, float x, float t, float w)
{
    float r = w * x - t;
    return a * r * r;
}
[Differentiable] float cu_int(int k, float x) { return x * float(k); }
[Differentiable] void cu_inout(float s, inout float v) { v = v * s; }
[Differentiable] float3 cu_vec(float s, float3 v) { return float3(s) * v * v; }
struct CuParams { float a; float b; };
[Differentiable] float cu_struct(CuParams p, float x) { return p.a * x + p.b; }
"""
N = 16
RNG = np.random.default_rng(39)


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s39_capuser", SOURCE, device=device)


def _t(values, device, grad=True):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=grad)


def _data(n=N):
    return RNG.standard_normal(n).astype(np.float32), RNG.standard_normal(n).astype(np.float32)


def _dw(a, x, t, w):  # d/dw of a (w x - t)^2, float64
    return 2.0 * a * (w * x - t) * x


@pytest.mark.parametrize("n", [N, 5000])  # 5000: past generated.MIN_ELEMENTS
def test_forward_bwds_sgd_step_captured_on_first_call_replays_like_numpy(device, mod, n):
    """Forward into a given _result, .bwds, SGD: captured without an eager step first (the
    layouts' first calls make the plans), replayed with new data copied in."""
    a, lr = 0.75, 0.1
    x0, t0 = _data(n)
    w_np = RNG.standard_normal(n).astype(np.float64)
    x, t, w = _t(x0, device), _t(t0, device), _t(w_np, device)
    out = pydiff.zeros((n,), device=device).with_grads(ones=True)
    opt = optim.SGD([w], lr=lr)

    def step():
        opt.zero_grad()
        mod.cu_sq(a, x, t, w, _result=out)
        mod.cu_sq.bwds(a, x, t, w, _result=out)
        opt.step()
        return out

    w.grad.zero_()
    opt.step()  # SGD's state (a zero step: w unchanged); cu_sq's layouts first seen below
    assert not mod.cu_sq.plans and not mod.cu_sq.bwds_plans
    xg_want = np.zeros(n)  # x's gradient: never zeroed, ACCUMULATE adds once per step
    captured = pydiff.capture(step)
    xs, ts = [x0], [t0]
    for _ in range(4):
        xb, tb = _data(n)
        xs.append(xb)
        ts.append(tb)
        x.copy_from_numpy(xb)
        t.copy_from_numpy(tb)
        captured.replay()
    for xb, tb in zip(xs, ts):
        xb, tb = xb.astype(np.float64), tb.astype(np.float64)
        loss = a * (w_np * xb - tb) ** 2
        g = _dw(a, xb, tb, w_np)
        xg_want += 2.0 * a * (w_np * xb - tb) * w_np
        w_np = w_np - lr * g
    np.testing.assert_allclose(out.numpy(), loss, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), g, rtol=1e-4, atol=1e-5)  # this step's only
    np.testing.assert_allclose(w.numpy(), w_np, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), xg_want, rtol=1e-4, atol=1e-4)
    assert captured.replays == 4


def test_new_result_forward_captured_replays_with_new_inputs(device, mod):
    """A forward making its result (``_result="tensor"``, and none given) is recorded: the
    tensor it returned holds each replay's values."""
    x0, t0 = _data()
    x, t, w = _t(x0, device, False), _t(t0, device, False), _t(np.ones(N), device, False)
    captured = pydiff.capture(lambda: (mod.cu_sq(2.0, x, t, w, _result="tensor"),
                                       mod.cu_sq(1.0, x, t, w)))  # fmt: skip
    for _ in range(3):
        xb, tb = _data()
        x.copy_from_numpy(xb)
        t.copy_from_numpy(tb)
        first, second = captured.replay()
        want = (xb.astype(np.float64) - tb) ** 2
        np.testing.assert_allclose(first.numpy(), 2.0 * want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(second.numpy(), want, rtol=1e-5, atol=1e-6)


def test_python_numbers_are_frozen_at_capture(device, mod):
    """A float argument is part of the recorded kernel: changing the Python value between
    replays changes nothing; a tensor passed instead follows (here: ``w``'s values)."""
    x, t = _t(np.full(N, 2.0), device, False), _t(np.zeros(N), device, False)
    w = _t(np.ones(N), device, False)
    out = pydiff.zeros((N,), device=device)
    knobs = {"a": 3.0}
    captured = pydiff.capture(lambda: mod.cu_sq(knobs["a"], x, t, w, _result=out))
    knobs["a"] = 100.0
    w.copy_from_numpy(np.full(N, 0.5, np.float32))
    captured.replay()
    np.testing.assert_allclose(out.numpy(), np.full(N, 3.0 * 1.0), rtol=1e-6)  # a 3, w 0.5


@pytest.mark.parametrize("n", [N, 5000])  # 5000: past generated.MIN_ELEMENTS
def test_tape_step_with_user_function_captured_after_one_eager_step(device, mod, n):
    """Tape.backward inside the captured step runs the .bwds plan's kernel in its batch. Its
    first .bwds of a layout is refused in a capture (run the step once eagerly first)."""
    a, lr = 0.5, 0.05
    x0, t0 = _data(n)
    w_np = RNG.standard_normal(n).astype(np.float64)
    x, t = _t(x0, device, False).with_grads(), _t(t0, device, False).with_grads()
    w = _t(w_np, device)
    opt = optim.SGD([w], lr=lr)
    seed = np.ones(n, np.float32)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = mod.cu_sq(a, x, t, w, _result="tensor")
        tape.backward(loss, seed, retain_graph=False)
        opt.step()
        return loss

    with pytest.raises(pydiff.CaptureError, match=r"cu_sq\.bwds.*run the step once eagerly"):
        pydiff.capture(step)
    w.copy_from_numpy(w_np)  # (the refused capture ran the step up to the refusal)
    step()  # eager: makes the plans
    w_np = w_np - lr * _dw(a, x0.astype(np.float64), t0, w_np)
    np.testing.assert_allclose(w.numpy(), w_np, rtol=1e-4, atol=1e-5)
    captured = pydiff.capture(step)
    w_np = w_np - lr * _dw(a, x0.astype(np.float64), t0, w_np)
    for _ in range(3):
        xb, tb = _data(n)
        x.copy_from_numpy(xb)
        t.copy_from_numpy(tb)
        loss = captured.replay()
        xb, tb = xb.astype(np.float64), tb.astype(np.float64)
        np.testing.assert_allclose(loss.numpy(), a * (w_np * xb - tb) ** 2, rtol=1e-4, atol=1e-5)
        w_np = w_np - lr * _dw(a, xb, tb, w_np)
        np.testing.assert_allclose(w.numpy(), w_np, rtol=1e-4, atol=1e-5)


def test_reset_policy_re_zeroes_on_replay_and_strict_is_refused(device, mod):
    """Inside Tape.backward, RESET zeroes each gradient before the step adds into it: the
    recorded clear runs on every replay (w.grad: this step's only, no zero_grad in the step).
    STRICT's check runs on the host per call, which a replay cannot: refused at capture."""
    a = 1.5
    x0, t0 = _data()
    w_np = RNG.standard_normal(N).astype(np.float64)
    x, t, w = _t(x0, device), _t(t0, device), _t(w_np, device)

    def step():
        with pydiff.Tape() as tape:
            loss = mod.cu_sq(a, x, t, w, _result="tensor")
        tape.backward(loss, np.ones(N, np.float32), retain_graph=False)
        return loss

    with pydiff.zero_policy("reset"):
        step()
        captured = pydiff.capture(step)
        for _ in range(3):
            xb, tb = _data()
            x.copy_from_numpy(xb)
            t.copy_from_numpy(tb)
            captured.replay()
            want = _dw(a, xb.astype(np.float64), tb, w_np)
            np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-4, atol=1e-5)
    w.zero_grad()
    x.zero_grad()
    t.zero_grad()
    with pydiff.zero_policy("strict"):
        with pytest.raises(pydiff.CaptureError, match=r"cu_sq\.bwds.*STRICT"):
            pydiff.capture(step)


def test_direct_bwds_under_reset_is_refused(device, mod):
    x, t, w = _t(np.ones(N), device), _t(np.ones(N), device), _t(np.ones(N), device)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    mod.cu_sq(1.0, x, t, w, _result=out)
    mod.cu_sq.bwds(1.0, x, t, w, _result=out)  # (the plan made eagerly)
    with pydiff.zero_policy("reset"):
        with pytest.raises(pydiff.CaptureError, match=r"cu_sq\.bwds.*plan declined"):
            pydiff.capture(lambda: mod.cu_sq.bwds(1.0, x, t, w, _result=out))


def test_calls_slangpy_would_run_are_refused_naming_function_and_why(device, mod, monkeypatch):
    x = _t(np.ones(N), device, False)
    with pytest.raises(pydiff.CaptureError, match=r"cu_struct.*not all positional tensors"):
        pydiff.capture(lambda: mod.cu_struct({"a": 1.0, "b": 2.0}, x, _result="tensor"))
    v = _t(np.ones(N), device, False)
    with pytest.raises(pydiff.CaptureError, match=r"s39_capuser\.cu_inout.*no call plan"):
        pydiff.capture(lambda: mod.cu_inout(2.0, v))
    with pytest.raises(pydiff.CaptureError, match=r"s39_capuser\.cu_int.*generator does not"):
        pydiff.capture(lambda: mod.cu_int(3, x, _result="tensor"))
    with pytest.raises(pydiff.CaptureError, match=r"s39_capuser\.cu_sq.*host number"):
        pydiff.capture(lambda: mod.cu_sq(1.0, 2.0, 3.0, 4.0))
    with pytest.raises(pydiff.CaptureError, match=r"cu_sq.*not all positional"):
        pydiff.capture(lambda: mod.cu_sq(1.0, x, x, w=x, _result="tensor"))
    with pytest.raises(pydiff.CaptureError, match=r"cu_sq.*not all positional"):
        pydiff.capture(lambda: mod.cu_sq(1.0, x, x, x, _result="numpy"))
    w = _t(np.ones(N), device)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    with pydiff.Tape():  # a forward into a given tensor on a tape: the full path's
        with pytest.raises(pydiff.CaptureError, match=r"cu_sq .*plan declined this call"):
            pydiff.capture(lambda: mod.cu_sq(1.0, w, w, w, _result=out))
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    with pytest.raises(pydiff.CaptureError, match=r"cu_sq .*generated kernels are off"):
        pydiff.capture(lambda: mod.cu_sq(1.0, x, x, x, _result="tensor"))
    monkeypatch.delenv("PYDIFF_GENERATED")
    with pytest.raises(pydiff.CaptureError, match=r"op_exp through SlangPy"):
        pydiff.capture(lambda: pydiff.ops.exp(x))  # pydiff's ops on SlangPy: as before


def test_calls_outside_a_capture_unchanged(device, mod):
    """The same function eagerly (before and after a capture): SlangPy's path for small calls,
    values as NumPy's."""
    x, t, w = _t(np.full(N, 2.0), device), _t(np.ones(N), device), _t(np.ones(N), device)
    want = 0.5 * (2.0 - 1.0) ** 2
    np.testing.assert_allclose(mod.cu_sq(0.5, x, t, w).numpy(), np.full(N, want), rtol=1e-6)
    pydiff.capture(lambda: mod.cu_sq(0.5, x, t, w, _result="tensor"))
    np.testing.assert_allclose(mod.cu_sq(0.5, x, t, w).numpy(), np.full(N, want), rtol=1e-6)


def test_float3_forward_captured_its_bwds_refused(device, mod):
    """A function of float3 values: its forward runs on the generated vector kernel (recorded);
    its .bwds plan has no generated kernel for vectors (SlangPy's): refused, saying so."""
    v = pydiff.tensor(np.ones((N, 3), np.float32), dtype="float3", device=device)
    v = v.with_grads()
    out = pydiff.zeros((N,), dtype="float3", device=device).with_grads(ones=True)
    captured = pydiff.capture(lambda: mod.cu_vec(2.0, v, _result=out))
    with pytest.raises(pydiff.CaptureError, match=r"cu_vec\.bwds .*generator does not cover"):
        pydiff.capture(lambda: mod.cu_vec.bwds(2.0, v, _result=out))
    vals = RNG.standard_normal((N, 3)).astype(np.float32)
    v.copy_from_numpy(vals)
    captured.replay()
    np.testing.assert_allclose(out.numpy(), 2.0 * vals.astype(np.float64) ** 2, rtol=1e-5)


def test_a_replay_counts_its_writes_for_stale_checks(device, mod):
    """A replay writes what the captured step wrote: a later eager .bwds (or tape backward)
    of a call that read those tensors before the replay is refused as stale, as after an
    eager step, instead of differentiating at the values the replay wrote."""
    x, t = _t(np.full(N, 2.0), device), _t(np.ones(N), device)
    w, src = _t(np.ones(N), device), _t(np.full(N, 3.0), device, False)
    ones = _t(np.ones(N), device, False)
    zero = _t(np.zeros(N), device, False)
    captured = pydiff.capture(lambda: mod.cu_sq(1.0, src, zero, ones, _result=w))  # w = src^2
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    mod.cu_sq(1.0, x, t, w, _result=out)  # eager, reads w
    with pydiff.Tape() as tape:
        loss = mod.cu_sq(1.0, x, t, w, _result="tensor")
    captured.replay()  # writes w
    with pytest.raises(pydiff.StaleInputError, match=r"parameter 'w'"):
        mod.cu_sq.bwds(1.0, x, t, w, _result=out)
    with pytest.raises(pydiff.StaleInputError, match=r"parameter 'w' .*overwritten"):
        tape.backward(loss, np.ones(N, np.float32))
    np.testing.assert_allclose(w.numpy(), np.full(N, 9.0), rtol=1e-6)


def test_bwds_with_data_inputs_captured(device, mod):
    """Data inputs without gradient buffers (x, t) take .bwds's plan (backward_plan): the
    captured step adds w's gradient 2 a (w x - t) x for each replay's new data (float64)."""
    rng = np.random.default_rng(7)
    x, t = _t(np.zeros(N), device, False), _t(np.zeros(N), device, False)
    w = _t(rng.uniform(0.5, 1.5, N), device)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)

    def step():
        w.zero_grad()
        mod.cu_sq(0.5, x, t, w, _result=out)
        mod.cu_sq.bwds(0.5, x, t, w, _result=out)

    captured = pydiff.capture(step)
    w64 = w.numpy().astype(np.float64)
    for _ in range(3):
        xs, ts = (
            rng.standard_normal(N).astype(np.float32),
            rng.standard_normal(N).astype(np.float32),
        )
        x.copy_from_numpy(xs)
        t.copy_from_numpy(ts)
        captured.replay()
        x64, t64 = xs.astype(np.float64), ts.astype(np.float64)
        np.testing.assert_allclose(out.numpy(), 0.5 * (w64 * x64 - t64) ** 2, rtol=1e-5, atol=1e-6)
        want = 2 * 0.5 * (w64 * x64 - t64) * x64
        np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5, atol=1e-5)
    assert not x.requires_grad and not t.requires_grad
