"""A captured step of pydiff's ops (linear, cross_entropy, Tape.backward) zeroes gradients on
replay as at the capture (RESET's clears recorded, ACCUMULATE none). Replayed under another
zeroing policy than the capture's, an eager step would zero otherwise: the replay must refuse,
not accumulate silently. Values against NumPy float64 for the replays that run."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops


def _step_parts(device):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((8, 4)).astype(np.float32)
    Y = rng.integers(0, 3, 8).astype(np.int32)
    layer = nn.Linear(4, 3, seed=0, device=device)
    xb, yb = pydiff.tensor(X, device=device), pydiff.tensor(Y, device=device)

    def step():  # no zero_grad: the policy decides what the gradients hold after it
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layer(xb), yb)
        tape.backward(loss, retain_graph=False)

    return layer, X, Y, step


def _grad_w(W, b, X, Y):
    z = X.astype(np.float64) @ W.T.astype(np.float64) + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = (p - np.eye(3)[Y]) / len(Y)
    return dz.T @ X.astype(np.float64)


def test_ops_step_replayed_under_another_policy_is_refused(device):
    layer, X, Y, step = _step_parts(device)
    step()  # (eager once: the kernels' plans)
    layer.weight.zero_grad()
    captured = pydiff.capture(step)  # under ACCUMULATE: the replay adds
    W, b = layer.weight.numpy(), layer.bias.numpy()
    g1 = _grad_w(W, b, X, Y)
    captured.replay()
    np.testing.assert_allclose(layer.weight.grad.numpy(), 2 * g1, rtol=1e-4, atol=1e-5)
    before = layer.weight.grad.numpy().copy()
    with pydiff.zero_policy("reset"):  # eager: the gradient would be g1, not 3 g1
        with pytest.raises(pydiff.CaptureError, match="zeroing policy is RESET"):
            captured.replay()
    np.testing.assert_array_equal(layer.weight.grad.numpy(), before)
    captured.replay()  # the capture's policy again: replays
    np.testing.assert_allclose(layer.weight.grad.numpy(), 3 * g1, rtol=1e-4, atol=1e-5)


def test_ops_step_captured_under_reset_refuses_accumulate(device):
    layer, X, Y, step = _step_parts(device)
    step()
    with pydiff.zero_policy("reset"):
        captured = pydiff.capture(step)
        captured.replay()
        W, b = layer.weight.numpy(), layer.bias.numpy()
        np.testing.assert_allclose(
            layer.weight.grad.numpy(), _grad_w(W, b, X, Y), rtol=1e-4, atol=1e-5
        )
    with pytest.raises(pydiff.CaptureError, match="zeroing policy is ACCUMULATE"):
        captured.replay()  # eager would add into the gradient; the replay would reset it


def test_a_parameter_given_its_own_policy_after_the_capture_is_refused(device):
    layer, X, Y, step = _step_parts(device)
    step()
    captured = pydiff.capture(step)
    layer.weight.zero_policy = "reset"
    with pytest.raises(pydiff.CaptureError, match="zeroing policy of its gradient changed"):
        captured.replay()
