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
    "silu": (lambda x: x / (1 + np.exp(-x)), lambda x: 1 / (1 + np.exp(-x)) * (1 + x * (1 - 1 / (1 + np.exp(-x))))),
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
        np.testing.assert_allclose(getattr(ops, name)(_t(device, xs), _t(device, ys)).numpy(), ref, rtol=1e-6)
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
    np.testing.assert_allclose(ops.linear(_t(device, X), _t(device, W), _t(device, bb)).numpy(), X @ W.T + bb, rtol=1e-5, atol=1e-5)
    assert pydiff.gradcheck(ops.linear, (_t(device, X[:3]), _t(device, W), _t(device, bb)))
    assert pydiff.gradcheck(ops.linear, (_t(device, X[:3]), _t(device, W)))


def test_reductions_and_losses(device):
    X = RNG.standard_normal((3, 4))
    np.testing.assert_allclose(ops.sum(_t(device, X)).numpy(), [X.sum()], rtol=1e-5)
    np.testing.assert_allclose(ops.mean(_t(device, X)).numpy(), [X.mean()], rtol=1e-5, atol=1e-7)
    assert pydiff.gradcheck(ops.mean, (_t(device, X),))
    T = RNG.standard_normal((3, 4))
    np.testing.assert_allclose(ops.mse_loss(_t(device, X), _t(device, T)).numpy(), [np.mean((X - T) ** 2)], rtol=1e-5)
    assert pydiff.gradcheck(ops.mse_loss, (_t(device, X), _t(device, T, grad=False)))
    labels = np.array([0, 3, 1])
    Z = RNG.standard_normal((3, 4))
    P = np.exp(Z - Z.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    np.testing.assert_allclose(ops.cross_entropy(_t(device, Z), labels).numpy(), [-np.mean(np.log(P[np.arange(3), labels]))], rtol=1e-5)
    assert pydiff.gradcheck(lambda z: ops.cross_entropy(z, labels), (_t(device, Z),))
    np.testing.assert_allclose(ops.softmax(_t(device, Z)).numpy(), P, rtol=1e-5)


def test_shape_errors(device):
    with pytest.raises(ValueError, match=r"matmul: inner dimensions differ: a is \(2, 3\), b is \(2, 3\)"):
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
    finally:
        pydiff.set_default_device(None)
    assert losses[-1] < losses[0] / 2
    assert acc >= 0.85, f"{name}: test accuracy {acc:.3f}"


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
