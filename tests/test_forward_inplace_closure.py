"""Transforms and in-place writes, closures and pass-through outputs (fixes of breaker 18's
forward-mode cases, beyond its own tests): references are closed forms and torch float64."""

import numpy as np
import pytest
import torch

import pydiff
from pydiff import ops


def T(a, device, **kw):
    return pydiff.tensor(np.asarray(a, np.float32), device=device, **kw)


def test_no_transform_touches_a_closure_grad(device):
    W = T(np.random.default_rng(0).standard_normal((2, 3)), device, requires_grad=True)
    x = T([[0.5, 1.0, -0.3]], device)
    f = lambda x: ops.tanh(ops.linear(x, W))  # noqa: E731
    pydiff.vjp(f, (x,), np.ones((1, 2)))
    pydiff.hessian(lambda x: ops.sum(f(x)), (x,))
    pydiff.jacrev(f)(x)
    np.testing.assert_array_equal(W.grad.numpy(), 0.0)
    with pydiff.Tape() as tape:  # an ordinary tape still gives W its gradient
        y = ops.sum(f(x))
    tape.backward(y)
    Wt = torch.tensor(W.numpy().astype(np.float64), requires_grad=True)
    torch.tanh(torch.tensor(x.numpy().astype(np.float64)) @ Wt.T).sum().backward()
    np.testing.assert_allclose(W.grad.numpy(), Wt.grad.numpy(), rtol=1e-5)


def test_copy_in_place_forward_and_reverse(device):
    a = T([0.5, 1.0, -0.3], device)

    def f(a):
        y = a * 2.0
        v = y.reshape(3, 1)  # a view made before the copy follows it
        y.copy_(a * 3.0)
        return v

    _, t = pydiff.jvp(f, (a,), (np.array([1.0, 2.0, 3.0]),))
    np.testing.assert_allclose(t.numpy().ravel(), [3.0, 6.0, 9.0])
    with pytest.raises(RuntimeError, match="copy_"):
        pydiff.jacrev(f)(a)
    with pytest.raises(RuntimeError, match="copy_"):
        pydiff.grad(lambda a: ops.sum(f(a)))(a)

    def g(a):  # copied into a tensor no recorded call wrote
        y = pydiff.zeros((3,), device=a.device)
        y.copy_(a * 3.0)
        return y

    with pytest.raises(RuntimeError, match="copy_"):
        pydiff.jacrev(g)(a)

    b = T([0.5, 1.0, -0.3], device, requires_grad=True)
    with pydiff.Tape():
        y = b * 2.0
        y.copy_(b * 3.0)
        with pytest.raises(RuntimeError, match="copy_"):  # refused where a call reads it
            y * 1.0


def test_fill_in_place_cuts_forward_and_reverse(device):
    a = T([0.5, 1.0, -0.3], device)

    def f(a):
        y = a * 2.0
        v = y.reshape(3, 1)
        y.fill(1.0)
        return v * a.reshape(3, 1)  # d/da = 1 (y is the constant 1)

    want = np.eye(3).reshape(3, 1, 3)
    np.testing.assert_array_equal(pydiff.jacfwd(f)(a), want)
    np.testing.assert_array_equal(pydiff.jacrev(f)(a), want)
    b = T([0.5, 1.0, -0.3], device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = b * 2.0
    y.fill(0.0)
    with pytest.raises(RuntimeError, match="overwritten by a host write"):
        tape.backward(y, grad=np.ones(3))


def test_vjp_floats_none_and_passthrough(device):
    m = pydiff.load_module_from_source(
        "fw18_scale", "[Differentiable] float sc(float x, float s) { return x*x*s; }", device=device
    )
    X = np.array([0.5, 1.0, -0.3])
    a = T(X, device)
    _, (gx, gs) = pydiff.vjp(m.sc, (a, 2.0), np.ones(3))
    np.testing.assert_allclose(gx.numpy(), 4 * X, rtol=1e-6)
    assert isinstance(gs, float) and gs == pytest.approx((X**2).sum(), rel=1e-6)
    _, (_, gv) = pydiff.vjp(lambda a, s: ops.exp(a) * s, (a, np.array([2.0, 3.0, 4.0])), np.ones(3))
    np.testing.assert_allclose(gv, np.exp(X), rtol=1e-6)
    _, (g,) = pydiff.vjp(ops.exp, (a,), None)
    np.testing.assert_array_equal(g.numpy(), 0.0)
    _, (g, _) = pydiff.vjp(lambda a, k: a.reshape(3, 1), (a, 3), np.array([[1.0], [2.0], [3.0]]))
    np.testing.assert_array_equal(g.numpy(), [1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="primals"):
        pydiff.vjp(ops.exp, a, np.ones(3))


def test_same_tensor_twice_in_hvp_and_jacrev(device):
    X = np.array([0.5, 1.0, -0.3])
    a = T(X, device)
    f = lambda p, q: ops.sum(p * p * q)  # noqa: E731
    hp, hq = pydiff.hvp(f, (a, a), (np.ones(3), np.zeros(3)))
    np.testing.assert_allclose(hp.numpy(), 2 * X, rtol=1e-6)  # d2f/dp2 1 = 2q
    np.testing.assert_allclose(hq.numpy(), 2 * X, rtol=1e-6)  # d2f/dqdp 1 = 2p
    Ja, Jb = pydiff.jacrev(lambda p, q: p * q, argnums=(0, 1))(a, a)
    np.testing.assert_allclose(Ja, np.diag(X), rtol=1e-6)
    np.testing.assert_allclose(Jb, np.diag(X), rtol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1e25, 1e-25])
def test_layer_norm_affine_jvp_any_scale(device, scale):
    rng = np.random.default_rng(3)
    X = (rng.standard_normal((2, 4)) * scale).astype(np.float32)
    w, b = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    U, uw = rng.standard_normal((2, 4)) * scale, rng.standard_normal(4)
    _, t = pydiff.jvp(ops.layer_norm, (T(X, device), T(w, device), T(b, device)), (U, uw, None))
    _, want = torch.func.jvp(
        lambda x, w: torch.nn.functional.layer_norm(x, (4,), w, torch.tensor(np.float64(b))),
        (torch.tensor(np.float64(X)), torch.tensor(np.float64(w))),
        (torch.tensor(U), torch.tensor(uw)),
    )
    np.testing.assert_allclose(t.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
