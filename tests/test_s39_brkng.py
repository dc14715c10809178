"""Breaking ``.bwds`` with data tensors (no gradient buffers) on its call plan
(backward_plan): what the general path says or refuses for such a tensor must hold at the
second and later calls too. Values against float64 closed forms: f = a x y + b y,
df/dx = a y."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] float s39_bk(float a, float b, float x, float y) { return a * x * y + b * y; }
"""
N = 16
_names = itertools.count()


@pytest.fixture
def mod(device):
    """A module of its own per test: warn_once keys on the function's label."""
    return pydiff.load_module_from_source(f"s39_brkng{next(_names)}", SOURCE, device=device)


@pytest.fixture
def path(plan_path):
    """SlangPy's kernel or pydiff's generated one (conftest's plan_path)."""
    return plan_path


def _t(values, device, grad=False):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=grad)


def test_data_made_off_a_tape_is_warned_at_a_planned_call(device, mod, path):
    """y = big[1:] of a big that requires a gradient, computed off a tape: a copy with no path
    back, which .bwds warns of (bwds_checks). The general path warned at every call; the plan
    (made by an earlier call with plain data) passed it silently."""
    rng = np.random.default_rng(11)
    xs = rng.standard_normal(N).astype(np.float32)
    x = _t(xs, device, True)
    big = _t(rng.standard_normal(N + 1), device, True)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    want = np.zeros(N)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(4):  # one call site: warn_once keys on it
            y = _t(rng.standard_normal(N), device) if k < 3 else big[1:]
            ys = y.numpy().astype(np.float64)
            mod.s39_bk.bwds(1.5, 0.5, x, y, _result=out)
            want += 1.5 * ys
    found = [w for w in caught if "computed off a tape" in str(w.message)]
    assert found and "parameter 'y'" in str(found[0].message)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)
    assert big.grad.numpy().tolist() == [0.0] * (N + 1)


def test_capture_ignores_the_policy_left_on_a_data_tensor(device, mod):
    """y had gradient buffers under the STRICT policy, then dropped them (data now): its policy
    acts on nothing. Eager calls take the plan; a capture of the same step refused it as 'a
    gradient buffer has the STRICT zeroing policy'. Replays follow y's new values."""
    rng = np.random.default_rng(12)
    x = _t(rng.standard_normal(N), device, True)
    y = _t(rng.standard_normal(N), device, True)
    y.zero_policy = "strict"
    y.requires_grad_(False)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)

    def step():
        x.zero_grad()
        mod.s39_bk.bwds(1.5, 0.5, x, y, _result=out)

    step()
    captured = pydiff.capture(step)
    for _ in range(2):
        ys = rng.standard_normal(N).astype(np.float32)
        y.copy_from_numpy(ys)
        captured.replay()
        want = 1.5 * ys.astype(np.float64)
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    assert not y.requires_grad


def test_capture_with_a_tensor_seed_refuses_a_replay_once_it_changed(device, mod):
    """tape.backward(o, up) with a tensor up reads it on the host (grad.numpy()): a captured
    step uploaded those values as a constant, so each replay seeded the values up held at
    the capture, not those copied into it since (a wrong gradient, silently). The replay
    refuses once up holds other values; while it holds the same, replays are right."""
    rng = np.random.default_rng(13)
    x = _t(rng.standard_normal(N), device, True)
    y = _t(rng.standard_normal(N), device)  # data
    us = rng.standard_normal(N).astype(np.float32)
    up = _t(us, device)

    def step():
        x.zero_grad()
        with pydiff.Tape() as tape:
            o = mod.s39_bk(1.5, 0.5, x, y, _result="tensor")
        tape.backward(o, up)

    step()
    captured = pydiff.capture(step)
    for _ in range(2):
        ys = rng.standard_normal(N).astype(np.float32)
        y.copy_from_numpy(ys)
        captured.replay()
        want = 1.5 * ys.astype(np.float64) * us
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    up.copy_from_numpy(rng.standard_normal(N).astype(np.float32))
    before = x.grad.numpy()
    with pytest.raises(pydiff.CaptureError, match=r"grad tensor holds other values"):
        captured.replay()
    np.testing.assert_array_equal(x.grad.numpy(), before)
