"""Owed output gradients (twenty-fourth session, helper ``lazy44``): a recorded call's results
get no gradient buffer when recorded (``requires_grad_(True, zero_later=True)``), only a
promise of one: ``requires_grad`` and ``layout`` say they have one, and the zeroed buffer is
made when something reads or binds it (``.grad``, ``grad_in``/``grad_out``, ``bind``, a view)
or when ``tape.backward`` walks the call (made there before its batch opens, zeroed in its
command list). Each test against an independent reference (float64 NumPy, PyTorch):

- a result off the backward's path never gets a buffer, and reads zeros when asked;
- a result's gradient read before the backward (zeros), after it, and after a second backward
  (``retain_graph``: restarts from zero), a result used by two later calls, a view of a
  result, a shader call's result, ``tape.zero()``, ``lend_grads``;
- captured steps and an AdamW loop with ``zero_grad(set_to_none=...)`` against PyTorch.
"""

import gc

import numpy as np
import pytest

import sys
from pathlib import Path

import pydiff
from pydiff import nn, ops, optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from mlp_step import make_mlp_step  # noqa: E402


def _dirty_pool(device, shape):
    # buffers of this size holding 7s, released to the pool: the next allocations reuse them
    junk = [pydiff.tensor(np.full(shape, 7.0, np.float32), device=device) for _ in range(6)]
    device.flush()
    del junk


def _x(device, shape=(8,), seed=0, lo=-1.0, hi=1.0):
    rng = np.random.default_rng(seed)
    v = rng.uniform(lo, hi, shape).astype(np.float32)
    return v, pydiff.tensor(v, device=device, requires_grad=True)


def test_a_result_owes_its_buffer_until_read(device):
    xv, x = _x(device)
    with pydiff.Tape():
        y = ops.exp(x)
    # owed: no buffer yet (one was made here before), but it requires grad as before
    assert y.grad_storages() == (None, None)
    assert y.requires_grad
    assert y.layout[2:] == (True, True)
    assert "grad=shared" in repr(y)
    np.testing.assert_array_equal(y.grad.numpy(), np.zeros(8, np.float32))  # read: zeros
    assert y.grad_storages()[0] is not None and y.grad_in is y.grad_out


def test_a_result_off_the_backward_path_gets_no_buffer(device):
    xv, x = _x(device, seed=1)
    _dirty_pool(device, 8)
    with pydiff.Tape() as tape:
        a = ops.exp(x)
        b = ops.sin(x)  # not on the path to the loss
        loss = ops.sum(a)
    tape.backward(loss)
    assert b.grad_storages() == (None, None)  # had a buffer before this session
    np.testing.assert_allclose(x.grad.numpy(), np.exp(xv.astype(np.float64)), rtol=1e-6)
    np.testing.assert_allclose(a.grad.numpy(), np.ones(8), rtol=0)
    np.testing.assert_array_equal(b.grad.numpy(), np.zeros(8, np.float32))
    # b's buffer, made now, is b's own: a second backward adds nothing into it
    tape.zero()
    x.zero_grad()
    tape.backward(loss)
    np.testing.assert_array_equal(b.grad.numpy(), np.zeros(8, np.float32))
    np.testing.assert_allclose(x.grad.numpy(), np.exp(xv.astype(np.float64)), rtol=1e-6)


def _mlp_reference(xv, yv, params, torch):
    tp = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params]
    h = torch.relu(torch.nn.functional.linear(torch.tensor(xv, dtype=torch.float64), *tp[:2]))
    h.retain_grad()
    z = torch.nn.functional.linear(h, *tp[2:])
    z.retain_grad()
    loss = torch.nn.functional.cross_entropy(z, torch.tensor(yv, dtype=torch.long))
    loss.backward()
    return h.grad.numpy(), z.grad.numpy(), [t.grad.numpy() for t in tp]


