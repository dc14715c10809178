"""ops.attention at full shape (batches of heads, the causal mask, T != S) and ops.softmax /
log_softmax over any axis, against NumPy float64 closed forms and PyTorch's float64 autograd
(scaled_dot_product_attention, softmax), with gradcheck over composed functions."""

import numpy as np
import pytest

import pydiff
from pydiff import ops

RNG = np.random.default_rng(18)


def _t(device, data, grad=True):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, requires_grad=grad)


def _f64(a):
    """The float32 value as float64: references see exactly the inputs pydiff sees."""
    return np.asarray(a, np.float32).astype(np.float64)


def attention_ref(Q, K, V, G, causal, scale):
    """Output and (dQ, dK, dV) of softmax(scale Q K^T + mask) V in float64, closed form."""
    S = scale * Q @ np.swapaxes(K, -1, -2)
    if causal:
        T, N = S.shape[-2:]
        S = np.where(np.arange(N)[None, :] > np.arange(T)[:, None], -np.inf, S)
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    dP = G @ np.swapaxes(V, -1, -2)
    dS = scale * P * (dP - (dP * P).sum(-1, keepdims=True))
    swap = lambda a: np.swapaxes(a, -1, -2)  # noqa: E731
    return P @ V, (dS @ K, swap(dS) @ Q, swap(P) @ G)


CASES = [  # batch dims, T, S, D, E
    ((2, 3), 5, 5, 4, 4),
    ((2, 3), 3, 6, 4, 2),  # fewer queries than keys
    ((1, 2), 6, 3, 2, 3),  # more queries than keys
    ((2, 1), 1, 4, 3, 2),  # T = 1
    ((3,), 4, 4, 1, 1),  # D = E = 1, one batch dimension
    ((), 5, 7, 3, 2),  # the 2-D form
    ((1, 1), 1, 1, 1, 1),
]


def _run(device, batch, T, S, D, E, causal, scale, scale_q=1.0):
    Q = _f64(scale_q * RNG.standard_normal(batch + (T, D)))
    K, V = _f64(RNG.standard_normal(batch + (S, D))), _f64(RNG.standard_normal(batch + (S, E)))
    G = _f64(RNG.standard_normal(batch + (T, E)))
    q, k, v = _t(device, Q), _t(device, K), _t(device, V)
    with pydiff.Tape() as tape:
        out = ops.attention(q, k, v, causal=causal, scale=scale)
    tape.backward(out, grad=G.astype(np.float32))
    return (Q, K, V, G), out.numpy(), (q.grad.numpy(), k.grad.numpy(), v.grad.numpy())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0] + c[1:])))
def test_attention_against_float64_closed_form(device, case, causal):
    batch, T, S, D, E = case
    for scale in (None, 0.7):
        (Q, K, V, G), out, grads = _run(device, batch, T, S, D, E, causal, scale)
        s = 1 / np.sqrt(D) if scale is None else scale
        want, want_grads = attention_ref(Q, K, V, G, causal, s)
        assert out.shape == batch + (T, E)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        for got, ref, name in zip(grads, want_grads, "qkv"):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_against_torch_sdpa(device, causal):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    for batch, T, S, D, E in CASES:
        (Q, K, V, G), out, grads = _run(device, batch, T, S, D, E, causal, None)
        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (Q, K, V))
        to = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        to.backward(torch.tensor(G))
        np.testing.assert_allclose(out, to.detach().numpy(), rtol=1e-5, atol=1e-6)
        for got, ref in zip(grads, (tq.grad, tk.grad, tv.grad)):
            np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_stable_for_large_logits(device, causal):
    # scores of about 1e6 (scale 1): one-hot probabilities, no inf or NaN anywhere
    (Q, K, V, G), out, grads = _run(device, (2, 2), 4, 5, 3, 2, causal, 1.0, scale_q=1e6)
    want, want_grads = attention_ref(Q, K, V, G, causal, 1.0)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    for got, ref in zip(grads, want_grads):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_attention_gradcheck_batched_and_causal(device):
    q, k, v = (
        _t(device, RNG.standard_normal(s)) for s in ((2, 2, 3, 2), (2, 2, 4, 2), (2, 2, 4, 3))
    )
    assert pydiff.gradcheck(lambda q, k, v: ops.attention(q, k, v, causal=True), (q, k, v))
    # composed: a softmax over the heads axis after the attention
    assert pydiff.gradcheck(
        lambda q, k, v: ops.log_softmax(ops.attention(q, k, v), axis=1), (q, k, v)
    )


