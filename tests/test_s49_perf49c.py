"""perf49c: the narrow backward (matmul.slang's linear_bwd_narrow) makes a block of RU rows' g'
at once, the 8 lanes of a run splitting the block's (row, class) values (LOAD_G_BLOCK), then
shares them through shuffles. Against float64 NumPy: the classifier head fused with the
cross-entropy and the relu-masked narrow layer, at batch sizes off the row block (and off the 8
lanes), 1..17 classes (17: past the narrow kernel, the general products), hidden widths
1..130 (the kernel takes multiples of 64, the rest the general path); each case run four times
(the batch a uniform, then a constant) with the same bits every time."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops, products

from kernel_usage import entries_used


def _narrow(device, batch, n_in, n_out) -> bool:
    return not device.kernels.gpu and products.narrow_fits(batch, n_in, n_out, device)


def _close(got, want, scale=1.0):
    for name in want:
        np.testing.assert_allclose(
            got[name], want[name], rtol=3e-5, atol=3e-5 * scale, err_msg=name
        )


def _same_bits(runs):
    for got in runs[1:]:
        for name in runs[0]:
            np.testing.assert_array_equal(runs[0][name], got[name], err_msg=name)


def _ce_head(device, x, w, b, labels):
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    wt = pydiff.tensor(w, device=device, requires_grad=True)
    bt = pydiff.tensor(b, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        z = ops.linear(xt, wt, bt)
        loss = ops.cross_entropy(z, pydiff.tensor(labels, device=device))
    tape.backward(loss)
    return {
        "loss": np.array(loss.item()),
        "z": z.grad.numpy(),
        "w": wt.grad.numpy(),
        "b": bt.grad.numpy(),
        "x": xt.grad.numpy(),
    }


def _ce_reference(x, w, b, labels):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    z = x64 @ w64.T + b
    zm = z.max(axis=1, keepdims=True)
    e = np.exp(z - zm)
    s = e.sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    loss = np.mean(np.log(s[:, 0]) + zm[:, 0] - z[rows, labels])
    dz = (e / s - np.eye(z.shape[1])[labels]) / len(labels)
    return {"loss": np.array(loss), "z": dz, "w": dz.T @ x64, "b": dz.sum(0), "x": dz @ w64}


@pytest.mark.parametrize(
    "batch, n_in, n_out",
    [
        (1, 64, 1),
        (3, 64, 2),
        (5, 128, 3),
        (6, 64, 4),
        (7, 64, 5),
        (9, 128, 6),
        (13, 64, 7),
        (10, 64, 8),
        (11, 128, 9),
        (255, 64, 10),
        (257, 64, 10),
        (250, 128, 11),
        (31, 64, 12),
        (37, 64, 13),
        (18, 128, 15),
        (259, 64, 16),
        (33, 64, 17),
        (21, 1, 10),
        (22, 7, 3),
        (23, 130, 10),
    ],
)
def test_cross_entropy_head_against_float64(device, monkeypatch, batch, n_in, n_out):
    """linear -> cross_entropy: the logits', W's, b's and x's gradients against float64, four
    runs with the same bits (the narrow kernel where it fits)."""
    rng = np.random.default_rng(1000 * n_out + batch + n_in)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    labels = rng.integers(0, n_out, batch).astype(np.int32)
    used = entries_used(device, monkeypatch)
    runs = [_ce_head(device, x, w, b, labels) for _ in range(4)]
    if _narrow(device, batch, n_in, n_out):
        assert "linear_bwd_narrow" in used and "ce_backward_acc" not in used
    want = _ce_reference(x, w, b, labels)
    for got in runs:
        _close(got, want)
    _same_bits(runs)


def _masked_layer(device, x, w, b, up):
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    wt = pydiff.tensor(w, device=device, requires_grad=True)
    bt = pydiff.tensor(b, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.relu(ops.linear(xt, wt, bt))
        loss = ops.sum(y * pydiff.tensor(up, device=device))
    tape.backward(loss)
    return {"y": y.numpy(), "w": wt.grad.numpy(), "b": bt.grad.numpy(), "x": xt.grad.numpy()}


@pytest.mark.parametrize(
    "batch, n_in, n_out",
    [(1, 64, 1), (5, 64, 3), (7, 128, 10), (9, 64, 16), (255, 64, 10), (258, 128, 7), (6, 3, 5)],
)
def test_relu_masked_narrow_layer_against_float64(device, monkeypatch, batch, n_in, n_out):
    """relu(linear) under a weighted sum: g' = g [z > 0] in dx, dW and db, about half the
    outputs masked, against float64; four runs with the same bits."""
    rng = np.random.default_rng(7 * batch + n_out + n_in)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    up = rng.standard_normal((batch, n_out)).astype(np.float32)
    used = entries_used(device, monkeypatch)
    runs = [_masked_layer(device, x, w, b, up) for _ in range(4)]
    if _narrow(device, batch, n_in, n_out):
        assert "linear_bwd_narrow" in used
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    g = up * (z > 0)
    want = {"y": np.maximum(z, 0), "w": g.T @ x, "b": g.sum(0), "x": g @ w.astype(np.float64)}
    for got in runs:
        _close(got, want, scale=np.sqrt(batch))
    _same_bits(runs)
