"""Forward mode (fwds, jvp), vjp, hvp and hessian against closed forms, NumPy and finite
differences in float64."""

import numpy as np
import pytest
import slangpy as spy

import pydiff

RNG = np.random.default_rng(11)


def _t(device, data, dtype=None, grad=False):
    return pydiff.tensor(
        np.asarray(data, np.float32), dtype=dtype, device=device, requires_grad=grad
    )


def test_jvp_of_scalar_functions_matches_closed_forms(device, load):
    m = load("forward", device)
    xs = np.array([-1.3, 0.2, 0.9, 2.4])
    u = RNG.standard_normal(4)
    for fn, f, df in [(m.sine, np.sin, np.cos), (m.expo, np.exp, np.exp)]:
        y, dy = fn.fwds(_t(device, xs).with_tangent(u))
        np.testing.assert_allclose(y.numpy(), f(xs), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dy.numpy(), df(xs) * u, rtol=1e-5, atol=1e-6)
    # polynomial: tangents on x (tensor) and on a (a (value, tangent) pair) at once
    y, dy = m.poly.fwds((2.0, 0.5), 8.0, -1.0, _t(device, xs).with_tangent(u))
    np.testing.assert_allclose(y.numpy(), 2 * xs**2 + 8 * xs - 1, rtol=1e-5)
    np.testing.assert_allclose(dy.numpy(), (4 * xs + 8) * u + 0.5 * xs**2, rtol=1e-5, atol=1e-6)
    # all scalars: plain numbers back
    y, dy = m.poly.fwds(2.0, 8.0, -1.0, (3.0, 1.0))
    assert isinstance(dy, float) and dy == pytest.approx(4 * 3.0 + 8)


def test_jvp_equals_finite_difference_jacobian_times_u(device, load):
    m = load("forward", device)
    P = RNG.uniform(-1, 1, (6, 3))
    U = RNG.standard_normal((6, 3))
    _, dy = pydiff.jvp(m.twist, (_t(device, P, "float3"),), (U,))
    h = 1e-2
    for n in range(6):  # central-difference Jacobian of the shader itself, per point
        J = np.zeros((3, 3))
        for k in range(3):
            e = np.zeros((6, 3))
            e[n, k] = h
            plus = m.twist(_t(device, P + e, "float3"), _result="numpy")
            minus = m.twist(_t(device, P - e, "float3"), _result="numpy")
            J[:, k] = (plus[n].astype(np.float64) - minus[n]) / (2 * h)
        np.testing.assert_allclose(dy.numpy()[n], J @ U[n], rtol=2e-3, atol=2e-3)
    # and the closed form of the Jacobian
    x, y, z = P.T
    ju = np.stack(
        [
            U[:, 0] * y + x * U[:, 1],
            np.cos(z) * U[:, 2] + U[:, 0],
            0.5 * np.exp(0.5 * y) * z * U[:, 1] + np.exp(0.5 * y) * U[:, 2],
        ],
        1,
    )
    np.testing.assert_allclose(dy.numpy(), ju, rtol=1e-5, atol=1e-5)


def test_jvp_and_vjp_are_adjoint(device, load):
    m = load("forward", device)
    P, U, V = RNG.uniform(-1, 1, (5, 3)), RNG.standard_normal((5, 3)), RNG.standard_normal((5, 3))
    x = _t(device, P, "float3")
    y, ju = pydiff.jvp(m.twist, (x,), (U,))
    y2, (jtv,) = pydiff.vjp(m.twist, (x,), V)
    np.testing.assert_allclose(y.numpy(), y2.numpy())
    assert float(np.sum(ju.numpy() * V)) == pytest.approx(float(np.sum(U * jtv.numpy())), rel=1e-5)
    assert not x.requires_grad  # vjp used fresh gradient buffers


def test_out_and_inout_parameters_get_tangents(device, load):
    m = load("forward", device)
    xs = np.array([0.5, -2.0, 1.5])
    y = pydiff.zeros((3,), device=device)
    m.cube_out.fwds(_t(device, xs).with_tangent(np.ones(3)), y)
    np.testing.assert_allclose(y.numpy(), xs**3, rtol=1e-6)
    np.testing.assert_allclose(y.tangent.numpy(), 3 * xs**2, rtol=1e-6)
    v = _t(device, xs).with_tangent(np.ones(3))
    m.scale_inout.fwds((3.0, 1.0), v)  # v <- s v^2: dv = v^2 ds + 2 s v dv
    np.testing.assert_allclose(v.numpy(), 3 * xs**2, rtol=1e-6)
    np.testing.assert_allclose(v.tangent.numpy(), xs**2 + 6 * xs, rtol=1e-6)


