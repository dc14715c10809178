"""breakT45: a new user's training path (issue 16, items 2-4) against PyTorch float64.

Defects found and fixed here:
- a captured step whose input tensor was re-bound to a new tensor between replays
  (``xb = pydiff.tensor(batch)``, the old one dropped): the replay silently kept training on
  the captured batch, the old buffer that nothing writes any more. The check that refuses
  this for a user's Slang functions did not cover pydiff's ops (linear, matmul, relu,
  cross_entropy, dropout): every op a capture records now registers what it reads.
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
