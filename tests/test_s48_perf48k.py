"""perf48k: the narrow backward takes its rows RU at a time (matmul.slang's RU, the rest one at
a time), and mm_nt shares B rows through shuffles where a thread holds whole rows of C
(cols == n, n % 8 != 0: a classifier head). Against float64 NumPy at batch sizes around the
row step (B % 4 of 0-3, batch 1), with the sizes as uniforms and as constants, masked (relu),
fused with the cross-entropy, without dx or db; the fused head's forward with the shuffle."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, product_kernels, products

from kernel_usage import entries_used


def _lavapipe(device) -> bool:
    return not device.kernels.gpu


def _linear_grads(device, batch, n_in, n_out, relu, seed, x_grad=True, bias=True):
    """One linear layer (relu optional) under a weighted sum: results and float64 references."""
    rng = np.random.default_rng(seed)
    xv = rng.standard_normal((batch, n_in)).astype(np.float32)
    up = rng.standard_normal((batch, n_out)).astype(np.float32)
    wv = (rng.standard_normal((n_out, n_in)) * 0.3).astype(np.float32)
    bv = rng.standard_normal(n_out).astype(np.float32)
    x = pydiff.tensor(xv, device=device, requires_grad=x_grad)
    w = pydiff.tensor(wv, device=device, requires_grad=True)
    b = pydiff.tensor(bv, device=device, requires_grad=True) if bias else None
    with pydiff.Tape() as tape:
        y = ops.linear(x, w, b)
        if relu:
            y = ops.relu(y)
        loss = ops.sum(y * pydiff.tensor(up, device=device))
    tape.backward(loss)
    got = {"y": y.numpy(), "w": w.grad.numpy()}
    z = xv.astype(np.float64) @ wv.T.astype(np.float64) + (bv if bias else 0.0)
    g = up * (z > 0) if relu else up.astype(np.float64)
    want = {"y": np.maximum(z, 0) if relu else z, "w": g.T @ xv}
    if bias:
        got["b"], want["b"] = b.grad.numpy(), g.sum(0)
    if x_grad:
        got["x"], want["x"] = x.grad.numpy(), g @ wv
    return got, want


def _close(got, want, scale=1.0):
    for name in want:
        np.testing.assert_allclose(
            got[name], want[name], rtol=2e-5, atol=2e-5 * scale, err_msg=name
        )


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 7, 255, 256, 257, 258])
@pytest.mark.parametrize("relu", [False, True])
def test_narrow_backward_rows_around_the_step(device, monkeypatch, batch, relu):
    """Batch sizes of every remainder modulo the row step; the first call takes the batch as
    a uniform, the fourth as a constant (a hot shape): both match float64 and each other."""
    used = entries_used(device, monkeypatch)
    runs = [_linear_grads(device, batch, 64, 10, relu, seed=batch) for _ in range(4)]
    if _lavapipe(device):
        assert "linear_bwd_narrow" in used
    for got, want in runs:
        _close(got, want, scale=np.sqrt(batch))
    for name in runs[0][0]:
        np.testing.assert_array_equal(runs[0][0][name], runs[3][0][name], err_msg=name)


@pytest.mark.parametrize(
    "batch, n_in, n_out, x_grad, bias",
    [(6, 128, 16, True, False), (9, 64, 1, False, True), (33, 192, 3, False, False)],
)
def test_narrow_backward_without_dx_or_db(device, monkeypatch, batch, n_in, n_out, x_grad, bias):
    used = entries_used(device, monkeypatch)
    got, want = _linear_grads(device, batch, n_in, n_out, False, 7, x_grad=x_grad, bias=bias)
    if _lavapipe(device):
        assert "linear_bwd_narrow" in used
    _close(got, want, scale=np.sqrt(batch))


def _ce_reference(x, w, b, labels):
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    loss = np.mean(np.log(e.sum(axis=1)) + z.max(axis=1) - z[np.arange(len(labels)), labels])
    dz = (p - np.eye(z.shape[1])[labels]) / len(labels)
    return loss, {"z": dz, "w": dz.T @ x, "b": dz.sum(0), "x": dz @ w}


@pytest.mark.parametrize(
    "batch, n_out", [(1, 10), (3, 10), (6, 3), (64, 10), (255, 10), (256, 10), (256, 12), (512, 15)]
)
def test_fused_cross_entropy_head(device, monkeypatch, batch, n_out):
    """linear -> cross_entropy, its forward (the product with the cross-entropy, B rows shared
    where they fit) and its fused backward, four times (uniform sizes, then constants)."""
    rng = np.random.default_rng(batch + n_out)
    x = rng.standard_normal((batch, 64)).astype(np.float32)
    w = (rng.standard_normal((n_out, 64)) * 0.3).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    labels = rng.integers(0, n_out, batch).astype(np.int32)
    want_loss, want = _ce_reference(x, w, b, labels)
    used = entries_used(device, monkeypatch)
    results = []
    for _ in range(4):
        xt = pydiff.tensor(x, device=device, requires_grad=True)
        wt = pydiff.tensor(w, device=device, requires_grad=True)
        bt = pydiff.tensor(b, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            z = ops.linear(xt, wt, bt)
            loss = ops.cross_entropy(z, pydiff.tensor(labels, device=device))
        tape.backward(loss)
        got = {"z": z.grad.numpy(), "w": wt.grad.numpy(), "b": bt.grad.numpy()}
        got["x"] = xt.grad.numpy()
        np.testing.assert_allclose(loss.item(), want_loss, rtol=1e-5)
        _close(got, want)
        results.append((loss.item(), got))
    if _lavapipe(device):
        assert "linear_bwd_narrow" in used and "ce_backward_acc" not in used
    assert results[0][0] == results[3][0]
    for name in results[0][1]:
        np.testing.assert_array_equal(results[0][1][name], results[3][1][name], err_msg=name)


@pytest.mark.parametrize(
    "m, n, k", [(256, 10, 64), (128, 3, 8), (64, 10, 4), (512, 12, 36), (256, 15, 64), (64, 7, 12)]
)
@pytest.mark.parametrize("relu", [False, True])
def test_mm_nt_whole_rows_shared(device, monkeypatch, m, n, k, relu):
    """x W^T + b (relu) where each thread holds whole rows of C and n % 8 != 0: B's rows shared
    by shuffles on lavapipe (SHUF) where the row blocks come in runs of 8, against float64."""
    rng = np.random.default_rng(m + n + k)
    xv = rng.standard_normal((m, k)).astype(np.float32)
    wv = rng.standard_normal((n, k)).astype(np.float32)
    bv = rng.standard_normal(n).astype(np.float32)
    seen = []
    real = device.kernels.get_keyed

    def get_keyed(file, entry, **defines):
        seen.append((entry, defines))
        return real(file, entry, **defines)

    monkeypatch.setattr(device.kernels, "get_keyed", get_keyed)
    device.kernels.plans.clear()  # (a plan keeps its kernel: asked for once per shape)
    x, w, b = (pydiff.tensor(v, device=device) for v in (xv, wv, bv))
    outs = [ops.linear(x, w, b).numpy() if not relu else ops.relu(ops.linear(x, w, b)).numpy()]
    outs += [products.product("mm_nt", x, w, (m, n), bias=b, relu=relu).numpy() for _ in range(3)]
    z = xv.astype(np.float64) @ wv.T.astype(np.float64) + bv
    want = np.maximum(z, 0) if relu else z
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * np.sqrt(k))
    np.testing.assert_array_equal(outs[1], outs[3])
    rows, cols = product_kernels.blocking("mm_nt", m, n, k)
    if _lavapipe(device) and cols == n and (m // rows) % 8 == 0:
        assert any(e == "mm_nt" and d.get("SHUF") == 1 and d["CB"] == n for e, d in seen)


def test_mlp_steps_match_float64_torch(device):
    """The benchmarks' step (relu layer, head, cross-entropy, AdamW) for 5 steps at batch 255
    against PyTorch in float64 (the same initial parameters)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((255, 64)).astype(np.float32)
    yv = rng.integers(0, 10, 255).astype(np.int32)
    layers = [
        nn.Linear(64, 64, seed=0, activation="relu", device=device),
        nn.Linear(64, 10, seed=1, device=device),
    ]
    params = [p for layer in layers for p in layer.parameters()]
    opt = pydiff.optim.AdamW(params, lr=1e-3)
    tparams = [torch.tensor(p.numpy().astype(np.float64), requires_grad=True) for p in params]
    topt = torch.optim.AdamW(tparams, lr=1e-3)
    xb, yb = pydiff.tensor(xv, device=device), pydiff.tensor(yv, device=device)
    tx, ty = torch.tensor(xv, dtype=torch.float64), torch.tensor(yv, dtype=torch.int64)
    for _ in range(5):
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss)
        opt.step()
        topt.zero_grad()
        h = torch.relu(tx @ tparams[0].T + tparams[1])
        tloss = torch.nn.functional.cross_entropy(h @ tparams[2].T + tparams[3], ty)
        tloss.backward()
        topt.step()
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5)
    for p, tp in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-4, atol=1e-5)


