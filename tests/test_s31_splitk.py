"""Split-K A^T B on a GPU's kernel shapes (matmul.slang's mm_tn_split,
product_kernels.split_k): a weight gradient's few output blocks each get a workgroup whose
threads share the sum over K and add their parts in a fixed order. Checked on lavapipe by
taking the GPU's shapes (as ``PYDIFF_KERNEL_SHAPES=gpu`` does: ``kernels.gpu``) against
float64 NumPy and PyTorch, bit for bit from run to run, and that the split kernel is the
one that ran."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import kernels, product_kernels, products

RNG = np.random.default_rng(31)


def _forget_plans(kernels) -> None:
    # plans and hot shapes are memoised without ``kernels.gpu`` in their keys
    kernels.plans.clear()
    kernels.shape_uses.clear()
    kernels.fixed_shapes.clear()


@pytest.fixture
def gpu_shapes(device, monkeypatch):
    """The device's fast kernels take a GPU's shapes for this test (PYDIFF_KERNEL_SHAPES=gpu).
    The kernel cache is unbounded meanwhile: a kernel built past ``KERNELS_MAX`` empties the
    plans that ``_entries`` reads, and the worker's earlier tests may have filled the cache."""
    monkeypatch.setattr(device.kernels, "gpu", True)
    monkeypatch.setattr(kernels, "KERNELS_MAX", 1 << 20)
    _forget_plans(device.kernels)
    yield device
    _forget_plans(device.kernels)


def _entries(device, m: int, n: int, k: int) -> set:
    """The kernels fast_product's plans chose for mm_tn products of these sizes."""
    plans = device.kernels.plans.items()
    return {plan[0][1] for key, plan in plans if plan and key[1:5] == ("mm_tn", m, n, k)}


