"""pydiff.fixed_point: solutions and implicit gradients against closed forms, NumPy float64
central finite differences of the whole solve and PyTorch float64; errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pydiff
from pydiff import ops


def _np_solve(f, x0, *params):
    """x = f(x, *params) by iteration in float64 (the reference)."""
    x = np.asarray(x0, np.float64)
    for _ in range(100000):
        new = f(x, *params)
        if np.max(np.abs(new - x)) < 1e-15 * max(1.0, np.max(np.abs(new))):
            return new
        x = new
    raise AssertionError("reference did not converge")


def _central_fd(loss, params, h=1e-6):
    """d loss / d each entry of each float64 array in params, by central differences."""
    grads = []
    for k, p in enumerate(params):
        g = np.zeros_like(p)
        for i in np.ndindex(p.shape):
            up = [q.copy() for q in params]
            dn = [q.copy() for q in params]
            up[k][i] += h
            dn[k][i] -= h
            g[i] = (loss(*up) - loss(*dn)) / (2 * h)
        grads.append(g)
    return grads


def _contraction(rng, n, radius):
    a = rng.standard_normal((n, n))
    a *= radius / max(abs(np.linalg.eigvals(a)))
    return a.astype(np.float32)


def test_linear_map_closed_form(device):
    """x = A x + b: x* = (I - A)^-1 b; with xbar = w, b.grad = (I - A)^-T w and
    A.grad = b.grad x*^T."""
    rng = np.random.default_rng(0)
    A_np = _contraction(rng, 4, 0.6)
    b_np = rng.standard_normal((4, 1)).astype(np.float32)
    w = rng.standard_normal((4, 1))
    A = pydiff.tensor(A_np, device=device, requires_grad=True)
    b = pydiff.tensor(b_np, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, A, b: ops.matmul(A, x) + b, np.zeros((4, 1)), A, b)
    assert len(tape) == 1  # the iterations are not recorded: one entry, the solve
    tape.backward(x, grad=w)
    I_A = np.eye(4) - A_np.astype(np.float64)
    x_star = np.linalg.solve(I_A, b_np.astype(np.float64))
    lam = np.linalg.solve(I_A.T, w)
    np.testing.assert_allclose(x.numpy(), x_star, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), lam, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(A.grad.numpy(), lam @ x_star.T, rtol=1e-4, atol=1e-5)


def test_tanh_contraction_closed_form_inside_grad(device):
    """x = a tanh(x) + b elementwise: dx*/db = 1 / (1 - a sech^2 x*), dx*/da = tanh(x*) dx*/db."""
    pydiff.set_default_device(device)
    a = np.array([0.5, -0.3, 0.8, 0.0])
    b = np.array([1.0, -0.5, 0.2, 0.7])

    def loss(a, b):
        return ops.sum(pydiff.fixed_point(lambda x, a, b: a * ops.tanh(x) + b, np.zeros(4), a, b))

    ga, gb = pydiff.grad(loss, argnums=(0, 1))(a, b)
    a32, b32 = a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)
    xs = _np_solve(lambda x: a32 * np.tanh(x) + b32, np.zeros(4))
    dxdb = 1.0 / (1.0 - a32 / np.cosh(xs) ** 2)
    np.testing.assert_allclose(gb, dxdb, rtol=1e-4)
    np.testing.assert_allclose(ga, np.tanh(xs) * dxdb, rtol=1e-4, atol=1e-6)
    value, _ = pydiff.value_and_grad(loss, argnums=1)(a, b)
    np.testing.assert_allclose(value.numpy().reshape(()), xs.sum(), rtol=1e-5)


def test_coupled_nonlinear_map_against_finite_differences(device):
    """x = 0.5 tanh(W x) + c * b (a Python function of ops): every entry of W, b and c against
    float64 central differences of the whole solve."""
    rng = np.random.default_rng(1)
    W_np = _contraction(rng, 3, 0.9)
    b_np = rng.standard_normal((3, 1)).astype(np.float32)
    c_np = np.array([[1.5]], np.float32)
    w = rng.standard_normal((3, 1))
    W, b, c = (pydiff.tensor(v, device=device, requires_grad=True) for v in (W_np, b_np, c_np))

    def f(x, W, b, c):
        return 0.5 * ops.tanh(ops.matmul(W, x)) + ops.matmul(b, c)

    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(f, np.zeros((3, 1)), W, b, c, tol=1e-7)
    tape.backward(x, grad=w)

    def ref_loss(W, b, c):
        xs = _np_solve(lambda x: 0.5 * np.tanh(W @ x) + b @ c, np.zeros((3, 1)))
        return float(np.sum(w * xs))

    params = [v.astype(np.float64) for v in (W_np, b_np, c_np)]
    for got, want in zip((W, b, c), _central_fd(ref_loss, params)):
        np.testing.assert_allclose(got.grad.numpy(), want, rtol=2e-4, atol=2e-5)


def test_shader_function_against_finite_differences(device, load):
    m = load("implicit", device)
    rng = np.random.default_rng(2)
    a_np = rng.uniform(-0.9, 0.9, 5).astype(np.float32)
    b_np = rng.standard_normal(5).astype(np.float32)
    w = rng.standard_normal(5)
    a = pydiff.tensor(a_np, device=device, requires_grad=True)
    b = pydiff.tensor(b_np, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(m.contraction, np.zeros(5), a, b)
    tape.backward(x, grad=w)

    def ref_loss(a, b):
        return float(np.sum(w * _np_solve(lambda x: a * np.tanh(x) + b, np.zeros(5))))

    params = [a_np.astype(np.float64), b_np.astype(np.float64)]
    want_a, want_b = _central_fd(ref_loss, params)
    np.testing.assert_allclose(a.grad.numpy(), want_a, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(b.grad.numpy(), want_b, rtol=2e-4, atol=2e-5)


def test_numbers_are_constants_and_x0_gets_no_gradient(device):
    b = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    results = []
    for start in ([0.0, 0.0], [5.0, -3.0]):
        x0 = pydiff.tensor(start, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            x = pydiff.fixed_point(lambda x, s, b: s * x + b, x0, 0.25, b)
        tape.backward(x, grad=np.ones(2))
        results.append(x.numpy())
        np.testing.assert_array_equal(x0.grad.numpy(), [0.0, 0.0])
    np.testing.assert_allclose(results[0], [4 / 3, 8 / 3], rtol=1e-5)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), [2 * 4 / 3, 2 * 4 / 3], rtol=1e-5)  # two runs


def test_backward_inside_the_tapes_with_block(device):
    a = pydiff.tensor([0.5], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, a: a * x + 1.0, np.zeros(1), a)
        y = ops.mul(x, x)
        tape.backward(y, grad=np.ones(1))  # x* = 1/(1-a); dy/da = 2 x* / (1-a)^2 = 16
    np.testing.assert_allclose(a.grad.numpy(), [16.0], rtol=1e-4)


def test_torch_function_against_torch_float64():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    W_np = _contraction(rng, 3, 0.7)
    b_np = rng.standard_normal((3, 1)).astype(np.float32)
    w = torch.tensor(rng.standard_normal((3, 1)))

    def solve(W, b):
        return pydiff.fixed_point(
            lambda x, W, b: ops.tanh(ops.matmul(W, x) + b), np.zeros((3, 1)), W, b
        )

    W = torch.tensor(W_np, requires_grad=True)
    b = torch.tensor(b_np, requires_grad=True)
    x = pydiff.torch_function(solve)(W, b)
    (x.double() * w).sum().backward()

    W64 = torch.tensor(W_np, dtype=torch.float64, requires_grad=True)
    b64 = torch.tensor(b_np, dtype=torch.float64, requires_grad=True)
    x64 = torch.zeros((3, 1), dtype=torch.float64)
    for _ in range(400):  # unrolled in float64: torch differentiates every iteration
        x64 = torch.tanh(W64 @ x64 + b64)
    (x64 * w).sum().backward()
    np.testing.assert_allclose(x.detach().numpy(), x64.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(W.grad.numpy(), W64.grad.numpy(), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(b.grad.numpy(), b64.grad.numpy(), rtol=2e-4, atol=2e-5)


def test_forward_that_does_not_converge_raises(device):
    a = pydiff.tensor([0.9], device=device, requires_grad=True)
    with pytest.raises(pydiff.ConvergenceError, match=r"forward solve .* max_iter=5 .*residual"):
        pydiff.fixed_point(lambda x, a: a * x + 1.0, np.zeros(1), a, max_iter=5)
    with pytest.raises(
        pydiff.ConvergenceError, match=r"forward solve .* diverged at iteration \d+ .*= (inf|nan) "
    ):
        pydiff.fixed_point(lambda x, a: 10.0 * x + a, np.ones(1), a)  # overflows


def test_adjoint_that_does_not_converge_raises(device):
    # x* = 1 is a fixed point of 2x - 1 (found at once from x0 = 1), but |df/dx| = 2:
    # lam <- xbar + 2 lam diverges.
    a = pydiff.tensor([2.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, a: a * x - 1.0, np.ones(1), a)
    np.testing.assert_array_equal(x.numpy(), [1.0])
    with pytest.raises(pydiff.ConvergenceError, match=r"adjoint solve .*residual"):
        tape.backward(x, grad=np.ones(1))
    # A contraction whose adjoint needs more steps than max_iter allows.
    a = pydiff.tensor([0.9], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, a: a * x + (1.0 - 0.9), np.ones(1), a, max_iter=5)
    with pytest.raises(pydiff.ConvergenceError, match=r"adjoint solve .* max_iter=5 "):
        tape.backward(x, grad=np.ones(1))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"tol": 0.0}, ValueError, "tol must be a positive finite"),
        ({"tol": -1e-3}, ValueError, "tol must be a positive finite"),
        ({"tol": math.nan}, ValueError, "tol must be a positive finite"),
        ({"tol": math.inf}, ValueError, "tol must be a positive finite"),
        ({"tol": True}, TypeError, "tol must be a positive number"),
        ({"tol": "1e-6"}, TypeError, "tol must be a positive number"),
        ({"max_iter": 0}, ValueError, "max_iter must be at least 1"),
        ({"max_iter": -2}, ValueError, "max_iter must be at least 1"),
        ({"max_iter": 2.5}, TypeError, "max_iter must be a positive int"),
        ({"max_iter": True}, TypeError, "max_iter must be a positive int"),
        ({"atol": -1e-9}, ValueError, "atol must be a finite number >= 0"),
        ({"atol": math.inf}, ValueError, "atol must be a finite number >= 0"),
        ({"atol": None}, TypeError, "atol must be a number >= 0"),
    ],
)
def test_bad_tol_and_max_iter_refused(device, kwargs, error, message):
    b = pydiff.tensor([1.0], device=device)
    with pytest.raises(error, match=message):
        pydiff.fixed_point(lambda x, b: 0.5 * x + b, np.zeros(1), b, **kwargs)


def test_bad_f_refused(device):
    b = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pytest.raises(TypeError, match="f must be callable"):
        pydiff.fixed_point(3.0, np.zeros(2), b)
    with pytest.raises(ValueError, match=r"returned shape \(\) for x of shape \(2,\)"):
        pydiff.fixed_point(lambda x, b: ops.sum(x), np.zeros(2), b)
    with pytest.raises(TypeError, match="returned a float"):
        pydiff.fixed_point(lambda x, b: 1.0, np.zeros(2), b)
    with pytest.raises(TypeError, match="x0 is not an array of numbers"):
        pydiff.fixed_point(lambda x, b: x, "zero", b)


def test_a_tensor_with_gradients_f_closes_over_is_refused(device):
    A = pydiff.tensor(np.full((2, 2), 0.25, np.float32), device=device, requires_grad=True)
    b = pydiff.tensor(np.ones((2, 1), np.float32), device=device, requires_grad=True)
    with pydiff.Tape():  # refused at the solve, before anything is recorded
        with pytest.raises(ValueError, match=r"reads a tensor of shape \(2, 2\) that requires"):
            pydiff.fixed_point(lambda x, b: ops.matmul(A, x) + b, np.zeros((2, 1)), b)
    np.testing.assert_array_equal(A.grad.numpy(), np.zeros((2, 2)))


def test_a_view_of_a_closure_tensor_is_still_refused(device):
    # A view of a param is the param (breaker 18's cases); a view of a closure's tensor is not.
    A = pydiff.tensor(np.full(4, 0.25, np.float32), device=device, requires_grad=True)
    b = pydiff.tensor(np.ones((2, 1), np.float32), device=device, requires_grad=True)
    with pydiff.Tape():
        with pytest.raises(ValueError, match=r"reads a tensor of shape \(2, 2\) that requires"):
            pydiff.fixed_point(lambda x, b: ops.matmul(A.reshape(2, 2), x) + b, np.zeros((2, 1)), b)


def test_params_and_state_read_through_views_in_forward_mode(device):
    # x = 0.5 x.reshape(...) + b.reshape(...) : x* = 2 b, dx* = 2 db (jvp) and b.grad = 2 (vjp).
    b = pydiff.tensor(np.float32([[1.0, 2.0], [3.0, 4.0]]), device=device, requires_grad=True)
    f = lambda x, b: 0.5 * x.reshape(4).reshape(2, 2) + b.reshape(4).reshape(2, 2)  # noqa: E731
    _, t = pydiff.jvp(
        lambda b: pydiff.fixed_point(f, np.zeros((2, 2)), b), (b,), (np.ones((2, 2)),)
    )
    np.testing.assert_allclose(t.numpy(), np.full((2, 2), 2.0), rtol=1e-5)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(f, np.zeros((2, 2)), b)
    tape.backward(x, grad=np.ones((2, 2)))
    np.testing.assert_allclose(b.grad.numpy(), np.full((2, 2), 2.0), rtol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 1e-6, 1e-12, 1e6])
def test_adjoint_and_tangent_accuracy_do_not_depend_on_scale(device, scale):
    # x = a tanh(x) + b elementwise: dx*/db = 1 / (1 - a sech^2 x*). The adjoint and tangent
    # solves are linear in xbar (dp): a seed of any size gets the same relative accuracy.
    a64 = np.float32([0.9, -0.7, 0.95]).astype(float)
    b64 = np.float32([0.3, -0.2, 0.05]).astype(float)
    xs = _np_solve(lambda x: a64 * np.tanh(x) + b64, np.zeros(3))
    dxdb = 1 / (1 - a64 / np.cosh(xs) ** 2)
    a = pydiff.tensor(a64.astype(np.float32), device=device)
    b = pydiff.tensor(b64.astype(np.float32), device=device, requires_grad=True)
    f = lambda x, a, b: a * ops.tanh(x) + b  # noqa: E731
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(f, np.zeros(3), a, b)
    tape.backward(x, grad=np.full(3, scale))
    np.testing.assert_allclose(b.grad.numpy() / scale, dxdb, rtol=2e-5)
    _, t = pydiff.jvp(
        lambda b: pydiff.fixed_point(f, np.zeros(3), a, b), (b,), (np.full(3, scale),)
    )
    np.testing.assert_allclose(t.numpy() / scale, dxdb, rtol=2e-5)


def test_zero_upstream_gradient_and_zero_direction_give_zero(device):
    b = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    f = lambda x, b: 0.9 * x + b  # noqa: E731
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(f, np.zeros(2), b)
    tape.backward(x, grad=np.zeros(2))
    np.testing.assert_array_equal(b.grad.numpy(), [0.0, 0.0])
    _, t = pydiff.jvp(lambda b: pydiff.fixed_point(f, np.zeros(2), b), (b,), (np.zeros(2),))
    np.testing.assert_array_equal(t.numpy(), [0.0, 0.0])


@pytest.mark.parametrize("x_star", [1e-3, 1e-7, 1e-9])
def test_forward_tolerance_is_relative_for_small_solutions(device, x_star):
    # x = 0.9 x + 0.1 x*: the first step from 0 is 0.1 x*; the old rule, absolute below 1,
    # stopped there (x = 0.1 x*). Stopping at a step s leaves an error of s * 0.9 / (1 - 0.9),
    # so at most 9 (atol + tol x*): relative 9e-6 + 9e-12 / x* with the defaults; atol=0 leaves
    # the relative part alone.
    c = pydiff.tensor(np.full(2, 0.1 * x_star, np.float32), device=device)
    want = np.float64(np.float32(0.1 * x_star)) / 0.1
    for atol in (1e-12, 0.0):
        x = pydiff.fixed_point(lambda x, c: 0.9 * x + c, np.zeros(2), c, atol=atol)
        bound = 9 * (atol / x_star + 1e-6) + 1e-6  # + float32 rounding
        np.testing.assert_allclose(x.numpy(), want, rtol=bound)


def test_forward_solution_at_zero_stops_on_atol(device):
    # x* = 0 (x = 0.5 tanh x): a relative step never gets small (it stays (1 - rho) / rho);
    # the absolute floor stops it: |x| <= atol rho / (1 - rho) at the end.
    a = pydiff.tensor(np.full(3, 0.5, np.float32), device=device)
    x = pydiff.fixed_point(lambda x, a: a * ops.tanh(x), np.ones(3), a)
    assert np.max(np.abs(x.numpy())) <= 1e-12
    x = pydiff.fixed_point(lambda x, a: a * ops.tanh(x), np.ones(3), a, atol=1e-4)
    assert 0 < np.max(np.abs(x.numpy())) <= 1e-4
    a = pydiff.tensor(np.full(3, 0.99, np.float32), device=device)  # too slow for the default
    with pytest.raises(pydiff.ConvergenceError, match=r"max_iter=1000 .*raise atol"):
        pydiff.fixed_point(lambda x, a: a * ops.tanh(x), np.ones(3), a)


def test_overwriting_the_solution_before_backward_raises(device):
    # The backward linearises f at x*, fixed_point's own output: overwritten, it would
    # linearise at the new values (breaker 18), so the tape's version check refuses it.
    a = pydiff.tensor([0.5, -0.3], device=device)
    b = pydiff.tensor([1.0, -0.5], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, a, b: a * ops.tanh(x) + b, np.zeros(2), a, b)
    x.copy_from_numpy(np.zeros(2))
    with pytest.raises(RuntimeError, match=r"overwritten by a host"):
        tape.backward(x, grad=np.ones(2))  # x itself: now a constant to the tape
    np.testing.assert_array_equal(b.grad.numpy(), [0.0, 0.0])
    with pydiff.Tape() as tape:  # from a later result: x* is saved for the adjoint solve
        x = pydiff.fixed_point(lambda x, a, b: a * ops.tanh(x) + b, np.zeros(2), a, b)
        y = ops.exp(b) + 0.0 * b
        loss = (x.sum() + y.sum()) * 1.0
    x.copy_from_numpy(np.zeros(2))
    with pytest.raises(RuntimeError, match=r"overwritten"):
        tape.backward(loss)
    np.testing.assert_array_equal(b.grad.numpy(), [0.0, 0.0])


def _tanh_reference(a_np, b_np, w):
    """x = a tanh(x) + b in float64, and the gradients of sum(w x*) w.r.t. a and b by
    central differences of the whole solve."""

    def ref_loss(a, b):
        return float(np.sum(w * _np_solve(lambda x: a * np.tanh(x) + b, np.zeros(a.shape))))

    return _central_fd(ref_loss, [a_np.astype(np.float64), b_np.astype(np.float64)])


def test_tensors_inside_dict_list_and_tuple_params_get_their_gradients(device, load):
    # A struct parameter of a shader function is a dict; a Python f may take a list or a
    # tuple: the tensors inside are params like top-level ones.
    m = load("implicit", device)
    rng = np.random.default_rng(5)
    a_np = rng.uniform(-0.9, 0.9, 4).astype(np.float32)
    b_np = rng.standard_normal(4).astype(np.float32)
    w = rng.standard_normal(4)
    want_a, want_b = _tanh_reference(a_np, b_np, w)
    calls = [
        (m.contraction_struct, lambda a, b: ({"a": a, "b": b},)),
        (lambda x, p: p[0] * ops.tanh(x) + p[1], lambda a, b: ([a, b],)),
        (
            lambda x, s, p: p["t"][0] * ops.tanh(x) + s * p["b"],
            lambda a, b: (1.0, {"t": (a, 2), "b": b}),
        ),
    ]
    for f, params in calls:
        a = pydiff.tensor(a_np, device=device, requires_grad=True)
        b = pydiff.tensor(b_np, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            x = pydiff.fixed_point(f, np.zeros(4), *params(a, b))
        tape.backward(x, grad=w)
        np.testing.assert_allclose(a.grad.numpy(), want_a, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(b.grad.numpy(), want_b, rtol=2e-4, atol=2e-5)
    # forward mode through a struct and a list param: da gives dx*/da da
    a = pydiff.tensor(a_np, device=device)
    b = pydiff.tensor(b_np, device=device)
    for f, params in calls[:2]:
        _, dx = pydiff.jvp(
            lambda a, b: pydiff.fixed_point(f, np.zeros(4), *params(a, b)), (a, b), (w, None)
        )
        np.testing.assert_allclose(dx.numpy(), want_a, rtol=2e-4, atol=2e-5)


def test_non_finite_upstream_gradient_propagates_as_ieee(device):
    # NaN/inf in the upstream gradient (or a tangent) is not a diverging solve: it reaches
    # the gradients of what it depends on, as through any op; the other elements keep theirs.
    a_np = np.array([0.5, 0.3, -0.4], np.float32)
    w = np.array([1.0, 2.0, 1.0])
    want_a, _ = _tanh_reference(a_np, np.ones(3, np.float32), w)
    a = pydiff.tensor(a_np, device=device, requires_grad=True)
    f = lambda x, a: a * ops.tanh(x) + 1.0  # noqa: E731 (x* > 0: tanh(x*) > 0)
    for bad, want in ((math.nan, math.nan), (math.inf, math.inf), (-math.inf, -math.inf)):
        a.zero_grad()
        with pydiff.Tape() as tape:
            x = pydiff.fixed_point(f, np.zeros(3), a, max_iter=50)
        tape.backward(x, grad=np.array([bad, w[1], w[2]]))
        got = a.grad.numpy()
        np.testing.assert_array_equal(got[0], want)
        np.testing.assert_allclose(got[1:], want_a[1:], rtol=2e-4, atol=2e-5)
    _, dx = pydiff.jvp(
        lambda a: pydiff.fixed_point(f, np.zeros(3), a, max_iter=50),
        (pydiff.tensor(a_np, device=device),),
        (np.array([math.nan, w[1], w[2]]),),
    )
    assert math.isnan(dx.numpy()[0])
    np.testing.assert_allclose(dx.numpy()[1:], want_a[1:], rtol=2e-4, atol=2e-5)
    # Coupled (a matrix product): a NaN reaches every element, as through ops.matmul.
    A = pydiff.tensor(np.full((2, 2), 0.25, np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, A: ops.matmul(A, x) + 1.0, np.zeros((2, 1)), A)
    tape.backward(x, grad=np.array([[math.nan], [0.0]]))
    assert np.isnan(A.grad.numpy()).all()
