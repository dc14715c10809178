"""Small host writes recorded in order with pending work (pydiff.staging.write_in_order) and
grid calls on a tape, broken as a user would: raw SlangPy handles taken after a write, inside
a tape's backward too, against closed forms."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

SOURCE = """import slangpy;
[Differentiable] float sq(float x) { return x * x; }
float twice(float x) { return 2.0 * x; }
"""


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s38_brk38b", SOURCE, device=device)


def test_native_after_a_host_write_inside_a_function_backward(device, mod):
    """A custom Function's backward runs inside the tape's batch: a host write there, then
    raw SlangPy on ``t.native`` (taken after the write), must read the written values. The
    write was recorded into the batch, which ``.native`` does not submit: SlangPy's call ran
    first and read zeros (x.grad all 0)."""
    raw = mod.native

    class RawBackward(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return mod.sq(x, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            tmp = pydiff.zeros(x.shape, device=device)
            tmp.copy_from_numpy(x.numpy() * g.numpy())
            return raw.twice(tmp.native, _result="numpy")  # 2 x g

    xs = np.linspace(-1, 1, 8).astype(np.float32)
    gs = np.linspace(0.5, 2, 8).astype(np.float32)
    for step in range(3):
        x = pydiff.tensor(xs + step, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = RawBackward.apply(x)
        tape.backward(y, grad=gs)
        want = 2 * (xs + step).astype(np.float64) * gs
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6, atol=1e-6)


def test_native_after_pydiff_tensor_inside_a_tape_backward(device, mod):
    """``pydiff.tensor(array)`` in a Function's backward, handed to raw SlangPy at once."""
    raw = mod.native

    class Twice(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return mod.sq(x, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            host = pydiff.tensor(g.numpy() * 3.0, device=device)
            out = pydiff.zeros(g.shape, device=device)
            res = raw.twice(host.native, _result="numpy")
            out.copy_from_numpy(res)
            return out

    x = pydiff.tensor(np.ones(5, np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = Twice.apply(x)
    tape.backward(y, grad=np.arange(5, dtype=np.float32))
    np.testing.assert_allclose(x.grad.numpy(), 6.0 * np.arange(5), rtol=1e-6)


def test_pydiff_tensor_of_an_array_joins_the_pending_work(device, mod):
    """``pydiff.tensor(array)`` of a small array is recorded after the pending calls, not
    submitted after them (its dtype was read through ``.native``, which submitted them: one
    submission per new tensor); every call still reads its own values."""
    if device.type != "vulkan":
        pytest.skip("lavapipe's deferred list (the counts differ where calls run at once)")
    rng = np.random.default_rng(38)
    mod.sq(pydiff.tensor(np.ones(7, np.float32), device=device))  # (a plan from here on)
    device.flush()
    before = device.queue.submissions
    sent, got = [], []
    for _ in range(30):
        xs = rng.standard_normal(7).astype(np.float32)
        got.append(mod.sq(pydiff.tensor(xs, device=device)))
        sent.append(xs)
    assert device.queue.submissions - before <= 1  # (DEFER_MAX is far)
    for y, xs in zip(got, sent):
        np.testing.assert_allclose(y.numpy(), xs.astype(np.float64) ** 2, rtol=1e-6)


def test_raw_slangpy_into_zeros_inside_a_function_backward(device, mod):
    """``pydiff.zeros`` in a Function's backward, written by raw SlangPy through ``.native``:
    its zeroing was recorded into the tape's batch, which ran after the raw call and wiped
    its result (x.grad all 0)."""
    raw = mod.native

    class RawInto(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return mod.sq(x, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            xg = pydiff.tensor(x.numpy() * g.numpy(), device=device)
            out = pydiff.zeros(x.shape, device=device)
            raw.twice(xg.native, _result=out.native)
            return out

    xs = np.linspace(-1, 1, 8).astype(np.float32)
    gs = np.linspace(0.5, 2, 8).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = RawInto.apply(x)
    tape.backward(y, grad=gs)
    np.testing.assert_allclose(x.grad.numpy(), 2 * xs.astype(np.float64) * gs, rtol=1e-6)


def test_raw_slangpy_loop_on_kept_handles_sees_each_host_write(device, mod):
    """A raw SlangPy loop on handles taken once, fed by ``copy_from_numpy``: with no pydiff
    work pending, the write is done at once (as before small writes joined the deferred
    list), so each raw call reads its own batch (it read the one before: off by a step)."""
    raw = mod.native
    x = pydiff.zeros((6,), device=device)
    y = pydiff.zeros((6,), device=device)
    nx, ny = x.native, y.native
    rng = np.random.default_rng(5)
    for _ in range(5):
        xs = rng.standard_normal(6).astype(np.float32)
        x.copy_from_numpy(xs)
        raw.twice(nx, _result=ny)
        np.testing.assert_allclose(ny.to_numpy(), 2.0 * xs.astype(np.float64), rtol=1e-6)