@pytest.mark.parametrize("read_before", [False, True])
def test_results_gradients_before_after_and_again(device, read_before):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    params = [
        rng.standard_normal((64, 64)).astype(np.float32) * 0.1,
        rng.standard_normal(64).astype(np.float32) * 0.1,
        rng.standard_normal((10, 64)).astype(np.float32) * 0.1,
        rng.standard_normal(10).astype(np.float32) * 0.1,
    ]
    ps = [pydiff.tensor(p, device=device, requires_grad=True) for p in params]
    xv = rng.standard_normal((256, 64)).astype(np.float32)
    yv = rng.integers(0, 10, 256).astype(np.int32)
    x, y = pydiff.tensor(xv, device=device), pydiff.tensor(yv, device=device)
    with pydiff.Tape() as tape:
        h = ops.linear(x, ps[0], ps[1], activation="relu")
        z = ops.linear(h, ps[2], ps[3])
        loss = ops.cross_entropy(z, y)
    if read_before:  # zeros before the backward (the buffer made by the read)
        np.testing.assert_array_equal(h.grad.numpy(), np.zeros((256, 64), np.float32))
        np.testing.assert_array_equal(z.grad_out.numpy(), np.zeros((256, 10), np.float32))
    tape.backward(loss, retain_graph=True)
    want_h, want_z, want = _mlp_reference(xv, yv, params, torch)
    np.testing.assert_allclose(h.grad.numpy(), want_h, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(z.grad.numpy(), want_z, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(loss.grad.numpy(), 1.0)
    for p, w in zip(ps, want):
        np.testing.assert_allclose(p.grad.numpy(), w, rtol=1e-4, atol=1e-6)
    tape.backward(loss, retain_graph=False)  # results restart from zero, leaves accumulate
    np.testing.assert_allclose(h.grad.numpy(), want_h, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(z.grad.numpy(), want_z, rtol=1e-4, atol=1e-7)
    for p, w in zip(ps, want):
        np.testing.assert_allclose(p.grad.numpy(), 2 * w, rtol=1e-4, atol=1e-6)


def test_a_result_read_by_two_calls_and_a_view_of_one(device):
    xv, x = _x(device, (4,), seed=3)
    cv = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
    c = pydiff.tensor(cv, device=device)
    with pydiff.Tape() as tape:
        y = ops.exp(x)
        w = ops.add(ops.mul(y, y), y)  # y: input of two calls
        v = w.reshape((2, 2))  # a view of an owed result
        assert v.requires_grad
        loss = ops.sum(ops.mul(v, c))
    tape.backward(loss)
    y64 = np.exp(xv.astype(np.float64))
    dw = cv.reshape(4).astype(np.float64)
    np.testing.assert_allclose(w.grad.numpy(), dw, rtol=1e-6)
    np.testing.assert_allclose(v.grad.numpy(), cv, rtol=1e-6)
    np.testing.assert_allclose(y.grad.numpy(), dw * (2 * y64 + 1), rtol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), dw * (2 * y64 + 1) * y64, rtol=1e-5)


def test_a_shader_calls_result(device, load):
    m = load("calls", device)
    xv, x = _x(device, (16,), seed=4)
    gv = np.linspace(-1.0, 1.0, 16).astype(np.float32)
    with pydiff.Tape() as tape:
        y = m.square(x, _result="tensor")
        unused = m.square(x, _result="tensor")
    assert y.requires_grad and y.grad_storages() == (None, None)
    tape.backward(y, grad=gv)
    np.testing.assert_allclose(x.grad.numpy(), 2 * xv.astype(np.float64) * gv, rtol=1e-6)
    np.testing.assert_allclose(y.grad.numpy(), gv, rtol=0)
    assert unused.grad_storages() == (None, None)
    np.testing.assert_array_equal(unused.grad.numpy(), np.zeros(16, np.float32))


def test_zero_and_lent_gradients_of_an_owed_result(device):
    xv, x = _x(device, seed=5)
    with pydiff.Tape() as tape:
        y = ops.exp(x)
        loss = ops.sum(y)
    tape.zero()  # owed ones stay owed (zeros when made)
    assert y.grad_storages() == (None, None)
    give_back = y.lend_grads()
    lent = y.grad
    lent.fill(5.0)
    give_back()
    assert y.grad_storages() == (None, None)  # owed again, the lent buffer not kept
    tape.backward(loss)
    np.testing.assert_allclose(y.grad.numpy(), np.ones(8), rtol=0)
    np.testing.assert_allclose(lent.numpy(), np.full(8, 5.0))
    np.testing.assert_allclose(x.grad.numpy(), np.exp(xv.astype(np.float64)), rtol=1e-6)


def _torch_adamw_steps(torch, params, xv, yv, steps):
    tp = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params]
    opt = torch.optim.AdamW(tp, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    x, y = torch.tensor(xv, dtype=torch.float64), torch.tensor(yv, dtype=torch.long)
    for _ in range(steps):
        opt.zero_grad()
        h = torch.relu(torch.nn.functional.linear(x, *tp[:2]))
        loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, *tp[2:]), y)
        loss.backward()
        opt.step()
    return [t.detach().numpy() for t in tp]


