"""breakT45: a new user's training path (issue 16, items 2-4) against PyTorch float64.

Defects found and fixed here:
- a captured step whose input tensor was re-bound to a new tensor between replays
  (``xb = pydiff.tensor(batch)``, the old one dropped): the replay silently kept training on
  the captured batch, the old buffer that nothing writes any more. The check that refuses
  this for a user's Slang functions did not cover pydiff's ops (linear, matmul, relu,
  cross_entropy, dropout): every op a capture records now registers what it reads.
- a tensor a recorded call made (a head's logits, ``z = m.sq(x)``) overwritten whole by a call
  the tape does not record (none of its inputs requires a gradient: ``m.f(data, _result=z)``
  or an ``out`` parameter): z then holds constants, but the backward still sent z's gradient
  to the call that made the old values (x.grad = 2x, the head's dW and dh nonzero). Such a
  write now counts as a write from outside a call, as ``fill`` does: the gradient stops.
  Through a write-only tensor parameter (``IWDiffTensor``, perhaps some values only) the
  backward that needs the earlier values now refuses, naming both calls.

Checked against PyTorch float64 and held (not kept as tests): labels out of range, negative,
float, int64, wrong length; classes 1, 2, 31-33; batches 1, 2047-2049, 4096, 4097; logits read
before the loss, used twice, two losses, a view, overwritten by the host between head and
loss; weights, inputs and labels written between a held head and its loss; a held head across
a replay and across threads; capture with changing data, interleaved train/eval captures,
frozen and shared parameters, zero_grad variants, accumulation; NaN/inf inputs; torch
autograd around pydiff models; RSS flat over 4,000 eager and replayed steps.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim

torch = pytest.importorskip("torch")

B, IN, HID, C = 32, 64, 64, 10


def _torch_model(layers):
    """float64 torch copies of a relu Linear -> Linear model's parameters."""
    return [torch.tensor(p.numpy().astype(np.float64), requires_grad=True) for p in layers]


def _torch_loss(params, x, y):
    w1, b1, w2, b2 = params
    h = torch.relu(torch.tensor(x, dtype=torch.float64) @ w1.T + b1)
    z = h @ w2.T + b2
    return torch.nn.functional.cross_entropy(z, torch.tensor(y, dtype=torch.long))


@pytest.mark.parametrize("tape_backward", [True, False])
def test_replay_refuses_an_input_rebound_to_a_new_tensor(tape_backward):
    rng = np.random.default_rng(0)
    l1 = nn.Linear(IN, HID, seed=0, activation="relu")
    l2 = nn.Linear(HID, C, seed=1)
    params = [l1.weight, l1.bias, l2.weight, l2.bias]
    opt = optim.SGD(params, lr=0.1)
    tparams = _torch_model(params)
    topt = torch.optim.SGD(tparams, lr=0.1)
    state = {}

    def new_batch():
        x = rng.standard_normal((B, IN)).astype(np.float32)
        y = rng.integers(0, C, B).astype(np.int32)
        state["x"], state["y"] = pydiff.tensor(x), pydiff.tensor(y)  # the names re-bound
        return x, y

    def step():
        opt.zero_grad()
        if tape_backward:
            with pydiff.Tape() as tape:
                loss = ops.cross_entropy(l2(l1(state["x"])), state["y"])
            tape.backward(loss, retain_graph=False)
            opt.step()
        else:  # an evaluation step: forward only
            loss = ops.cross_entropy(l2(l1(state["x"])), state["y"])
        return loss

    for k in range(2):  # eager, then the capture (each on its batch), against torch
        x, y = new_batch()
        loss = step() if k == 0 else (captured := pydiff.capture(step)).result
        topt.zero_grad()
        want = _torch_loss(tparams, x, y)
        want.backward()
        if tape_backward:
            topt.step()
        np.testing.assert_allclose(loss.item(), want.item(), rtol=1e-5)
    x, y = new_batch()  # the old tensors dropped: a replay would read the captured batch
    gc.collect()
    with pytest.raises(pydiff.CaptureError, match="dropped"):
        captured.replay()
    # Copying into the captured tensors is the supported way; capturing again works too.
    captured = pydiff.capture(step)
    topt.zero_grad()
    want = _torch_loss(tparams, x, y)
    want.backward()
    if tape_backward:
        topt.step()
    np.testing.assert_allclose(captured.result.item(), want.item(), rtol=1e-5)
    for p, t in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-4, atol=1e-6)


_OVERWRITE = """
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float dbl(float x) { return 2.0 * x; }
[Differentiable] void dbl_out(float x, out float y) { y = 2.0 * x; }
[Differentiable] void twice(inout float x) { x = 2.0 * x; }
"""


