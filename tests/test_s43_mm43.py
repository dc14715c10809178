"""The matrix products' 64-bit word reads (matmul.slang's W64, lavapipe): the same bits as the
typed float4 loads. Every product, and an MLP trained 200 steps, under the default selection,
with every read typed (``PYDIFF_MM_W64=''``) and with every read as words (all bits set):
identical bits, and right against NumPy float64."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim, product_kernels, products
from pydiff.errors import PydiffError

ALL_WORDS = "mm_nt=7,mm_nn=7,mm_tn=7,mm_tn_swapped=7,linear_bwd_narrow=7"
SETTINGS = [None, "", ALL_WORDS]  # the selection, all typed, all 64-bit words


def _use(device, monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("PYDIFF_MM_W64", raising=False)
    else:
        monkeypatch.setenv("PYDIFF_MM_W64", setting)
    device.kernels.plans.clear()  # a plan keeps the kernel it chose (the setting read then)


def _record(monkeypatch):
    seen: list = []
    real = product_kernels.load_words

    def load_words(kernels, entry, n=0, cols=0):
        bits = real(kernels, entry, n, cols)
        seen.append((entry, bits))
        return bits

    monkeypatch.setattr(product_kernels, "load_words", load_words)  # the products' choice
    monkeypatch.setattr(products, "load_words", load_words)  # the narrow layer backward's
    return seen


def _layer_grads(device, batch, n_in, n_out, relu, seed):
    """One linear layer (relu optional) under a weighted sum: y, dx, dW, db."""
    rng = np.random.default_rng(seed)
    xv = rng.standard_normal((batch, n_in)).astype(np.float32)
    up = rng.standard_normal((batch, n_out)).astype(np.float32)
    layer = nn.Linear(n_in, n_out, device=device, seed=seed, activation="relu" if relu else None)
    x = pydiff.tensor(xv, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = layer(x)
        loss = ops.sum(y * pydiff.tensor(up, device=device))
    tape.backward(loss)
    w, b = (p.numpy().astype(np.float64) for p in layer.parameters())
    out = [y.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in layer.parameters()]
    z = xv.astype(np.float64) @ w.T + b
    g = up * (z > 0) if relu else up.astype(np.float64)
    want = [np.maximum(z, 0) if relu else z, g @ w, g.T @ xv, g.sum(0)]
    return out, want


# (batch, in, out): mm_nt with cols == n and n % 8 (n = 10, 12, 20: the selection's 64-bit B),
# n % 8 == 0 (typed), the narrow backward (in % 64 == 0, out <= its max), mm_nn/mm_tn at odd
# sizes, batches not a multiple of the row blocks (edge tiles) and shapes no fast kernel takes.
SHAPES = [
    (256, 64, 10),
    (96, 64, 12),
    (64, 128, 20),
    (256, 64, 64),
    (40, 24, 36),
    (37, 20, 12),
    (33, 64, 10),
    (24, 40, 8),
    (7, 13, 5),
    (128, 32, 16),
]


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layers_match_numpy_and_each_other_bit_for_bit(device, monkeypatch, shape, relu):
    seen = _record(monkeypatch)
    results = []
    for setting in SETTINGS:
        _use(device, monkeypatch, setting)
        got, want = _layer_grads(device, *shape, relu, seed=sum(shape))
        for name, g, w in zip(("y", "dx", "dW", "db"), got, want):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-4, err_msg=f"{name} {setting!r}")
        results.append(got)
    for got in results[1:]:
        for a, b in zip(results[0], got):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    if device.kernels.paired_stores and seen:  # the products this shape takes saw both forms
        assert {bits for _, bits in seen} >= {0, 7}


@pytest.mark.parametrize("m, k, n", [(8, 16, 4), (24, 40, 36), (37, 12, 20), (64, 8, 10)])
def test_matmul_matches_numpy_and_each_other_bit_for_bit(device, monkeypatch, m, k, n):
    rng = np.random.default_rng(m * k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    results = []
    for setting in SETTINGS:
        _use(device, monkeypatch, setting)
        got = ops.matmul(pydiff.tensor(a, device=device), pydiff.tensor(b, device=device))
        np.testing.assert_allclose(got.numpy(), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
        results.append(got.numpy().view(np.uint32))
    for got in results[1:]:
        np.testing.assert_array_equal(results[0], got)


def _train_hash(device, steps=200):
    """benchmarks/mlp_step.py's step (256 x 64 x 64 x 10, AdamW), ``steps`` times: a hash of
    the parameters' bits."""
    rng = np.random.default_rng(0)
    xb = pydiff.tensor(rng.standard_normal((256, 64)).astype(np.float32), device=device)
    yb = pydiff.tensor(rng.integers(0, 10, 256).astype(np.int32), device=device)
    layers = [nn.Linear(64, 64, seed=0, activation="relu"), nn.Linear(64, 10, seed=1)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = optim.AdamW(params, lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss, retain_graph=False)
        opt.step()
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p.numpy()).tobytes())
    return h.hexdigest(), float(loss.numpy())


