"""Row reductions stay accurate on long rows (vocabulary-sized softmax and cross-entropy,
RMSNorm and LayerNorm over 200,003 features, attention over 20,000 keys): their sums are
cascaded (shaders/ops/cascade_sum.slang), so the error does not grow with the row length.
A running float32 sum erred by about sqrt(C) ulps: softmax over 50,257 classes was 7e-5
off, RMSNorm over 200,003 values 3e-5, past docs/op-domains.md's 1e-5. References: NumPy
float64 closed forms from the same float32 inputs."""

import numpy as np
import pytest

import pydiff
from pydiff import ops

TOL = 1e-5  # docs/op-domains.md: "a finite value within 1e-5 relative"


def _t(device, a, grad=False):
    return pydiff.tensor(np.asarray(a, np.float32), device=device, requires_grad=grad)


def _softmax64(z):
    z = z.astype(np.float64)
    y = z - z.max(-1, keepdims=True)
    y = y - np.log(np.exp(y).sum(-1, keepdims=True))
    return np.exp(y), y


def _rel(got, ref):
    return float(np.max(np.abs(got - ref) / np.abs(ref)))


def _logits(rows, c, seed=5):
    return (np.random.default_rng(seed).standard_normal((rows, c)) * 5).astype(np.float32)


@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_and_log_softmax_of_50257_classes(device, axis):
    z = _logits(3, 50257)
    p64, y64 = _softmax64(z)
    zin = z if axis == -1 else np.ascontiguousarray(z.T)
    p = ops.softmax(_t(device, zin), axis=axis).numpy()
    y = ops.log_softmax(_t(device, zin), axis=axis).numpy()
    if axis == 0:
        p, y = p.T, y.T
    assert _rel(p, p64) <= TOL
    assert _rel(y, y64) <= TOL


@pytest.mark.parametrize("log_space", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_backward_of_50257_classes(device, log_space):
    z = _logits(3, 50257)
    g = np.random.default_rng(6).standard_normal(z.shape).astype(np.float32) + 1.0
    p64, _ = _softmax64(z)
    g64 = g.astype(np.float64)
    x = _t(device, z, grad=True)
    with pydiff.Tape():
        out = (ops.log_softmax if log_space else ops.softmax)(x)
        loss = ops.sum(ops.mul(out, _t(device, g)))
    loss.backward()
    if log_space:  # g - p sum(g): p within TOL, the row sum within 1e-6 of its terms
        total = g64.sum(-1, keepdims=True)
        ref = g64 - p64 * total
        floor = p64 * (TOL * np.abs(total) + 1e-6 * np.abs(g64).sum(-1, keepdims=True))
    else:  # p (g - sum(g p))
        ref = p64 * (g64 - (g64 * p64).sum(-1, keepdims=True))
        floor = 1e-6 * p64 * (np.abs(g64) + (np.abs(g64) * p64).sum(-1, keepdims=True))
    err = np.abs(x.grad.numpy() - ref)
    assert np.all(err <= TOL * np.abs(ref) + floor), float(np.max(err / (np.abs(ref) + floor)))


@pytest.mark.parametrize("label_dtype", [np.int32, np.float32], ids=["int", "float"])
def test_cross_entropy_loss_and_gradient_of_50257_classes(device, label_dtype):
    """int labels take the compute kernels (ce_forward), float labels the row functions."""
    z = _logits(4, 50257)
    labels = np.random.default_rng(7).integers(0, z.shape[1], z.shape[0])
    p64, y64 = _softmax64(z)
    rows = np.arange(z.shape[0])
    x = _t(device, z, grad=True)
    with pydiff.Tape():
        loss = ops.cross_entropy(x, pydiff.tensor(labels.astype(label_dtype), device=device))
    loss.backward()
    ref = -np.mean(y64[rows, labels])
    assert abs(loss.item() - ref) <= TOL * abs(ref)
    onehot = np.zeros_like(p64)
    onehot[rows, labels] = 1.0
    assert _rel(x.grad.numpy(), (p64 - onehot) / z.shape[0]) <= TOL


def test_rms_norm_of_200003_features(device):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((2, 200003)) * 5 + 3).astype(np.float32)
    w = (rng.standard_normal(x.shape[1]) + 2).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    xt, wt = _t(device, x, grad=True), _t(device, w, grad=True)
    with pydiff.Tape():
        y = ops.rms_norm(xt, wt, eps=1e-6)
        loss = ops.sum(ops.mul(y, _t(device, g)))
    loss.backward()
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
    n = x.shape[1]
    rms = np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    xh = x64 / rms
    assert _rel(y.numpy(), xh * w64) <= TOL
    # dx = (w g - xh c) / rms, c = mean(w g xh): c within 1e-6 of its terms
    c = (w64 * g64 * xh).mean(-1, keepdims=True)
    ref = (w64 * g64 - xh * c) / rms
    floor = np.abs(xh) * 1e-6 * np.abs(w64 * g64 * xh).sum(-1, keepdims=True) / n / rms
    err = np.abs(xt.grad.numpy() - ref)
    assert np.all(err <= TOL * np.abs(ref) + floor), float(np.max(err / (np.abs(ref) + floor)))


