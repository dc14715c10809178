"""pydiff.ops against NumPy float64 references; backward by gradcheck and closed forms."""

import numpy as np
import pytest

import pydiff
from pydiff import ops

RNG = np.random.default_rng(7)


def _t(device, data, grad=True):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, requires_grad=grad)


UNARY = {
    "neg": (lambda x: -x, lambda x: -np.ones_like(x)),
    "exp": (np.exp, np.exp),
    "sin": (np.sin, np.cos),
    "cos": (np.cos, lambda x: -np.sin(x)),
    "tanh": (np.tanh, lambda x: 1 - np.tanh(x) ** 2),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), lambda x: np.exp(-x) / (1 + np.exp(-x)) ** 2),
    "relu": (lambda x: np.maximum(x, 0), lambda x: (x > 0).astype(float)),
    "silu": (
        lambda x: x / (1 + np.exp(-x)),
        lambda x: 1 / (1 + np.exp(-x)) * (1 + x * (1 - 1 / (1 + np.exp(-x)))),
    ),
    "gelu": (
        lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_forward_and_backward(device, name):
    f, df = UNARY[name]
    xs = np.array([-2.0, -0.7, 0.3, 1.1, 2.5])
    x = _t(device, xs)
    with pydiff.Tape() as tape:
        y = getattr(ops, name)(x)
    np.testing.assert_allclose(y.numpy(), f(xs), rtol=2e-5, atol=1e-6)
    tape.backward(y, grad=np.ones(5))
    if df is not None:
        np.testing.assert_allclose(x.grad.numpy(), df(xs), rtol=2e-5, atol=1e-6)
    assert pydiff.gradcheck(getattr(ops, name), (_t(device, xs),))


def test_log_sqrt_and_binary_ops(device):
    xs, ys = np.array([0.5, 1.5, 3.0]), np.array([2.0, -1.0, 0.25])
    for name, ref in [("add", xs + ys), ("sub", xs - ys), ("mul", xs * ys), ("div", xs / ys)]:
        np.testing.assert_allclose(
            getattr(ops, name)(_t(device, xs), _t(device, ys)).numpy(), ref, rtol=1e-6
        )
        assert pydiff.gradcheck(getattr(ops, name), (_t(device, xs), _t(device, ys)))
    np.testing.assert_allclose(ops.log(_t(device, xs)).numpy(), np.log(xs), rtol=1e-6)
    np.testing.assert_allclose(ops.sqrt(_t(device, xs)).numpy(), np.sqrt(xs), rtol=1e-6)
    assert pydiff.gradcheck(ops.log, (_t(device, xs),))


def test_swiglu(device):
    g, u = np.array([-1.0, 0.5, 2.0]), np.array([0.3, -2.0, 1.0])
    sig = 1 / (1 + np.exp(-g))
    gt, ut = _t(device, g), _t(device, u)
    with pydiff.Tape() as tape:
        y = ops.swiglu(gt, ut)
    np.testing.assert_allclose(y.numpy(), g * sig * u, rtol=1e-6)
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(gt.grad.numpy(), u * sig * (1 + g * (1 - sig)), rtol=1e-5)
    np.testing.assert_allclose(ut.grad.numpy(), g * sig, rtol=1e-6)


def test_extreme_inputs_stay_finite(device):
    big = _t(device, [-1e4, -100.0, 100.0, 1e4])
    for name in ("sigmoid", "tanh", "silu", "gelu"):
        out = getattr(ops, name)(big).numpy()
        assert np.all(np.isfinite(out)), name
    logits = _t(device, [[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]])
    loss = ops.cross_entropy(logits, [0, 2])
    np.testing.assert_allclose(loss.numpy(), [0.5 * np.log(3.0)], rtol=1e-5)
    lsm = ops.log_softmax(logits).numpy()
    assert np.all(np.isfinite(lsm[1])) and lsm[0, 0] == 0.0


def test_matmul_and_linear(device):
    A, B = RNG.standard_normal((4, 3)), RNG.standard_normal((3, 5))
    a, b = _t(device, A), _t(device, B)
    with pydiff.Tape() as tape:
        c = ops.matmul(a, b)
    np.testing.assert_allclose(c.numpy(), A @ B, rtol=1e-5, atol=1e-6)
    G = RNG.standard_normal((4, 5))
    tape.backward(c, grad=G)
    np.testing.assert_allclose(a.grad.numpy(), G @ B.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), A.T @ G, rtol=1e-5, atol=1e-5)
    X, W, bb = RNG.standard_normal((6, 3)), RNG.standard_normal((2, 3)), RNG.standard_normal(2)
    np.testing.assert_allclose(
        ops.linear(_t(device, X), _t(device, W), _t(device, bb)).numpy(),
        X @ W.T + bb,
        rtol=1e-5,
        atol=1e-5,
    )
    assert pydiff.gradcheck(ops.linear, (_t(device, X[:3]), _t(device, W), _t(device, bb)))
    assert pydiff.gradcheck(ops.linear, (_t(device, X[:3]), _t(device, W)))