def test_mlp_training_gives_the_same_bits_with_either_read(monkeypatch):
    device = pydiff.default_device()
    runs = []
    for setting in SETTINGS:
        _use(device, monkeypatch, setting)
        runs.append(_train_hash(device))
    assert runs[0] == runs[1] == runs[2], runs
    assert runs[0][1] < 2.3  # it trained (the loss starts near ln 10)


def test_the_selection_and_the_override(monkeypatch):
    class Lavapipe:
        paired_stores = True

    class Gpu:
        paired_stores = False

    monkeypatch.delenv("PYDIFF_MM_W64", raising=False)
    assert product_kernels.load_words(Lavapipe, "mm_nt", 10, 10) == 2  # B shared by all threads
    assert product_kernels.load_words(Lavapipe, "mm_nt", 12, 12) == 2
    assert product_kernels.load_words(Lavapipe, "mm_nt", 64, 64) == 0  # n % 8 == 0: typed
    assert product_kernels.load_words(Lavapipe, "mm_nt", 20, 4) == 0  # column blocks: typed
    for entry in ("mm_nn", "mm_tn", "mm_tn_swapped", "linear_bwd_narrow"):
        assert product_kernels.load_words(Lavapipe, entry, 10, 10) == 0
    assert product_kernels.load_words(Gpu, "mm_nt", 10, 10) == 0
    monkeypatch.setenv("PYDIFF_MM_W64", "mm_tn=5,linear_bwd_narrow=3")
    assert product_kernels.load_words(Lavapipe, "mm_tn") == 5
    assert product_kernels.load_words(Lavapipe, "linear_bwd_narrow") == 3
    assert product_kernels.load_words(Lavapipe, "mm_nt", 10, 10) == 0  # not named: typed
    assert product_kernels.load_words(Gpu, "mm_tn") == 0  # GPUs keep float4 loads
    monkeypatch.setenv("PYDIFF_MM_W64", "mm_nt")
    with pytest.raises(PydiffError, match="PYDIFF_MM_W64"):
        product_kernels.load_words(Lavapipe, "mm_nt", 10, 10)
    monkeypatch.setenv("PYDIFF_MM_W64", "mm_nt=two")
    with pytest.raises(PydiffError, match="PYDIFF_MM_W64"):
        product_kernels.load_words(Lavapipe, "mm_nt", 10, 10)


@pytest.mark.parametrize("n", [1, 5, 4099])
def test_dropout4_reads_words_and_keeps_the_bits(device, n):
    rng = np.random.default_rng(n)
    v = (rng.random(n) + 0.5).astype(np.float32)
    y = ops.dropout(pydiff.tensor(v, device=device), 0.25, seed=7).numpy()
    kept = y != 0
    assert 0 < kept.sum() <= n
    np.testing.assert_array_equal(y, np.where(kept, v * np.float32(1 / 0.75), 0))