def test_layer_norm_backward_of_200003_features(device):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((2, 200003)) * 5 + 3).astype(np.float32)
    g = (rng.standard_normal(x.shape) + 1).astype(np.float32)
    xt = _t(device, x, grad=True)
    with pydiff.Tape():
        loss = ops.sum(ops.mul(ops.layer_norm(xt, eps=1e-5), _t(device, g)))
    loss.backward()
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    sd = np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    xh = (x64 - x64.mean(-1, keepdims=True)) / sd
    c1, c2 = g64.mean(-1, keepdims=True), (g64 * xh).mean(-1, keepdims=True)
    ref = (g64 - c1 - xh * c2) / sd
    n = x.shape[1]
    terms = np.abs(g64).sum(-1, keepdims=True) + np.abs(xh) * np.abs(g64 * xh).sum(
        -1, keepdims=True
    )
    floor = 1e-6 * terms / n / sd
    err = np.abs(xt.grad.numpy() - ref)
    assert np.all(err <= TOL * np.abs(ref) + floor), float(np.max(err / (np.abs(ref) + floor)))


def _attention64(q, k, v, w):
    """softmax(q k^T / sqrt(d)) v and the gradients of sum(out * w), in float64."""
    q, k, v, w = (a.astype(np.float64) for a in (q, k, v, w))
    s = 1.0 / np.sqrt(q.shape[-1])
    p, _ = _softmax64(s * q @ k.T)
    dp = w @ v.T
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return p @ v, (s * ds @ k, s * ds.T @ q, p.T @ w)


@pytest.mark.parametrize("batched", [False, True], ids=["2d", "batched"])
def test_attention_over_20000_keys(device, batched):
    """2-D: the matrix-product kernels around the softmax rows; batched: attention.slang."""
    rng = np.random.default_rng(13)
    q = (rng.standard_normal((2, 4)) * 2).astype(np.float32)
    k = (rng.standard_normal((20000, 4)) * 2).astype(np.float32)
    v = rng.standard_normal((20000, 3)).astype(np.float32)
    w = rng.standard_normal((2, 3)).astype(np.float32)
    lead = (1, 1) if batched else ()
    ts = [_t(device, a.reshape(lead + a.shape), grad=True) for a in (q, k, v)]
    with pydiff.Tape():
        out = ops.attention(*ts)
        loss = ops.sum(ops.mul(out, _t(device, w.reshape(lead + w.shape))))
    loss.backward()
    ref, grads = _attention64(q, k, v, w)
    # out = sum_s p v: within 1e-6 of its terms' sum, sum_s p |v| (at most max |v|)
    assert np.max(np.abs(out.numpy().reshape(ref.shape) - ref)) <= 1e-6 * np.abs(v).max()
    for t, r in zip(ts, grads):
        assert np.max(np.abs(t.grad.numpy().reshape(r.shape) - r)) <= TOL * np.abs(r).max()


def test_long_row_sums_are_bitwise_reproducible(device):
    """The cascade's order is fixed by the row length alone: the same bits every run."""
    z = _logits(2, 50257)
    labels = pydiff.tensor(np.array([3, 50000], np.int32), device=device)
    runs = []
    for _ in range(2):
        x = _t(device, z, grad=True)
        with pydiff.Tape():
            loss = ops.cross_entropy(x, labels)
        loss.backward()
        p = ops.softmax(_t(device, z)).numpy()
        runs.append((p.tobytes(), x.grad.numpy().tobytes(), np.float32(loss.item()).tobytes()))
    assert runs[0] == runs[1]