def test_hvp_and_hessian_of_a_scalar_function_of_a_vector(device, load):
    m = load("forward", device)
    P, V = RNG.uniform(-1, 1, (4, 3)), RNG.standard_normal((4, 3))

    def hess(p):
        x, y, z = p
        return np.array([[-np.sin(x), z, y], [z, 0, x], [y, x, 0]])

    (hv,) = pydiff.hvp(m.energy, (_t(device, P, "float3"),), (V,))
    np.testing.assert_allclose(
        hv.numpy(), np.stack([hess(p) @ v for p, v in zip(P, V)]), rtol=1e-5, atol=1e-6
    )
    H = pydiff.hessian(m.energy, (_t(device, P[:1], "float3"),))  # x.shape + x.shape
    assert H.shape == (1, 3, 1, 3)
    np.testing.assert_allclose(H.reshape(3, 3), hess(P[0]), rtol=1e-5, atol=1e-6)
    # the sum over a vectorised call: block diagonal
    H2 = pydiff.hessian(m.energy, (_t(device, P[:2], "float3"),)).reshape(6, 6)
    np.testing.assert_allclose(H2[:3, 3:], 0.0)
    np.testing.assert_allclose(H2[3:, 3:], hess(P[1]), rtol=1e-5, atol=1e-6)


def test_laplacian_of_a_network_against_float64_finite_differences(device, load):
    m = load("forward", device)
    a, w0, w1, b = (RNG.standard_normal(8).astype(np.float32) for _ in range(4))
    pts = RNG.uniform(-1, 1, (16, 2))
    p = _t(device, pts, "float2")
    lap = np.zeros(16)
    for k in range(2):
        e = np.zeros((16, 2))
        e[:, k] = 1.0
        hv = pydiff.hvp(m.net, (p, a, w0, w1, b), (e, None, None, None, None))[0]
        lap += hv.numpy()[:, k]

    def u(q):  # the same network in float64
        return np.tanh(q[:, :1] * w0.astype(np.float64) + q[:, 1:] * w1 + b) @ a.astype(np.float64)

    h = 1e-3
    fd = sum(
        (u(pts + h * e) - 2 * u(pts) + u(pts - h * e)) / h**2
        for e in (np.array([1.0, 0]), np.array([0, 1.0]))
    )
    np.testing.assert_allclose(lap, fd, rtol=1e-4, atol=1e-4)


def test_hvp_leaves_fixed_tensors_that_require_grad_alone(device):
    """Fixed (None-direction) tensor arguments that require grad (the PINN sample's weights):
    no GradientFlowWarning from hvp's internal backward, their gradients untouched, and
    u''(x) against the closed form."""
    import warnings

    m = pydiff.load_module("samples/pinn_poisson.slang", device=device)
    a, w, b = (RNG.standard_normal(32).astype(np.float32) for _ in range(3))  # H = 32
    xs = np.linspace(0.05, 0.95, 5)
    fixed = [pydiff.tensor(v, device=device, requires_grad=True) for v in (a, w, b)]
    x = pydiff.tensor(xs.astype(np.float32), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got,) = pydiff.hvp(m.net, (x, *fixed), (np.ones(5), None, None, None))[:1]
    for t in fixed:
        np.testing.assert_array_equal(t.grad.numpy(), 0.0)
    a64, w64, b64 = (v.astype(np.float64) for v in (a, w, b))

    def u(q):  # x (1 - x) sum_j a_j tanh(w_j x + b_j), in float64
        return q * (1 - q) * (np.tanh(np.outer(q, w64) + b64) @ a64)

    h = 1e-3
    fd = (u(xs + h) - 2 * u(xs) + u(xs - h)) / h**2
    np.testing.assert_allclose(got.numpy(), fd, rtol=1e-3, atol=1e-3)


