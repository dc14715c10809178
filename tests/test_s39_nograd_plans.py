"""``.bwds`` with a data tensor (no gradient buffers) at a differentiable parameter takes a
call plan (backward_plan): it ran the general path at every call (~150 us against raw
SlangPy's ~30 us on lavapipe). The plan binds the data without gradients through the kernel
of that gradient layout, on SlangPy's kernel and on pydiff's generated one; its launch's
memo of the last call's bindings must see a new data tensor too. Values against float64
closed forms: f = a x y + b y, df/dx = a y, df/dy = a x + b."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import backward_call, generated
from pydiff.backward_plan import BackwardPlan

SOURCE = """
[Differentiable] float s39_ng(float a, float b, float x, float y) { return a * x * y + b * y; }
"""
N = 16


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s39_nograd", SOURCE, device=device)


@pytest.fixture
def path(plan_path):
    """SlangPy's kernel or pydiff's generated one (conftest's plan_path)."""
    return plan_path


def _no_general_path(monkeypatch):
    """From now on, the general path of .bwds fails the test."""

    def refuse(*a, **k):
        raise AssertionError("the general path ran: no call plan took the call")

    monkeypatch.setattr(backward_call, "BackwardArgs", refuse)


def test_data_tensor_takes_a_plan_and_gradients_are_right(device, mod, path, monkeypatch):
    rng = np.random.default_rng(0)
    xs, ys = rng.standard_normal(N), rng.standard_normal(N)
    x = pydiff.tensor(xs.astype(np.float32), device=device, requires_grad=True)
    y = pydiff.tensor(ys.astype(np.float32), device=device)  # data: no gradient
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    mod.s39_ng.bwds(1.5, 0.5, x, y, _result=out)  # the general path, which makes the plan
    plans = list(mod.s39_ng.bwds_plans.values())
    assert len(plans) == 1 and isinstance(plans[0], BackwardPlan)
    _no_general_path(monkeypatch)
    for _ in range(5):
        mod.s39_ng.bwds(1.5, 0.5, x, y, _result=out)
    y32 = ys.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), 6 * 1.5 * y32, rtol=1e-5, atol=1e-6)
    assert not y.requires_grad
    if path == "generated":
        assert generated.stats().get("backward", 0) >= 4


def test_a_new_data_tensor_each_call_is_read(device, mod, path, monkeypatch):
    """The launch's memo compares every tensor, the data too: a new y each call."""
    rng = np.random.default_rng(1)
    xs = rng.standard_normal(N).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    want = np.zeros(N)
    ys_kept = []
    for step in range(6):
        ys = rng.standard_normal(N).astype(np.float32)
        y = pydiff.tensor(ys, device=device)
        ys_kept.append(y)  # (alive: no buffer reused between calls)
        mod.s39_ng.bwds(2.0, -1.0, x, y, _result=out)
        want += 2.0 * ys.astype(np.float64)
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)
    # and the same y object with new values
    y = ys_kept[-1]
    ys = rng.standard_normal(N).astype(np.float32)
    y.copy_from_numpy(ys)
    mod.s39_ng.bwds(2.0, -1.0, x, y, _result=out)
    want += 2.0 * ys.astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)


def test_data_then_gradients_on_the_other_parameter(device, mod, path):
    """The kernel of one gradient layout never serves another: y as data, then y with a
    gradient buffer, then x as data (SlangPy's call cache is blind to gradients)."""
    rng = np.random.default_rng(2)
    xs, ys = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    x64, y64 = xs.astype(np.float64), ys.astype(np.float64)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    for _ in range(3):
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = pydiff.tensor(ys, device=device)
        for _ in range(3):
            mod.s39_ng.bwds(1.25, 0.75, x, y, _result=out)
        np.testing.assert_allclose(x.grad.numpy(), 3 * 1.25 * y64, rtol=1e-5, atol=1e-5)
        y = pydiff.tensor(ys, device=device, requires_grad=True)
        for _ in range(3):
            mod.s39_ng.bwds(1.25, 0.75, x, y, _result=out)
        np.testing.assert_allclose(y.grad.numpy(), 3 * (1.25 * x64 + 0.75), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(x.grad.numpy(), 6 * 1.25 * y64, rtol=1e-5, atol=1e-5)
        x = pydiff.tensor(xs, device=device)
        for _ in range(3):
            mod.s39_ng.bwds(1.25, 0.75, x, y, _result=out)
        np.testing.assert_allclose(y.grad.numpy(), 6 * (1.25 * x64 + 0.75), rtol=1e-5, atol=1e-5)


def test_on_a_tape_with_data(device, mod, path):
    """A training loop: the call on a Tape with its data input, tape.backward each step."""
    rng = np.random.default_rng(3)
    xs = rng.standard_normal(N).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    total = np.zeros(N)
    for _ in range(5):
        ys = rng.standard_normal(N).astype(np.float32)
        y = pydiff.tensor(ys, device=device)
        with pydiff.Tape() as tape:
            out = mod.s39_ng(0.5, 2.0, x, y, _result="tensor")
            loss = pydiff.ops.sum(out)
        tape.backward(loss, retain_graph=False)
        total += 0.5 * ys.astype(np.float64)
        np.testing.assert_allclose(x.grad.numpy(), total, rtol=1e-5, atol=1e-5)


def test_a_data_tensor_that_is_the_gradient_buffer_added_into(device, mod, path):
    """y is x's own gradient buffer (read while the call adds into it): each thread reads its
    element before adding to it, so the result is the closed form at the values before."""
    rng = np.random.default_rng(4)
    xs = rng.standard_normal(N).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    out = pydiff.zeros((N,), device=device).with_grads(ones=True)
    y = pydiff.tensor(rng.standard_normal(N).astype(np.float32), device=device)
    for _ in range(3):
        mod.s39_ng.bwds(1.5, 0.5, x, y, _result=out)
    before = x.grad.numpy().astype(np.float64)
    try:
        mod.s39_ng.bwds(1.5, 0.5, x, x.grad, _result=out)
    except ValueError as exc:  # refused (the full path's conservative refusal): fine
        assert "grad" in str(exc)
        np.testing.assert_array_equal(x.grad.numpy(), before.astype(np.float32))
        return
    np.testing.assert_allclose(x.grad.numpy(), before + 1.5 * before, rtol=1e-5, atol=1e-5)
