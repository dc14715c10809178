"""Breaking pydiff.capture of steps that call a user's Slang function: replays checked
against NumPy float64 closed forms; what a replay cannot honour must be refused."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] float bk_f(float a, float x, float w) { return a * w * x; }
[Differentiable] float bk_h(float x) { return x * x; }
[Differentiable] void bk_io(float s, inout float v) { v = v * s; }
[Differentiable] float bk_int(int k, float x) { return x * float(k); }
"""
RNG = np.random.default_rng(3939)


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s39_brkcap", SOURCE, device=device)


def _t(values, device, grad=True):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=grad)


def test_replay_after_a_gradient_buffer_reattached_is_refused(device, mod):
    """``requires_grad_(False)`` then ``(True)`` gives a tensor a new gradient buffer: a
    replay of a captured ``.bwds`` would add into the dropped one and leave ``w.grad`` at
    zeros (silently wrong before the fix). Refused, naming the parameter."""
    n = 16
    x, w = _t(RNG.standard_normal(n), device), _t(RNG.standard_normal(n), device)
    out = pydiff.zeros((n,), device=device).with_grads(ones=True)

    def step():
        mod.bk_f(1.5, x, w, _result=out)
        mod.bk_f.bwds(1.5, x, w, _result=out)

    captured = pydiff.capture(step)
    w.grad.zero_()
    captured.replay()  # unchanged: fine
    np.testing.assert_allclose(w.grad.numpy(), 1.5 * x.numpy().astype(np.float64), rtol=1e-6)
    w.requires_grad_(False)
    w.requires_grad_(True)
    with pytest.raises(pydiff.CaptureError, match="parameter 'w'.*gradient buffer"):
        captured.replay()
    assert not w.grad.numpy().any()  # nothing ran


def test_tape_replay_after_a_gradient_buffer_reattached_is_refused(device, mod):
    """The same through a captured ``Tape.backward``."""
    n = 8
    x, w = _t(RNG.standard_normal(n), device), _t(RNG.standard_normal(n), device)
    seed = pydiff.ones((n,), device=device)

    def step():
        with pydiff.Tape() as tape:
            z = mod.bk_h(mod.bk_f(2.0, x, w))
        tape.backward(z, seed, retain_graph=False)

    step()
    captured = pydiff.capture(step)
    w.requires_grad_(False)
    w.requires_grad_(True)
    with pytest.raises(pydiff.CaptureError, match="parameter 'w'.*gradient buffer"):
        captured.replay()


def test_a_refused_first_call_of_a_layout_leaves_its_tensors_unchanged(device, mod):
    """A layout's first call in a capture runs the full path to make its plan; where the call
    is then refused (in place, ``inout``, an ``int`` parameter), that run wrote its tensors:
    running the step again eagerly, as the docs advise, squared ``x`` twice (silently wrong
    before the fix). The capture raised at the call: it must not have run."""
    x = _t(np.full(4, 2.0), device, False)
    with pytest.raises(pydiff.CaptureError, match="bk_h"):
        pydiff.capture(lambda: mod.bk_h(x, _result=x))
    np.testing.assert_array_equal(x.numpy(), 2.0)
    v = _t(np.full(4, 2.0), device, False)
    with pytest.raises(pydiff.CaptureError, match="bk_io"):
        pydiff.capture(lambda: mod.bk_io(3.0, v))
    np.testing.assert_array_equal(v.numpy(), 2.0)
    out = pydiff.zeros((4,), device=device)
    with pytest.raises(pydiff.CaptureError, match="bk_int"):
        pydiff.capture(lambda: mod.bk_int(3, x, _result=out))
    np.testing.assert_array_equal(out.numpy(), 0.0)
    mod.bk_h(x, _result=x)  # the step run eagerly afterwards: once
    np.testing.assert_array_equal(x.numpy(), 4.0)