@pytest.mark.parametrize("mode", ["eager", "eager_keep", "captured"])
def test_training_steps_against_torch(device, mode):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    xv = rng.standard_normal((256, 64)).astype(np.float32)
    yv = rng.integers(0, 10, 256).astype(np.int32)
    x, y = pydiff.tensor(xv, device=device), pydiff.tensor(yv, device=device)
    layers = [nn.Linear(64, 64, seed=0, activation="relu"), nn.Linear(64, 10, seed=1)]
    params = [p for layer in layers for p in layer.parameters()]
    start = [p.numpy().copy() for p in params]
    opt = optim.AdamW(params, lr=1e-3)
    held = []

    def step(set_to_none=True):
        opt.zero_grad(set_to_none=set_to_none)
        with pydiff.Tape() as tape:
            h = layers[0](x)
            loss = ops.cross_entropy(layers[1](h), y)
        tape.backward(loss, retain_graph=mode == "eager_keep")
        opt.step()
        if mode == "eager_keep":
            held.append(h)  # a result kept past its step: its gradient is its step's
        return loss

    steps = 6
    if mode == "captured":
        step()
        captured = pydiff.capture(step)
        for _ in range(steps - 2):
            captured.replay()
    else:
        for k in range(steps):
            step(set_to_none=k % 2 == 0)
            if k % 3 == 2:
                gc.collect()
    want = _torch_adamw_steps(torch, start, xv, yv, steps)
    for p, w in zip(params, want):
        np.testing.assert_allclose(p.numpy(), w, rtol=1e-4, atol=2e-6)
    if mode == "eager_keep":
        first = held[0].grad.numpy()
        assert first.shape == (256, 64) and np.abs(first).sum() > 0


def test_a_steady_step_makes_no_new_buffers(device, monkeypatch):
    # tape.backward makes the owed buffers before its batch opens, where the pool hands out
    # free ones: made inside the batch, each would be a new device buffer (~2x the host time)
    rng = np.random.default_rng(7)
    x = pydiff.tensor(rng.standard_normal((256, 64)).astype(np.float32), device=device)
    y = pydiff.tensor(rng.integers(0, 10, 256).astype(np.int32), device=device)
    _, step = make_mlp_step(x, y)  # (the benchmarks' step: 256 x 64 x 64 x 10, AdamW)
    for _ in range(4):
        step().numpy()
    made = []
    counted = device.queue.allocated
    monkeypatch.setattr(device.queue, "allocated", lambda n: (made.append(n), counted(n)))
    for _ in range(5):
        step().numpy()
    assert made == []


@pytest.mark.parametrize("read_first", [False, True])
def test_the_outputs_upstream_zeroed_once(device, monkeypatch, read_first):
    xv, x = _x(device, (16,), seed=8)
    gv = np.linspace(-2.0, 2.0, 16).astype(np.float32)
    with pydiff.Tape() as tape:
        _dirty_pool(device, 16)
        y = ops.exp(x)
        z = ops.mul(y, y)
    if read_first:  # made and zeroed by the read, then holding other values: zeroed again
        z.grad.fill(3.0)
    zeroed = []
    zero = pydiff.Tensor.zero_

    def counting(self, *args, **kwargs):
        zeroed.append(self.storage)
        return zero(self, *args, **kwargs)

    monkeypatch.setattr(pydiff.Tensor, "zero_", counting)
    tape.backward(z, grad=gv)
    # z's upstream: zeroed once by its first read, then seeded (twice before this session)
    assert sum(s is z.grad.storage for s in zeroed) == 1
    assert sum(s is y.grad.storage for s in zeroed) == 1
    y64 = np.exp(xv.astype(np.float64))
    np.testing.assert_allclose(z.grad.numpy(), gv, rtol=0)
    np.testing.assert_allclose(y.grad.numpy(), 2 * y64 * gv, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 2 * y64 * y64 * gv, rtol=1e-5)