def test_reductions_and_losses(device):
    X = RNG.standard_normal((3, 4))
    np.testing.assert_allclose(ops.sum(_t(device, X)).numpy(), [X.sum()], rtol=1e-5)
    np.testing.assert_allclose(ops.mean(_t(device, X)).numpy(), [X.mean()], rtol=1e-5, atol=1e-7)
    assert pydiff.gradcheck(ops.mean, (_t(device, X),))
    T = RNG.standard_normal((3, 4))
    np.testing.assert_allclose(
        ops.mse_loss(_t(device, X), _t(device, T)).numpy(), [np.mean((X - T) ** 2)], rtol=1e-5
    )
    assert pydiff.gradcheck(ops.mse_loss, (_t(device, X), _t(device, T, grad=False)))
    labels = np.array([0, 3, 1])
    Z = RNG.standard_normal((3, 4))
    P = np.exp(Z - Z.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    np.testing.assert_allclose(
        ops.cross_entropy(_t(device, Z), labels).numpy(),
        [-np.mean(np.log(P[np.arange(3), labels]))],
        rtol=1e-5,
    )
    assert pydiff.gradcheck(lambda z: ops.cross_entropy(z, labels), (_t(device, Z),))
    np.testing.assert_allclose(ops.softmax(_t(device, Z)).numpy(), P, rtol=1e-5)


def test_shape_errors(device):
    with pytest.raises(
        ValueError, match=r"matmul: inner dimensions differ: a is \(2, 3\), b is \(2, 3\)"
    ):
        ops.matmul(_t(device, np.ones((2, 3))), _t(device, np.ones((2, 3))))
    with pytest.raises(ValueError, match=r"linear: x has 3 features but weight \(2, 4\)"):
        ops.linear(_t(device, np.ones((2, 3))), _t(device, np.ones((2, 4))))
    with pytest.raises(ValueError, match=r"add: shapes \(3,\) and \(4,\) do not broadcast"):
        ops.add(_t(device, np.ones(3)), _t(device, np.ones(4)))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        ops.cross_entropy(_t(device, np.ones((2, 3))), [0, 3])


def test_mlp_learns_end_to_end(device):
    """samples/train_mlp.py's model (linear -> relu -> linear -> cross_entropy, AdamW) reaches
    at least 85% test accuracy (digits when scikit-learn is installed, else the spiral)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "samples" / "train_mlp.py"
    spec = importlib.util.spec_from_file_location("train_mlp", path)
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    pydiff.set_default_device(device)
    try:
        _, losses, acc, name = sample.train(epochs=15, progress=False)
        _, eager_losses, _, _ = sample.train(epochs=2, progress=False, capture=False)
    finally:
        pydiff.set_default_device(None)
    assert losses[-1] < losses[0] / 2
    assert acc >= 0.85, f"{name}: test accuracy {acc:.3f}"
    # The sample replays a captured step: its first epochs match running every step eagerly.
    np.testing.assert_allclose(losses[:2], eager_losses, rtol=1e-6)


def test_rms_norm(device):
    X, W = RNG.standard_normal((3, 5)), RNG.uniform(0.5, 1.5, 5)
    r = 1 / np.sqrt(np.mean(X**2, axis=1, keepdims=True) + 1e-6)
    y = ops.rms_norm(_t(device, X), _t(device, W))
    np.testing.assert_allclose(y.numpy(), X * r * W, rtol=1e-5, atol=1e-6)
    assert pydiff.gradcheck(ops.rms_norm, (_t(device, X), _t(device, W)))
    # closed form of the gradient for an upstream G
    G = RNG.standard_normal((3, 5))
    x, w = _t(device, X), _t(device, W)
    with pydiff.Tape() as tape:
        out = ops.rms_norm(x, w)
    tape.backward(out, grad=G)
    dx = r * (W * G - X * r**2 * np.mean(W * G * X, axis=1, keepdims=True))
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), np.sum(G * X * r, axis=0), rtol=1e-4, atol=1e-5)
    zeros = ops.rms_norm(_t(device, np.zeros((2, 4))), _t(device, np.ones(4)))
    assert np.all(np.isfinite(zeros.numpy()))
    with pytest.raises(ValueError, match=r"weight must have shape \(5,\)"):
        ops.rms_norm(_t(device, X), _t(device, np.ones(4)))


@pytest.mark.parametrize(
    "axis,keepdims", [(None, False), (0, False), (1, True), (-1, False), (2, True)]
)
def test_sum_and_mean_over_an_axis(device, axis, keepdims):
    X = RNG.standard_normal((3, 4, 5))
    want_sum = X.sum(axis=axis, keepdims=keepdims) if axis is not None else [X.sum()]
    want_mean = X.mean(axis=axis, keepdims=keepdims) if axis is not None else [X.mean()]
    got = ops.sum(_t(device, X), axis=axis, keepdims=keepdims).numpy()
    np.testing.assert_allclose(got, want_sum, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        ops.mean(_t(device, X), axis=axis, keepdims=keepdims).numpy(),
        want_mean,
        rtol=1e-5,
        atol=1e-6,
    )
    assert pydiff.gradcheck(
        lambda x: ops.mean(x, axis=axis, keepdims=keepdims), (_t(device, X[:2, :3, :2]),)
    )
    with pydiff.Tape() as tape:
        x = _t(device, X)
        s = ops.sum(x, axis=axis, keepdims=keepdims)
    G = RNG.standard_normal(np.shape(want_sum))
    tape.backward(s, grad=G)
    dx = np.broadcast_to(
        np.expand_dims(G, axis)
        if axis is not None and not keepdims
        else np.reshape(G, (1,) * 3 if axis is None else G.shape),
        X.shape,
    )
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-6)


def test_sum_is_pairwise_accurate_and_reproducible(device):
    """2^20 float32 values: a sequential float32 sum drifts by ~1e-4 relative; pairwise
    summation stays within a few ulps of the float64 sum, with the same bits every run."""
    values = RNG.uniform(0.0, 1.0, 2**20).astype(np.float32)
    exact = values.astype(np.float64).sum()
    sequential = np.cumsum(values, dtype=np.float32)[-1]  # what one accumulator per thread gives
    assert abs(sequential - exact) / exact > 1e-5  # the test below can tell the two apart
    x = _t(device, values, grad=False)
    first = ops.sum(x).numpy()[()]
    assert abs(first - exact) / exact < 1e-6
    assert all(ops.sum(x).numpy()[()] == first for _ in range(3))


def test_reduction_errors(device):
    x = _t(device, np.ones((2, 3)))
    with pytest.raises(
        ValueError, match=r"sum: axis=2 is out of range for a tensor of shape \(2, 3\)"
    ):
        ops.sum(x, axis=2)
    with pytest.raises(
        ValueError, match=r"softmax: axis=2 is out of range for a tensor of shape \(2, 3\)"
    ):
        ops.softmax(x, axis=2)  # any axis in range is supported (tests/test_ops_attention.py)


def _softmax(Z):
    P = np.exp(Z - Z.max(-1, keepdims=True))
    return P / P.sum(-1, keepdims=True)


def test_softmax_and_log_softmax_backward(device):
    Z = RNG.standard_normal((2, 3, 5))
    G = RNG.standard_normal((2, 3, 5))
    P = _softmax(Z)
    for op, fwd, bwd in [
        (ops.softmax, P, P * (G - (G * P).sum(-1, keepdims=True))),
        (ops.log_softmax, np.log(P), G - P * G.sum(-1, keepdims=True)),
    ]:
        z = _t(device, Z)
        with pydiff.Tape() as tape:
            y = op(z)
        np.testing.assert_allclose(y.numpy(), fwd, rtol=1e-5, atol=1e-6)
        tape.backward(y, grad=G)
        np.testing.assert_allclose(z.grad.numpy(), bwd, rtol=1e-4, atol=1e-5)
        assert pydiff.gradcheck(op, (_t(device, Z[0]),))
    # +-1e4 logits: exact one-hot probabilities, finite log-probabilities and gradients
    z = _t(device, [[1e4, -1e4, 0.0]])
    with pydiff.Tape() as tape:
        y = ops.log_softmax(z)
    tape.backward(y, grad=np.ones((1, 3)))
    np.testing.assert_allclose(y.numpy(), [[0.0, -2e4, -1e4]], rtol=1e-6)
    np.testing.assert_allclose(z.grad.numpy(), [[-2.0, 1.0, 1.0]], atol=1e-6)
    np.testing.assert_allclose(
        ops.softmax(_t(device, [[1e4, -1e4, 0.0]])).numpy(), [[1.0, 0.0, 0.0]]
    )


def test_cross_entropy_backward_closed_form(device):
    Z, labels = RNG.standard_normal((4, 6)), np.array([5, 0, 2, 2])
    z = _t(device, Z)
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(z, labels)
    tape.backward(loss, grad=np.array([3.0]))
    np.testing.assert_allclose(
        z.grad.numpy(), 3.0 * (_softmax(Z) - np.eye(6)[labels]) / 4, rtol=1e-5, atol=1e-6
    )


def test_layer_norm(device):
    X, W, B = RNG.standard_normal((2, 3, 6)), RNG.uniform(0.5, 1.5, 6), RNG.standard_normal(6)
    mu, var = X.mean(-1, keepdims=True), X.var(-1, keepdims=True)
    xh = (X - mu) / np.sqrt(var + 1e-5)
    x, w, b = _t(device, X), _t(device, W), _t(device, B)
    with pydiff.Tape() as tape:
        y = ops.layer_norm(x, w, b)
    np.testing.assert_allclose(y.numpy(), xh * W + B, rtol=1e-4, atol=1e-5)
    G = RNG.standard_normal(X.shape)
    tape.backward(y, grad=G)
    gh = G * W
    dx = (gh - gh.mean(-1, keepdims=True) - xh * (gh * xh).mean(-1, keepdims=True)) / np.sqrt(
        var + 1e-5
    )
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w.grad.numpy(), (G * xh).sum((0, 1)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(b.grad.numpy(), G.sum((0, 1)), rtol=1e-5, atol=1e-5)
    assert pydiff.gradcheck(ops.layer_norm, (_t(device, X[0]), _t(device, W), _t(device, B)))
    assert pydiff.gradcheck(lambda x: ops.layer_norm(x, eps=1e-3), (_t(device, X[0]),))
    const = ops.layer_norm(_t(device, np.full((2, 4), 7.0)))
    np.testing.assert_array_equal(const.numpy(), np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"layer_norm: bias must have shape \(6,\), got \(5,\)"):
        ops.layer_norm(x, w, _t(device, np.ones(5)))


def test_silu_and_mul_matches_the_seed_formulas(device):
    X = RNG.standard_normal((3, 8))
    gate, up = X[:, :4], X[:, 4:]
    sig = 1 / (1 + np.exp(-gate))
    x = _t(device, X)
    with pydiff.Tape() as tape:
        y = ops.silu_and_mul(x)
    np.testing.assert_allclose(y.numpy(), gate * sig * up, rtol=1e-5, atol=1e-6)
    G = RNG.standard_normal((3, 4))
    tape.backward(y, grad=G)
    want = np.concatenate([G * up * sig * (1 + gate * (1 - sig)), G * gate * sig], axis=-1)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    assert pydiff.gradcheck(ops.silu_and_mul, (_t(device, X[:2]),))
    with pytest.raises(
        ValueError, match=r"silu_and_mul: the last dimension of \(2, 3\) must be even"
    ):
        ops.silu_and_mul(_t(device, np.ones((2, 3))))


def test_attention_forward_backward(device):
    n, m, d, e = 4, 5, 3, 2
    Q, K, V = RNG.standard_normal((n, d)), RNG.standard_normal((m, d)), RNG.standard_normal((m, e))
    for scale in (None, 1.0):
        s = 1 / np.sqrt(d) if scale is None else scale
        P = _softmax(s * Q @ K.T)
        q, k, v = _t(device, Q), _t(device, K), _t(device, V)
        with pydiff.Tape() as tape:
            out = ops.attention(q, k, v, scale=scale)
        np.testing.assert_allclose(out.numpy(), P @ V, rtol=1e-5, atol=1e-6)
        G = RNG.standard_normal((n, e))
        tape.backward(out, grad=G)
        dP = G @ V.T
        dS = s * P * (dP - (dP * P).sum(-1, keepdims=True))
        np.testing.assert_allclose(v.grad.numpy(), P.T @ G, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(q.grad.numpy(), dS @ K, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(k.grad.numpy(), dS.T @ Q, rtol=1e-4, atol=1e-5)
    assert pydiff.gradcheck(ops.attention, (_t(device, Q), _t(device, K), _t(device, V)))
    with pytest.raises(
        ValueError, match=r"attention: k \(5, 3\) and v \(4, 2\) must have the same number of rows"
    ):
        ops.attention(q, k, _t(device, V[:4]))


@pytest.mark.parametrize(
    "m,k,n",
    # then: row blocks in runs of 8 (B shared through subgroup shuffles, SHUF), and dx read
    # from a gradient of 10 columns (A shared, SHUF_A)
    [(16, 8, 12), (8, 12, 10), (12, 4, 16), (10, 16, 32), (7, 20, 8)]
    + [(64, 32, 16), (128, 12, 24), (512, 8, 32), (32, 64, 10)]
    # then: steps of k taken 4, 2 or 1 at a time (matmul.slang's KU: dW sums 9, 6, 1 rows,
    # dx 6 or 1 columns), 1 row, 1 column, 4 features, and long sums (K = 1024 both ways)
    + [(9, 8, 12), (6, 12, 6), (1, 4, 8), (8, 4, 1), (16, 1024, 8), (1024, 8, 16)]
    # then: dW of fewer than 16 rows shared by shuffles (SHUF_A in mm_tn), 6 and 13 of them
    + [(24, 128, 6), (16, 64, 13)],
)
def test_fast_product_kernels_match_numpy(device, m, k, n):
    """Shapes that take the specialised float4 kernels (every backend): forward with bias,
    and both gradients, against NumPy."""
    X, W, B = RNG.standard_normal((m, k)), RNG.standard_normal((n, k)), RNG.standard_normal(n)
    x, w, b = _t(device, X), _t(device, W), _t(device, B)
    with pydiff.Tape() as tape:
        y = ops.linear(x, w, b)
    # float32 sums of k (forward) or n (dx) products: rounding grows like their square root
    np.testing.assert_allclose(
        y.numpy(), X @ W.T + B, rtol=1e-5, atol=1e-5 * np.sqrt(max(k, 16) / 16)
    )
    G = RNG.standard_normal((m, n))
    tape.backward(y, grad=G)
    np.testing.assert_allclose(
        x.grad.numpy(), G @ W, rtol=1e-5, atol=1e-5 * np.sqrt(max(n, 16) / 16)
    )
    scale = np.sqrt(m)  # float32 sums over the m rows: rounding grows like sqrt(m)
    np.testing.assert_allclose(w.grad.numpy(), G.T @ X, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(b.grad.numpy(), G.sum(0), rtol=1e-5, atol=1e-5 * scale)
    A2 = RNG.standard_normal((k, n))
    np.testing.assert_allclose(
        ops.matmul(_t(device, X), _t(device, A2)).numpy(),
        X @ A2,
        rtol=1e-5,
        atol=1e-5 * np.sqrt(max(k, 16) / 16),
    )
    from pydiff.tensor import float4_ready

    assert float4_ready(x, w, y)  # the fast path was eligible (every backend), so it ran


@pytest.mark.parametrize(
    "batch, n_in, n_out, activation, bias, x_grad",
    [
        (256, 64, 10, None, True, True),  # the MLP step's head
        (64, 64, 10, "relu", True, True),  # g masked by the relu
        (37, 128, 3, None, False, True),  # no bias; rows not a multiple of anything
        (5, 64, 16, "relu", True, False),  # x without a gradient: dW and db only
        (1, 192, 1, None, True, True),  # one row, one output
    ],
)
def test_narrow_linear_backward_matches_the_two_products(
    device, monkeypatch, batch, n_in, n_out, activation, bias, x_grad
):
    """A linear layer of at most 16 outputs takes its backward in one kernel
    (products.linear_backward_narrow): the same bits as the two product kernels, and NumPy."""
    import pydiff.products as products

    X, W = RNG.standard_normal((batch, n_in)), RNG.standard_normal((n_out, n_in))
    B, G = RNG.standard_normal(n_out), RNG.standard_normal((batch, n_out))
    grads = []
    for narrow in (products.NARROW_MAX_OUTPUTS, 0):
        monkeypatch.setattr(products, "NARROW_MAX_OUTPUTS", narrow)
        x, w, b = _t(device, X, grad=x_grad), _t(device, W), _t(device, B) if bias else None
        with pydiff.Tape() as tape:
            y = ops.linear(x, w, b, activation=activation)
        tape.backward(y, grad=G)
        grads.append([t.grad.numpy() for t in (x, w, b) if t is not None and t.requires_grad])
        if narrow and not device.kernels.gpu:  # the one-kernel backward ran (lavapipe only)
            assert any(key[1] == "linear_bwd_narrow" for key in device.kernels._kernels)
    for narrow_grad, product_grad in zip(*grads):
        assert narrow_grad.tobytes() == product_grad.tobytes()
    x32, w32, b32 = (v.astype(np.float32).astype(np.float64) for v in (X, W, B))
    z = x32 @ w32.T + (b32 if bias else 0.0)
    gz = G.astype(np.float32).astype(np.float64) * (z > 0 if activation else 1.0)
    expected = ([gz @ w32] if x_grad else []) + [gz.T @ x32] + ([gz.sum(0)] if bias else [])
    scale = np.sqrt(batch)
    for got, want in zip(grads[0], expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("size", [1, 3, 17, 64, 4099, 70001])
def test_relu_float4_kernels_cover_every_element(device, size):
    """relu4 / relu_bwd_acc4 run several float4s per thread (products.ELEMENTWISE_CHUNK): every
    element, the partial last chunk's included, matches NumPy exactly."""
    X = RNG.standard_normal(size).astype(np.float32)
    X[::7] = 0.0  # the subgradient at 0 is 0
    G = RNG.standard_normal(size).astype(np.float32)
    x = _t(device, X)
    with pydiff.Tape() as tape:
        y = ops.relu(x)
    tape.backward(y, grad=G)
    np.testing.assert_array_equal(y.numpy(), np.maximum(X, 0))
    np.testing.assert_array_equal(x.grad.numpy(), np.where(X > 0, G, 0))


def test_label_tensors_are_checked_again_after_a_write(device):
    logits = _t(device, RNG.standard_normal((3, 4)))
    labels = pydiff.tensor(np.array([0, 1, 3], np.int32), device=device)
    ops.cross_entropy(logits, labels)
    ops.cross_entropy(logits, labels)  # unchanged: no host read
    labels.copy_from_numpy(np.array([0, 4, 1], np.int32))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\), got 0\.\.4"):
        ops.cross_entropy(logits, labels)