@pytest.mark.parametrize("policy", ["reset", "strict"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_replay_after_the_zeroing_policy_changed_is_refused(device, mod, policy, per_tensor):
    """A step captured under ACCUMULATE and replayed under RESET added (w.grad 3 * 2 = 6)
    where the eager step resets (2); under STRICT the eager step raises, the replay added
    silently. The policy a replay would need differs from the recorded one: refused."""
    n = 8
    x, w = _t(np.full(n, 2.0), device), _t(np.full(n, 3.0), device)
    out = pydiff.zeros((n,), device=device).with_grads(ones=True)

    def step():
        mod.bk_f(1.0, x, w, _result=out)
        mod.bk_f.bwds(1.0, x, w, _result=out)

    captured = pydiff.capture(step)
    try:
        if per_tensor:
            w.zero_policy = policy
        else:
            pydiff.set_zero_policy(policy)
        with pytest.raises(pydiff.CaptureError, match="zeroing policy"):
            captured.replay()
        np.testing.assert_array_equal(w.grad.numpy(), 2.0)  # the capture's step only
    finally:
        pydiff.set_zero_policy("accumulate")
        w.zero_policy = None
    captured.replay()  # as at the capture again: fine
    np.testing.assert_array_equal(w.grad.numpy(), 4.0)


def test_tape_replay_after_the_zeroing_policy_changed_is_refused(device, mod):
    """Captured under RESET (the tape's zeroing recorded), replayed under ACCUMULATE: the
    replay would still reset where the eager step adds."""
    n = 8
    x, w = _t(np.full(n, 2.0), device), _t(np.full(n, 3.0), device)
    seed = pydiff.ones((n,), device=device)

    def step():
        with pydiff.Tape() as tape:
            z = mod.bk_f(1.0, x, w)
        tape.backward(z, seed, retain_graph=False)

    step()
    with pydiff.zero_policy("reset"):
        captured = pydiff.capture(step)
        captured.replay()
    np.testing.assert_array_equal(w.grad.numpy(), 2.0)
    with pytest.raises(pydiff.CaptureError, match="zeroing policy is ACCUMULATE, not RESET"):
        captured.replay()


@pytest.mark.parametrize("tape", [False, True])
def test_replay_after_an_input_tensor_was_replaced_is_refused(device, mod, tape):
    """The step reads ``state["x"]``; the user puts a new tensor there (new data) and drops
    the old one: a replay read the old buffer (held by the capture), silently computing on
    the capture's values, the new ones ignored. Refused, naming the parameter; a tensor the
    step made itself (``y``) is not an input and may die."""
    n = 8
    state = {"x": _t(np.full(n, 2.0), device), "w": _t(np.full(n, 3.0), device)}
    out = pydiff.zeros((n,), device=device).with_grads(ones=True)
    seed = pydiff.ones((n,), device=device)

    def step():
        if tape:
            with pydiff.Tape() as t:
                z = mod.bk_h(mod.bk_f(1.0, state["x"], state["w"]))
            t.backward(z, seed, retain_graph=False)
            return z
        y = mod.bk_f(1.0, state["x"], state["w"])  # made by the step, dropped after it
        return mod.bk_h(y, _result=out)

    if tape:
        step()
    captured = pydiff.capture(step)
    z = captured.replay()
    np.testing.assert_allclose(z.numpy(), 36.0)  # (3 * 2)^2
    state["x"] = _t(np.full(n, 5.0), device)  # the old x dropped
    with pytest.raises(pydiff.CaptureError, match="parameter 'x'.*dropped"):
        captured.replay()


def test_tensors_only_the_captured_function_holds_stay_valid_inputs(device, mod):
    """A step built in a factory, only the captured object kept: its constants (``k``, the
    upstream ``out``) live in the step's closure, which the capture keeps, so a replay
    runs (not refused as dropped inputs) with the right values."""
    n = 8
    x, w = _t(np.full(n, 2.0), device), _t(np.full(n, 3.0), device)

    def make():
        out = pydiff.zeros((n,), device=device).with_grads(ones=True)
        k = _t(np.full(n, 4.0), device, False)

        def step():
            mod.bk_f(1.0, x, k, _result=out)
            mod.bk_f.bwds(1.0, x, w, _result=out)
            return out

        return pydiff.capture(step)

    captured = make()
    w.grad.zero_()
    x.copy_from_numpy(np.full(n, 5.0, np.float32))
    out = captured.replay()
    np.testing.assert_array_equal(out.numpy(), 20.0)  # 4 * 5
    np.testing.assert_array_equal(w.grad.numpy(), 5.0)


def test_replay_inside_a_recording_tape_is_refused(device, mod):
    """The replayed kernels are on no tape: a backward through what a replay wrote inside a
    ``with Tape()`` gave ``x`` no gradient (eagerly: through ``y = x * x``), silently."""
    n = 8
    x = _t(np.full(n, 2.0), device)
    y = pydiff.zeros((n,), device=device, requires_grad=True)
    captured = pydiff.capture(lambda: mod.bk_h(x, _result=y))
    with pydiff.Tape():
        with pytest.raises(pydiff.CaptureError, match="inside a recording pydiff.Tape"):
            captured.replay()
    captured.replay()  # outside: fine
    np.testing.assert_array_equal(y.numpy(), 4.0)


def test_replay_after_a_data_input_gained_a_gradient_buffer_is_refused(device, mod):
    """``x`` had no gradient buffer at the capture (a data input: the captured kernel adds
    into w's only); ``x.requires_grad_(True)`` afterwards would leave ``x.grad`` at zeros on
    replay where the eager ``.bwds`` fills it. Refused, naming ``x``."""
    n = 8
    x, w = _t(np.full(n, 2.0), device, False), _t(np.full(n, 3.0), device)
    out = pydiff.zeros((n,), device=device).with_grads(ones=True)

    def step():
        mod.bk_f(1.0, x, w, _result=out)
        mod.bk_f.bwds(1.0, x, w, _result=out)

    captured = pydiff.capture(step)
    captured.replay()
    np.testing.assert_array_equal(w.grad.numpy(), 4.0)  # 2 steps of x = 2
    x.requires_grad_(True)
    with pytest.raises(pydiff.CaptureError, match="parameter 'x'.*attached"):
        captured.replay()
    x.requires_grad_(False)
    captured.replay()  # as at the capture again
    np.testing.assert_array_equal(w.grad.numpy(), 6.0)


def test_a_step_that_sets_its_own_zeroing_policy_replays(device, mod):
    """A step running its backward under ``with zero_policy("reset")`` itself replays as it
    runs eagerly: the policy around replay() is the one around the capture (no false
    refusal from the check above); RESET re-zeroes at each replay (w.grad 2, not 4)."""
    n = 8
    x, w = _t(np.full(n, 2.0), device), _t(np.full(n, 3.0), device)
    seed = pydiff.ones((n,), device=device)

    def step():
        with pydiff.zero_policy("reset"):
            with pydiff.Tape() as tape:
                z = mod.bk_f(1.0, x, w)
            tape.backward(z, seed, retain_graph=False)

    step()
    captured = pydiff.capture(step)
    captured.replay()
    captured.replay()
    np.testing.assert_array_equal(w.grad.numpy(), 2.0)