def test_attention_refuses_bad_shapes_and_arguments(device):
    f = lambda *s: _t(device, np.ones(s))  # noqa: E731
    with pytest.raises(ValueError, match=r"must have the same leading \(batch, head\) dim"):
        ops.attention(f(2, 3, 4, 2), f(2, 2, 4, 2), f(2, 2, 4, 2))
    with pytest.raises(ValueError, match=r"attention: q \(2, 4, 3\) and k \(2, 4, 2\) must have"):
        ops.attention(f(2, 4, 3), f(2, 4, 2), f(2, 4, 2))
    with pytest.raises(ValueError, match=r"attention: k \(2, 4, 2\) and v \(2, 3, 2\) must"):
        ops.attention(f(2, 4, 2), f(2, 4, 2), f(2, 3, 2))
    with pytest.raises(ValueError, match=r"attention: q must be a float tensor of 2 or more"):
        ops.attention(f(4), f(4, 2), f(4, 2))
    with pytest.raises(TypeError, match=r"attention: causal must be True or False, got 1"):
        ops.attention(f(2, 2), f(2, 2), f(2, 2), causal=1)
    with pytest.raises(TypeError, match=r"attention: scale must be a number or None"):
        ops.attention(f(2, 2), f(2, 2), f(2, 2), scale="1")


# ---------------------------------------------------------------- softmax over any axis


def _softmax_ref(Z, axis):
    m = Z.max(axis, keepdims=True)
    e = np.exp(Z - m)
    tot = e.sum(axis, keepdims=True)
    return e / tot, (Z - m) - np.log(tot)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
@pytest.mark.parametrize("magnitude", [1.0, 1e30])
def test_softmax_over_any_axis(device, axis, magnitude):
    Z = _f64(magnitude * RNG.standard_normal((3, 4, 5)))
    G = _f64(RNG.standard_normal(Z.shape))
    P, Y = _softmax_ref(Z, axis)
    for op, want, dz in (
        (ops.softmax, P, P * (G - (G * P).sum(axis, keepdims=True))),
        (ops.log_softmax, Y, G - P * G.sum(axis, keepdims=True)),
    ):
        z = _t(device, Z)
        with pydiff.Tape() as tape:
            y = op(z, axis=axis)
        tape.backward(y, grad=G.astype(np.float32))
        got = y.numpy()
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(z.grad.numpy(), dz, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("axis", [0, 1])
def test_softmax_over_an_axis_against_torch(device, axis):
    torch = pytest.importorskip("torch")
    Z, G = _f64(RNG.standard_normal((4, 3, 2))), _f64(RNG.standard_normal((4, 3, 2)))
    for op, top in ((ops.softmax, torch.softmax), (ops.log_softmax, torch.log_softmax)):
        z = _t(device, Z)
        with pydiff.Tape() as tape:
            y = op(z, axis=axis)
        tape.backward(y, grad=G.astype(np.float32))
        tz = torch.tensor(Z, requires_grad=True)
        ty = top(tz, dim=axis)
        ty.backward(torch.tensor(G))
        np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(z.grad.numpy(), tz.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_softmax_axis_edges(device):
    # ties of 1e30 split evenly; -inf entries give 0; a one-element axis gives 1 (log 0)
    z = _t(device, [[1e30, 1e30], [-np.inf, 2.0], [5.0, 1e30]], grad=False)
    np.testing.assert_allclose(ops.softmax(z, axis=0).numpy(), [[1, 0.5], [0, 0], [0, 0.5]])
    np.testing.assert_allclose(ops.softmax(z, axis=1).numpy(), [[0.5, 0.5], [0, 1], [0, 1]])
    one = _t(device, RNG.standard_normal((1, 3)), grad=False)
    np.testing.assert_array_equal(ops.softmax(one, axis=0).numpy(), np.ones((1, 3)))
    np.testing.assert_array_equal(ops.log_softmax(one, axis=0).numpy(), np.zeros((1, 3)))
    x = _t(device, RNG.standard_normal((2, 3, 2)))
    assert pydiff.gradcheck(lambda x: ops.softmax(x, axis=1), (x,))
    assert pydiff.gradcheck(lambda x: ops.log_softmax(x, axis=0), (x,))
    with pytest.raises(ValueError, match=r"softmax: axis=3 is out of range for a tensor of shape"):
        ops.softmax(x, axis=3)
    with pytest.raises(TypeError, match=r"log_softmax: axis must be an int, got float"):
        ops.log_softmax(x, axis=1.0)