def test_reductions_follow_numpy_shapes_with_0d_results(device):
    x = _t(device, np.arange(5.0))
    assert ops.sum(x, axis=0).shape == np.sum(np.arange(5.0), axis=0).shape == ()
    assert ops.sum(x, axis=-1).numpy()[()] == 10.0
    assert ops.sum(_t(device, np.ones((2, 3, 4))), keepdims=True).shape == (1, 1, 1)
    assert pydiff.gradcheck(lambda v: ops.mean(v, axis=0), (_t(device, [1.0, -2.0, 0.5]),))


def test_linear_without_bias_and_an_untyped_gradient_buffer(device):
    """The in-place backward does not fit (a gradient buffer SlangPy allocated): the general
    path runs, for linear without a bias too."""
    import slangpy as spy

    X, W, G = RNG.standard_normal((4, 4)), RNG.standard_normal((4, 4)), RNG.standard_normal((4, 4))
    g = pydiff.Tensor(spy.Tensor.zeros(device.native, (4, 4), "float"), device)
    x = _t(device, X, grad=False).with_grads(grad_in=g, grad_out=g)
    w = _t(device, W)
    with pydiff.Tape() as tape:
        y = ops.linear(x, w)
    tape.backward(y, grad=G)
    np.testing.assert_allclose(x.grad.numpy(), G @ W, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), G.T @ X, rtol=1e-5, atol=1e-5)