_WARNING_SCRIPT = """
import numpy as np, pydiff
from pydiff import ops
for batch in (256, 7):  # fixed sizes (a hot shape) with and without rows past the last step
    rng = np.random.default_rng(0)
    x = pydiff.tensor(rng.standard_normal((batch, 64)).astype(np.float32), requires_grad=True)
    w = pydiff.tensor(rng.standard_normal((10, 64)).astype(np.float32), requires_grad=True)
    labels = pydiff.tensor(rng.integers(0, 10, batch).astype(np.int32))
    for _ in range(4):
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(ops.linear(x, w), labels)
        tape.backward(loss)
print(float(w.grad.numpy().sum()))
"""


def test_narrow_kernels_compile_without_warnings(tmp_path):
    """The row step's tail loop is left out where the batch is a constant multiple of the step
    (Slang warned of a loop of no steps, on stderr, at the fixed kernel's compile)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYDIFF_CACHE="0")
    run = subprocess.run(
        [sys.executable, "-c", _WARNING_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert "warning" not in (run.stdout + run.stderr).lower(), run.stdout + run.stderr


# mm_nn / mm_tn with B's rows shared (SHUF): the KU rows of a step spread over a run's 8 threads,
# B_ELEMS = KU * CB / 4 elements: 1, 2, 3 (duplicates past the last), 8, 16; masked (relu).
_SPREAD_SHAPES = [
    # (m, k, n): C = A B is m x n, the sum over k; dB = A^T g is k x n, summed over m
    (64, 64, 64),
    (128, 3, 4),
    (64, 6, 8),
    (256, 257, 16),
    (512, 2, 12),
    (64, 1, 20),
    (96, 130, 64),
]


@pytest.mark.parametrize("m, k, n", _SPREAD_SHAPES)
@pytest.mark.parametrize("relu", [False, True])
def test_products_with_spread_b_rows(device, monkeypatch, m, k, n, relu):
    """matmul's forward (mm_nn) and backward (dA = g B^T, dB = A^T g: mm_nt, mm_tn) and a relu
    layer's masked dW, against float64, with the sizes as uniforms and as constants."""
    rng = np.random.default_rng(m * 7 + k * 3 + n)
    av = rng.standard_normal((m, k)).astype(np.float32)
    bv = rng.standard_normal((k, n)).astype(np.float32)
    up = rng.standard_normal((m, n)).astype(np.float32)
    seen = []
    real = device.kernels.get_keyed

    def get_keyed(file, entry, **defines):
        seen.append((entry, defines))
        return real(file, entry, **defines)

    monkeypatch.setattr(device.kernels, "get_keyed", get_keyed)
    device.kernels.plans.clear()
    z = av.astype(np.float64) @ bv.astype(np.float64)
    g = up * (z > 0) if relu else up.astype(np.float64)
    want = {"c": np.maximum(z, 0) if relu else z, "a": g @ bv.T, "b": av.T @ g}
    runs = []
    for _ in range(4):
        a = pydiff.tensor(av, device=device, requires_grad=True)
        b = pydiff.tensor(bv, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            c = ops.matmul(a, b)
            if relu:
                c = ops.relu(c)
            loss = ops.sum(c * pydiff.tensor(up, device=device))
        tape.backward(loss)
        got = {"c": c.numpy(), "a": a.grad.numpy(), "b": b.grad.numpy()}
        for name in want:
            np.testing.assert_allclose(
                got[name], want[name], rtol=2e-5, atol=3e-5 * np.sqrt(max(m, k)), err_msg=name
            )
        runs.append(got)
    for name in want:
        np.testing.assert_array_equal(runs[0][name], runs[3][name], err_msg=name)


def test_spread_b_rows_kernels_are_exercised(device, monkeypatch):
    """The shapes above reach mm_nn / mm_tn kernels with SHUF and B_ELEMS (KU * CB / 4, a power
    of two) of fewer than 8 (threads past the last element load duplicates) and of several
    rounds."""
    if not _lavapipe(device):
        pytest.skip("the shuffled kernels are lavapipe's plan")
    used = []
    real = device.kernels.get_keyed

    def get_keyed(file, entry, **defines):
        used.append((entry, defines))
        return real(file, entry, **defines)

    monkeypatch.setattr(device.kernels, "get_keyed", get_keyed)
    device.kernels.plans.clear()
    rng = np.random.default_rng(0)
    for m, k, n in _SPREAD_SHAPES:
        a = pydiff.tensor(rng.standard_normal((m, k)).astype(np.float32), requires_grad=True)
        b = pydiff.tensor(rng.standard_normal((k, n)).astype(np.float32), requires_grad=True)
        with pydiff.Tape() as tape:
            loss = ops.sum(ops.relu(ops.matmul(a, b)))
        tape.backward(loss)
    elems = {
        d["KU"] * d["CB"] // 4
        for e, d in used
        if e in ("mm_nn", "mm_tn") and d.get("SHUF") == 1 and not d.get("MASK_B")
    }
    assert min(elems) < 8 and max(elems) > 8, elems


@pytest.mark.parametrize(
    "batch, n_in, n_out", [(255, 64, 64), (8, 128, 32), (1024, 64, 16), (4, 64, 8)]
)
def test_relu_layer_masked_dw(device, monkeypatch, batch, n_in, n_out):
    """A relu layer's dW + db (mm_tn through the relu's mask; on lavapipe its swapped form, B
    the masked gradient, its rows spread over the threads) against float64, uniform and
    constant sizes, the same bits both ways."""
    used = entries_used(device, monkeypatch)
    runs = [_linear_grads(device, batch, n_in, n_out, True, seed=n_out) for _ in range(4)]
    if _lavapipe(device):
        assert "mm_tn" in used or "linear_bwd_narrow" in used
    for got, want in runs:
        _close(got, want, scale=np.sqrt(batch))
    for name in runs[0][0]:
        np.testing.assert_array_equal(runs[0][0][name], runs[3][0][name], err_msg=name)
