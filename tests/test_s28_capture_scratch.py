"""A captured step whose backward accumulates into scratch tensors from pydiff.zeros (a relu
layer with a bias above the fused column-sum's 4096 rows masks its gradient into one): each
replay must restart them from zero. They were zeroed once, outside the recording, so every
replay added one more gradient (found by the issue-16 breaker)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops


def _reference(x, labels, w, b):
    """float64 dW, db of mean cross_entropy(relu(x W^T + b), labels)."""
    z = np.maximum(x @ w.T + b, 0.0)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(labels)), labels] -= 1.0
    g = (p / len(labels)) * (z > 0)
    return g.T @ x, g.sum(0)


@pytest.mark.parametrize("batch", [4096, 4097])
def test_replays_of_a_relu_layer_above_4096_rows_keep_the_gradient(device, batch):
    rng = np.random.default_rng(0)
    layer = nn.Linear(8, 3, seed=0, activation="relu", device=device)
    w, b = layer.parameters()
    x = rng.standard_normal((batch, 8)).astype(np.float32)
    labels = rng.integers(0, 3, batch).astype(np.int32)
    xb = pydiff.tensor(x, device=device)
    yb = pydiff.tensor(labels, device=device)

    def step():
        layer.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layer(xb), yb)
        tape.backward(loss, retain_graph=False)

    captured = pydiff.capture(step)
    want_w, want_b = _reference(
        x.astype(np.float64), labels, w.numpy().astype(np.float64), b.numpy()
    )
    for _ in range(3):
        captured.replay()
        np.testing.assert_allclose(w.grad.numpy(), want_w, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(b.grad.numpy(), want_b, rtol=1e-4, atol=1e-6)