def test_tensor_parameters_in_forward_and_reverse_mode(device, load):
    m = load("forward", device)
    M, K = 4, 6
    W, dW, X, dX = (
        RNG.standard_normal((M, K)),
        RNG.standard_normal((M, K)),
        RNG.standard_normal(K),
        RNG.standard_normal(K),
    )
    w, x = _t(device, W, grad=True).with_tangent(dW), _t(device, X, grad=True).with_tangent(dX)
    y = pydiff.zeros((M,), device=device)
    m.dense_tanh.fwds(spy.grid((M,)), w, x, y)
    Z = W @ X
    np.testing.assert_allclose(y.numpy(), np.tanh(Z), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        y.tangent.numpy(), (1 - np.tanh(Z) ** 2) * (dW @ X + W @ dX), rtol=1e-4, atol=1e-5
    )
    G = RNG.standard_normal(M)
    with pydiff.Tape() as tape:
        y2 = pydiff.zeros((M,), device=device)
        m.dense_tanh(spy.grid((M,)), w, x, y2)
    tape.backward(y2, grad=G)
    gz = G * (1 - np.tanh(Z) ** 2)
    np.testing.assert_allclose(w.grad.numpy(), np.outer(gz, X), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), W.T @ gz, rtol=1e-4, atol=1e-5)


def test_gradcheck_checks_forward_mode(device, load):
    m = load("forward", device)
    x = _t(device, [0.3, -0.8, 1.2], grad=True)
    assert pydiff.gradcheck(m.sine, (x,))
    assert pydiff.gradcheck(m.twist, (_t(device, RNG.uniform(-1, 1, (2, 3)), "float3", grad=True),))
    # backward right, hand-written forward derivative wrong: only the forward check sees it
    assert pydiff.gradcheck(m.square_fwd_checked, (x,), check_forward=False)
    with pytest.raises(pydiff.GradcheckError, match=r"forward mode: JVP element \d is"):
        pydiff.gradcheck(m.square_fwd_checked, (x,))


def test_forward_mode_errors(device, load):
    m = load("forward", device)
    x = _t(device, [1.0, 2.0, 3.0])
    with pytest.raises(
        ValueError, match=r"tangent has shape \(2,\); the tensor's values have shape \(3,\)"
    ):
        x.with_tangent([1.0, 2.0])
    with pytest.raises(
        ValueError, match=r"forward\.poly\.fwds: parameter 'x': tangent has shape \(2,\)"
    ):
        m.poly.fwds(1.0, 1.0, 1.0, (x, np.ones(2)))
    with pytest.raises(
        TypeError, match=r"not_differentiable is not differentiable: mark it \[Differentiable\]"
    ):
        m.not_differentiable.fwds(3)
    w = _t(device, np.ones((2, 1)), grad=True).with_tangent(np.ones((2, 1)))
    with pytest.raises(
        TypeError, match=r"parameter 'w' is a .*DiffTensor.*no forward derivative.*FwdDiffTensor<2>"
    ):
        m.dot_plain.fwds(spy.grid((2,)), w, _t(device, [1.0], grad=True))
    with pytest.raises(
        ValueError,
        match=r"parameter 'x' is a FwdDiffTensor<1>, "
        r"which takes a float tensor with exactly 1 dimension",
    ):
        m.dense_tanh(
            spy.grid((2,)),
            _t(device, np.ones((2, 3))),
            _t(device, np.ones((2, 3))),
            pydiff.zeros((2,), device=device),
        )
    with pytest.raises(
        TypeError, match=r"hvp: forward\.twist returns vector<float,3>; hvp needs a scalar"
    ):
        pydiff.hvp(m.twist, (_t(device, np.ones((1, 3)), "float3"),), (np.ones((1, 3)),))
    # issue 18: a Python function is accepted now (the identity's tangent is the direction)
    _, dv = pydiff.jvp(lambda v: v, (x,), (np.ones(3),))
    np.testing.assert_array_equal(dv.numpy(), np.ones(3))


def test_hessian_with_plain_numbers(device, load):
    m = load("forward", device)
    xs = np.array([0.5, -1.0, 2.0])
    H = pydiff.hessian(m.poly, (2.0, 8.0, -1.0, _t(device, xs)))
    # d2/da dx_i = 2 x_i, d2/db dx_i = 1, d2/dx_i^2 = 2a; nothing else
    np.testing.assert_allclose(H[0, 3:], 2 * xs, rtol=1e-6)
    np.testing.assert_allclose(H[1, 3:], 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.diag(H)[3:], 4.0, rtol=1e-6)
    np.testing.assert_allclose(H, H.T, atol=1e-6)
    hv = pydiff.hvp(m.poly, (2.0, 8.0, -1.0, _t(device, xs)), (1.0, 0.0, 0.0, np.zeros(3)))
    np.testing.assert_allclose(hv[3].numpy(), 2 * xs, rtol=1e-6)
