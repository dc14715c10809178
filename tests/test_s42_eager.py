"""The eager MLP step's kernels and submissions (twenty-second session), each against an
independent float64 reference:

- a relu layer's weight gradient with its bias gradient (``mm_tn`` reading g through the
  relu's mask) is computed on lavapipe as (x^T g')^T: the mask is read on the side whose rows
  runs of 8 threads share (``product_kernels._swapped``), C stored transposed and db summed over B;
  the gradients of every shape, either path, against NumPy in float64.
"""

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, products


def _masked_tn64(g, x, h, c0, d0, beta):
    gm = np.where(h <= 0, 0.0, g.astype(np.float64))
    return beta * c0 + gm.T @ x, beta * d0 + gm.sum(0)


@pytest.mark.parametrize(
    "m, n, k", [(64, 64, 256), (64, 64, 100), (32, 128, 64), (64, 16, 8), (128, 64, 33)]
)
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_masked_weight_gradient_with_bias_matches_float64(device, m, n, k, beta):
    """dW = beta dW + (g * [h > 0])^T x and db = beta db + column sums, mask zeros exact."""
    rng = np.random.default_rng(m + n + k)
    g = rng.standard_normal((k, m)).astype(np.float32)
    x = rng.standard_normal((k, n)).astype(np.float32)
    h = rng.standard_normal((k, m)).astype(np.float32)
    h[::3, ::2] = 0.0  # relu's zeros: masked, as x <= 0
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    d0 = rng.standard_normal(m).astype(np.float32)
    t = [pydiff.tensor(v, device=device) for v in (g, x, h, c0, d0)]
    assert products.fast_product("mm_tn", t[0], t[1], t[3], beta, mask=t[2], db=t[4])
    want_c, want_d = _masked_tn64(g, x, h, c0, d0, beta)
    np.testing.assert_allclose(t[3].numpy(), want_c, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(t[4].numpy(), want_d, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("db", [True, False])
def test_masked_weight_gradient_takes_the_swapped_kernel_on_lavapipe(device, db):
    """The 256 x 64 -> 64 relu layer's dW (+ db) plan is the swapped one on lavapipe (the
    kernel that cost 178 us of a step's 457 us of kernels takes ~115 us), a GPU's is not."""
    rng = np.random.default_rng(5)
    g, x, h = (
        pydiff.tensor(rng.standard_normal(s).astype(np.float32), device=device)
        for s in ((256, 64), (256, 64), (256, 64))
    )
    out = pydiff.zeros((64, 64), device=device)
    dbt = pydiff.zeros((64,), device=device) if db else None
    assert products.fast_product("mm_tn", g, x, out, 1.0, mask=h, db=dbt)
    plans = [
        plan
        for key, plan in device.kernels.plans.items()
        if plan and key[:5] == ("product", "mm_tn", 64, 64, 256) and key[7] and key[8] == db
    ]
    # each plan's first item is its kernel's cache key: (file, entry, its defines)
    swapped = [dict(plan[0][2]).get("MASK_B", 0) == 1 for plan in plans]
    assert plans and all(s is (not device.kernels.gpu) for s in swapped)
    gm = np.where(h.numpy() <= 0, 0.0, g.numpy().astype(np.float64))
    np.testing.assert_allclose(out.numpy(), gm.T @ x.numpy(), rtol=1e-5, atol=1e-4)
    if db:
        np.testing.assert_allclose(dbt.numpy(), gm.sum(0), rtol=1e-5, atol=1e-4)


def test_relu_layer_gradients_through_the_tape_match_float64(device):
    """A relu layer written as users write it (whose input needs no gradient: only dW, db),
    its mask with exact zeros, over a loss of two heads: float64 NumPy's gradients."""
    rng = np.random.default_rng(7)
    X = rng.standard_normal((128, 64)).astype(np.float32)
    R = rng.standard_normal((128, 64)).astype(np.float32)
    layer = nn.Linear(64, 64, seed=3, activation="relu")
    xb, rb = pydiff.tensor(X, device=device), pydiff.tensor(R, device=device)
    W, b = layer.weight.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)
    for _ in range(2):
        layer.zero_grad()
        with pydiff.Tape() as tape:
            hidden = layer(xb)
            loss = ops.sum(ops.mul(hidden, rb))
        tape.backward(loss)
        pre = X.astype(np.float64) @ W.T + b
        gm = np.where(pre <= 0, 0.0, R.astype(np.float64))
        np.testing.assert_allclose(layer.weight.grad.numpy(), gm.T @ X, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(layer.bias.grad.numpy(), gm.sum(0), rtol=1e-5, atol=1e-4)