def _f32(shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(
    "k, m, n",
    [
        (256, 64, 64),  # the MLP's hidden dW
        (256, 10, 64),  # its head's dW (10 rows: blocks of 2)
        (257, 7, 12),  # K past a multiple of the split; odd rows
        (100, 5, 20),
        (64, 3, 4),
        (33, 9, 8),  # fewer steps than threads for some threads
        (1, 5, 4),  # one step: one thread of each group has a part
    ],
)
@pytest.mark.parametrize("masked, with_db, beta", [(False, False, 0.0), (True, True, 1.0)])
def test_split_k_product_matches_float64(gpu_shapes, monkeypatch, k, m, n, masked, with_db, beta):
    device = gpu_shapes
    A, B, mask = _f32((k, m)), _f32((k, n)), _f32((k, m))
    C0, D0 = _f32((m, n)), _f32(m)
    c, db = pydiff.tensor(C0, device=device), pydiff.tensor(D0, device=device)
    a, b, mk = (pydiff.tensor(v, device=device) for v in (A, B, mask))
    assert products.fast_product(
        "mm_tn", a, b, c, beta, mask=mk if masked else None, db=db if with_db else None
    )
    assert _entries(device, m, n, k) == {"mm_tn_split"}
    a64 = np.where(mask <= 0, 0.0, A).astype(np.float64) if masked else A.astype(np.float64)
    tol = 1e-5 * np.sqrt(max(k, 16))  # float32 sums of k products: rounding grows like sqrt(k)
    want = beta * C0 + a64.T @ B.astype(np.float64)
    np.testing.assert_allclose(c.numpy(), want, rtol=1e-5, atol=tol)
    if with_db:
        np.testing.assert_allclose(db.numpy(), beta * D0 + a64.sum(0), rtol=1e-5, atol=tol)
    else:
        assert db.numpy().tobytes() == D0.tobytes()  # not written


def test_split_k_rule(gpu_shapes, monkeypatch):
    """Split on a GPU's shapes where the output has few blocks, whatever K (one kernel for
    every batch size); never on lavapipe's shapes nor for the other products."""
    for k in (1, 8, 256, 4096):
        assert (
            product_kernels.split_k("mm_tn", 64, 64, k, gpu=True) == product_kernels.SPLIT_K_THREADS
        )
    assert product_kernels.split_k("mm_tn", 64, 64, 256, gpu=False) == 1
    assert product_kernels.split_k("mm_nn", 64, 64, 256, gpu=True) == 1
    assert product_kernels.split_k("mm_tn", 1024, 1024, 256, gpu=True) == 1  # threads enough
    monkeypatch.setattr(product_kernels, "SPLIT_K_MAX_BLOCKS", 0)  # (the benchmark's "no split")
    a, b = (pydiff.tensor(_f32((80, 4)), device=gpu_shapes) for _ in range(2))
    out = pydiff.zeros((4, 4), device=gpu_shapes)
    assert products.fast_product("mm_tn", a, b, out, 0.0)
    assert _entries(gpu_shapes, 4, 4, 80) == {"mm_tn"}


def test_split_k_is_bitwise_repeatable(gpu_shapes):
    """The same bits every run, across the switch to constant sizes (a hot shape), with the
    gradient accumulated (beta = 1) into the same start."""
    device = gpu_shapes
    k, m, n = 300, 64, 64
    A, B, mask, C0, D0 = _f32((k, m)), _f32((k, n)), _f32((k, m)), _f32((m, n)), _f32(m)
    a, b, mk = (pydiff.tensor(v, device=device) for v in (A, B, mask))
    runs = []
    for _ in range(products.HOT_SHAPE_USES + 3):
        c, db = pydiff.tensor(C0, device=device), pydiff.tensor(D0, device=device)
        assert products.fast_product("mm_tn", a, b, c, 1.0, mask=mk, db=db)
        runs.append(c.numpy().tobytes() + db.numpy().tobytes())
    assert _entries(device, m, n, k) == {"mm_tn_split"}
    fixed = [plan[0][2] for key, plan in device.kernels.plans.items() if key[-1] and plan]
    assert any(("FIXED_K", k) in defines for defines in fixed)  # it did turn hot
    assert len(set(runs)) == 1


@pytest.mark.parametrize("batch", [256, 100])
def test_linear_gradients_match_torch_with_split_k(gpu_shapes, batch):
    """A two-layer MLP (relu fused, biases) backward on the GPU's shapes against PyTorch
    float64: both weight gradients (dW = g^T x, with db fused) take the split kernel."""
    torch = pytest.importorskip("torch")
    device = gpu_shapes
    hidden = pydiff.nn.Linear(64, 64, seed=1, activation="relu", device=device)
    head = pydiff.nn.Linear(64, 12, seed=2, device=device)
    X, G = _f32((batch, 64)), _f32((batch, 12))
    x = pydiff.tensor(X, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = head(hidden(x))
    tape.backward(y, grad=pydiff.tensor(G, device=device))
    assert _entries(device, 64, 64, batch) == {"mm_tn_split"}  # the hidden layer's dW
    assert _entries(device, 12, 64, batch) == {"mm_tn_split"}  # the head's

    def t64(v):
        return torch.tensor(np.asarray(v, np.float64), requires_grad=True)

    tx, w1, b1 = t64(X), t64(hidden.weight.numpy()), t64(hidden.bias.numpy())
    w2, b2 = t64(head.weight.numpy()), t64(head.bias.numpy())
    ty = torch.relu(tx @ w1.T + b1) @ w2.T + b2
    ty.backward(torch.tensor(G, dtype=torch.float64))
    tol = 1e-5 * np.sqrt(batch)
    pairs = [(x, tx), (hidden.weight, w1), (hidden.bias, b1), (head.weight, w2), (head.bias, b2)]
    for ours, theirs in pairs:
        np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-5, atol=tol)


def test_a_split_that_is_not_a_power_of_two_is_refused(gpu_shapes, monkeypatch):
    monkeypatch.setattr(product_kernels, "SPLIT_K_THREADS", 24)
    with pytest.raises(ValueError, match="SPLIT_K_THREADS=24.*power of two"):
        product_kernels.split_k("mm_tn", 64, 64, 256, gpu=True)