@pytest.mark.parametrize("into", ["_result", "out", "inout"])
def test_recorded_result_overwritten_by_an_unrecorded_call_carries_no_gradient(into):
    """z = sq(x) on a tape, then a call whose inputs need no gradient (so the tape does not
    record it) writes all of z: z holds constants, d sum(z) / dx = 0. The backward used to
    send z's gradient to sq's backward (x.grad = 2x), as if z still held x * x."""
    m = pydiff.load_module_from_source("s45_overwrite", _OVERWRITE)
    x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
    w = pydiff.tensor([5.0, 6.0, 7.0], requires_grad=True)
    o = pydiff.tensor([0.5, -1.0, 4.0])
    with pydiff.Tape() as tape:
        z = m.sq(x, _result="tensor")
        if into == "_result":
            m.dbl(o, _result=z)  # no input requires a gradient: not recorded
        elif into == "out":
            m.dbl_out(o, z)
        else:  # in place on a detached alias: values made from constants
            m.twice(z.detach())
        loss = ops.add(ops.sum(z), ops.sum(ops.mul(w, x)))  # x still reaches the loss: w
    tape.backward(loss)
    z_sum = 2 * (1 + 4 + 9) if into == "inout" else 2 * (0.5 - 1.0 + 4.0)
    np.testing.assert_allclose(loss.item(), z_sum + (5 + 12 + 21), rtol=1e-6)
    np.testing.assert_array_equal(x.grad.numpy(), [5.0, 6.0, 7.0])  # w only: z is constant
    np.testing.assert_array_equal(w.grad.numpy(), [1.0, 2.0, 3.0])
    with pytest.raises(RuntimeError, match="s45_overwrite.(dbl|twice).*constants"):  # from z
        tape.backward(z, grad=np.ones(3))


def test_head_logits_overwritten_by_an_unrecorded_call_before_the_loss():
    """The classifier head's logits replaced by a call the tape does not record, then the
    loss: the loss reads the new values, and no gradient reaches the head (torch's
    ``out=`` on such a tensor is refused; here the values are constants, as after ``fill``)."""
    m = pydiff.load_module_from_source("s45_overwrite_head", _OVERWRITE)
    rng = np.random.default_rng(1)
    head = nn.Linear(IN, C, seed=2)
    labels = pydiff.tensor(rng.integers(0, C, B).astype(np.int32))
    h = pydiff.tensor(rng.standard_normal((B, IN)).astype(np.float32), requires_grad=True)
    other = rng.standard_normal((B, C)).astype(np.float32)
    for _ in range(4):  # the head's shape hot: its product held back for a fused loss
        head.zero_grad()
        h.zero_grad()
        with pydiff.Tape() as tape:
            z = head(h)
            m.dbl(pydiff.tensor(other), _result=z)
            loss = ops.cross_entropy(z, labels)
        tape.backward(loss, retain_graph=False)
        zt = torch.tensor(2.0 * other.astype(np.float64), requires_grad=True)
        want = torch.nn.functional.cross_entropy(zt, torch.tensor(labels.numpy(), dtype=torch.long))
        want.backward()
        np.testing.assert_allclose(loss.item(), want.item(), rtol=1e-5)
        np.testing.assert_allclose(z.grad.numpy(), zt.grad.numpy(), rtol=1e-5, atol=1e-7)
        for g in (h.grad, head.weight.grad, head.bias.grad):
            np.testing.assert_array_equal(g.numpy(), 0.0)


def test_recorded_result_written_in_part_by_an_unrecorded_call_is_refused():
    """The same through a write-only tensor parameter (``IWDiffTensor``), which may write some
    values only: the gradient should stop at z[1] alone (x.grad = [2, 0, 6], as torch's
    ``z[1] = 9.0`` gives); it used to pass through (x.grad = 2x). The tape cannot tell which
    values the unrecorded call wrote, so a backward that needs z's earlier values refuses;
    recorded (an input requiring a gradient), the call's backward clears z[1]'s gradient."""
    m = pydiff.load_module_from_source(
        "s45_partly",
        "import slangpy;\n"
        "[Differentiable] float sq(float x) { return x * x; }\n"
        "[Differentiable] void put(float v, int i, IWDiffTensor<float, 1> z) { z[i] = v; }\n",
    )
    x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with pydiff.Tape() as tape:
        z = m.sq(x, _result="tensor")
        m.put(9.0, 1, z)  # no input requires a gradient: not recorded
        loss = ops.sum(z)
    np.testing.assert_array_equal(z.numpy(), [1.0, 9.0, 9.0])
    with pytest.raises(RuntimeError, match="s45_partly.put.*perhaps in part"):
        tape.backward(loss)
    np.testing.assert_array_equal(x.grad.numpy(), 0.0)  # refused before anything ran
    v = pydiff.tensor([9.0], requires_grad=True)  # recorded: the gradient stops at z[1]
    with pydiff.Tape() as tape:
        z = m.sq(x, _result="tensor")
        m.put(v, 1, z)
        loss = ops.sum(z)
    tape.backward(loss)
    xt = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    zt = xt * xt
    zt[1] = 9.0
    zt.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), xt.grad.numpy())