def test_ops_refuse_non_float_tensors_and_fractional_labels(device):
    ints = pydiff.tensor(np.arange(3, dtype=np.int32), device=device)
    with pytest.raises(ValueError, match=r"relu: x has dtype int"):
        ops.relu(ints)
    with pytest.raises(ValueError, match=r"mean: x has dtype int"):
        ops.mean(ints)
    with pytest.raises(ValueError, match=r"labels must be integer class indices"):
        ops.cross_entropy(_t(device, np.ones((2, 3))), np.array([0.5, 1.0]))


def test_cross_entropy_large_batch_matches_numpy_bit_for_bit_across_runs(device):
    """More rows than the forward kernel's 256 threads: each thread sums several rows."""
    Z, L = RNG.standard_normal((1000, 7)) * 5, RNG.integers(0, 7, 1000)
    P = np.exp(Z - Z.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    losses = []
    for _ in range(3):
        z = _t(device, Z)
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(z, L)
        tape.backward(loss, grad=np.array([2.0]))
        losses.append(loss.numpy().tobytes())
    np.testing.assert_allclose(loss.numpy(), [-np.mean(np.log(P[np.arange(1000), L]))], rtol=1e-6)
    np.testing.assert_allclose(z.grad.numpy(), 2 * (P - np.eye(7)[L]) / 1000, rtol=1e-4, atol=1e-7)
    assert len(set(losses)) == 1


@pytest.mark.parametrize(
    "batch, classes",
    # a row held in registers (up to 32 classes) or read in loops (33, 40); one row; more rows
    # than the forward's small group takes (its 256-thread group, 2049 and up)
    [(1, 3), (256, 10), (37, 32), (64, 33), (5, 40), (3000, 12)],
)
def test_cross_entropy_kernels_match_float64(device, batch, classes):
    Z, L = RNG.standard_normal((batch, classes)) * 4, RNG.integers(0, classes, batch)
    Z64 = Z.astype(np.float32).astype(np.float64)
    P = np.exp(Z64 - Z64.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    results = []
    for _ in range(2):
        z = _t(device, Z)
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(z, L)
        tape.backward(loss, grad=np.array([0.5]))
        results.append((loss.numpy().tobytes(), z.grad.numpy().tobytes()))
    expected = -np.mean(np.log(P[np.arange(batch), L]))
    np.testing.assert_allclose(loss.numpy(), [expected], rtol=2e-6, atol=1e-7)
    dz = 0.5 * (P - np.eye(classes)[L]) / batch
    # p - 1 near p = 1 keeps float32's absolute error of p (a few ulp of 1), scaled by 0.5 / batch
    np.testing.assert_allclose(z.grad.numpy(), dz, rtol=1e-4, atol=4 * 2.0**-24 / batch)
    assert results[0] == results[1]  # bitwise the same run to run


@pytest.mark.parametrize(
    "batch, n_in, n_out, bias",
    [
        (256, 64, 64, True),  # fast kernels: relu in the product, the mask in dx/dW, db fused
        (32, 16, 12, False),
        (64, 64, 10, True),  # dx through the mask with A shared by shuffles (SHUF_A)
        (6, 5, 3, True),  # K % 4 != 0: SlangPy products, relu and mask as separate steps
        (4104, 8, 4, True),  # more rows than the fused bias sum takes: mask applied first
    ],
)
def test_linear_relu_fused_matches_numpy(device, batch, n_in, n_out, bias):
    X = RNG.standard_normal((batch, n_in))
    W = RNG.standard_normal((n_out, n_in))
    b = RNG.standard_normal(n_out) if bias else np.zeros(n_out)
    G = RNG.standard_normal((batch, n_out))
    x, w = _t(device, X), _t(device, W)
    bb = _t(device, b) if bias else None
    with pydiff.Tape() as tape:
        y = ops.linear(x, w, bb, activation="relu")
    tape.backward(y, grad=G)
    x32, w32, b32 = (v.astype(np.float32).astype(np.float64) for v in (X, W, b))
    z = x32 @ w32.T + b32
    gz = np.where(z > 0, G.astype(np.float32), 0.0)
    scale = np.sqrt(batch)
    np.testing.assert_allclose(y.numpy(), np.maximum(z, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), gz @ w32, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), gz.T @ x32, rtol=1e-5, atol=1e-5 * scale)
    if bias:
        np.testing.assert_allclose(bb.grad.numpy(), gz.sum(0), rtol=1e-5, atol=1e-5 * scale)


def test_linear_relu_gradcheck_and_bad_activation(device):
    X, W, b = RNG.standard_normal((4, 3)), RNG.standard_normal((2, 3)), RNG.standard_normal(2)
    assert pydiff.gradcheck(
        lambda x, w, b: ops.linear(x, w, b, activation="relu"),
        (_t(device, X), _t(device, W), _t(device, b)),
    )
    with pytest.raises(ValueError, match=r"linear: activation='tanh'"):
        ops.linear(_t(device, X), _t(device, W), activation="tanh")
    with pytest.raises(ValueError, match=r"Linear: activation='gelu'"):
        pydiff.nn.Linear(3, 2, activation="gelu")
    layer = pydiff.nn.Linear(3, 2, seed=0, activation="relu", device=device)
    expected = np.maximum(X.astype(np.float32) @ layer.weight.numpy().T + layer.bias.numpy(), 0)
    np.testing.assert_allclose(
        layer(_t(device, X, grad=False)).numpy(), expected, rtol=1e-5, atol=1e-6
    )


def test_cross_entropy_of_one_class_compiles_without_a_slang_warning(device):
    """C = 1 (a loss of 0, gradient 0): its forward kernel's loop from 1 to C made Slang print
    "warning[E30514]: loop runs zero times" on the user's console. Compiled afresh (no cache)
    in a child process, whose output is checked."""
    import os
    import subprocess
    import sys

    if device.type != "vulkan":
        pytest.skip("the compile is the same on every backend; checked once")
    code = (
        "import numpy as np, pydiff; from pydiff import ops; "
        "z = pydiff.tensor(np.array([[0.5], [-2.0], [3.0]], np.float32), requires_grad=True); "
        "y = pydiff.tensor(np.zeros(3, np.int32)); "
        "print('loss', ops.cross_entropy(z, y).item())"
    )
    env = {**os.environ, "PYDIFF_CACHE": "0", "PYDIFF_DEVICE_TYPES": "vulkan"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loss 0.0" in out.stdout
    assert "warning" not in (out.stdout + out.stderr).lower(), out.stdout + out.stderr
