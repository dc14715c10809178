"""fixed_point's stopping rule at the float32 floor (breaker T 01, 02) and its host x0 (T 03).

x = A x + b with A a scaled rotation (complex eigenvalues rho e^(+-i theta)) or a random
matrix of spectral radius rho: references are the closed forms x* = (I - A)^-1 b and
dL/db = (I - A)^-T dL/dx*, dL/dA = dL/db x*^T in float64. The promise (docs/implicit.md):
within about tol |x*|, or at the float32 floor of the iteration, at most about
1.2e-7 |x*| / (1 - rho) for x = A x + b (one unit of rounding per step, summed by the
contraction); never silently worse: a solve that cannot get there raises.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff
from pydiff import ops
from pydiff.implicit_stop import StopRule, step_size


def rotation(rho: float, theta: float) -> np.ndarray:
    c, s = np.cos(theta), np.sin(theta)
    return (rho * np.array([[c, -s], [s, c]])).astype(np.float32)


def random_contraction(n: int, rho: float, seed: int) -> np.ndarray:
    m = np.random.default_rng(seed).standard_normal((n, n))
    return (m * rho / max(abs(np.linalg.eigvals(m)))).astype(np.float32)


def promised(rho: float, tol: float = 1e-6) -> float:
    """The relative error the docs allow: tol, or the float32 floor 1.2e-7 / (1 - rho)."""
    return 1.5 * max(tol, 1.2e-7 / (1 - rho))


def host_solve(A: np.ndarray, b: np.ndarray, tol: float, max_iter: int) -> np.ndarray | None:
    """StopRule driving the float32 iteration x <- A x + b on the host, as fixed_point's
    forward does on the device (None: it never stopped)."""
    x = np.zeros_like(b)
    old, stop = x.astype(np.float64), StopRule(tol, 1e-12)
    for _ in range(max_iter):
        x = (A @ x).astype(np.float32) + b
        new = x.astype(np.float64)
        done, old = stop(old, new, *step_size(old, new)), new
        if done:
            return new
    return None


CASES = [
    (f"rotation rho={r} theta={t}", rotation(r, t))
    for r in (0.99, 0.995)
    for t in (0.003, 0.03, 0.3, 1.5, 2.5, 3.0)
]
CASES += [
    (f"random n={n} seed={s}", random_contraction(n, 0.99, s)) for n in (4, 16) for s in (0, 1)
]


@pytest.mark.parametrize("name,A", CASES, ids=[c[0] for c in CASES])
def test_stop_rule_reaches_tol_or_the_float32_floor(name, A):
    # The old rule stopped rotations at 3-18 times the floor (a quantised step equal for 5
    # iterations read as the floor) and never stopped others (a float32 cycle whose steps
    # sit above tol |x|).
    rho = max(abs(np.linalg.eigvals(A.astype(np.float64))))
    b = np.random.default_rng(len(A)).standard_normal((len(A), 1)).astype(np.float32)
    exact = np.linalg.solve(np.eye(len(A)) - A.astype(np.float64), b.astype(np.float64))
    for tol in (1e-6, 1e-4):
        x = host_solve(A, b, tol, 20000)
        assert x is not None, f"{name}, tol={tol}: never stopped"
        error = np.abs(x - exact).max() / np.abs(exact).max()
        assert error <= promised(rho, tol), f"{name}, tol={tol}: error {error:.2e}"


def solve_with_gradients(device, A_np, b_np, **kw):
    A = pydiff.tensor(A_np, device=device, requires_grad=True)
    b = pydiff.tensor(b_np, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(
            lambda x, A, b: ops.matmul(A, x) + b, np.zeros(b_np.shape), A, b, **kw
        )
    tape.backward(x, grad=np.ones(b_np.shape))
    return x.numpy(), A.grad.numpy(), b.grad.numpy()


def check_against_closed_form(A_np, b_np, x, gA, gb, limit):
    A64, b64 = A_np.astype(np.float64), b_np.astype(np.float64)
    exact = np.linalg.solve(np.eye(len(b64)) - A64, b64)
    lam = np.linalg.solve((np.eye(len(b64)) - A64).T, np.ones_like(b64))
    assert np.abs(x - exact).max() <= limit * np.abs(exact).max()
    assert np.abs(gb - lam).max() <= limit * np.abs(lam).max()
    gA_exact = lam @ exact.T
    assert np.abs(gA - gA_exact).max() <= 2 * limit * np.abs(gA_exact).max()


def test_slow_rotation_reaches_the_float32_floor_forward_and_adjoint(device):
    # breaker T 01: rho = 0.99, theta = 0.003 stopped with x* off by 1e-4 relative (17 times
    # the floor) and b.grad by 5.7e-5, silently.
    A_np = rotation(0.99, 0.003)
    b_np = np.array([[1.0], [0.0]], np.float32)
    x, gA, gb = solve_with_gradients(device, A_np, b_np, max_iter=5000)
    check_against_closed_form(A_np, b_np, x, gA, gb, promised(0.99))


def test_too_few_iterations_for_the_promised_accuracy_raise(device):
    # ln(1/tol) / (1 - rho) = 1400 iterations are needed: max_iter=1000 cannot give the
    # promised accuracy, and says so rather than returning x* off by 1e-4.
    A = pydiff.tensor(rotation(0.99, 0.003), device=device)
    b = pydiff.tensor(np.array([[1.0], [0.0]], np.float32), device=device)
    with pytest.raises(pydiff.ConvergenceError, match="max_iter=1000"):
        pydiff.fixed_point(lambda x, A, b: ops.matmul(A, x) + b, np.zeros((2, 1)), A, b)


@pytest.mark.parametrize(
    "A_np",
    [rotation(0.95, 2.5), rotation(0.99, 1.5), random_contraction(4, 0.99, 3)],
    ids=["rotation 0.95 2.5", "rotation 0.99 1.5", "random 4x4 0.99"],
)
def test_float32_cycle_above_tol_is_the_floor_not_a_failure(device, A_np):
    # breaker T 02: float32 rounding ends these in a cycle (period 5 for 0.95 R(2.5)) whose
    # steps sit just above tol max|x|: ConvergenceError at any max_iter, with x* already
    # within 3e-7 of the solution.
    b_np = np.array([[1.0], [0.5], [-0.25], [2.0]], np.float32)[: len(A_np)]
    rho = max(abs(np.linalg.eigvals(A_np.astype(np.float64))))
    x, gA, gb = solve_with_gradients(device, A_np, b_np, max_iter=5000)
    check_against_closed_form(A_np, b_np, x, gA, gb, promised(rho))


def test_an_oscillating_f_is_refused_as_soon_as_it_repeats(device):
    # x = -x + b has the fixed point b/2, but from 0 the iteration alternates 0, b, 0, ...:
    # a cycle of steps |b|, no rounding floor.
    b = pydiff.tensor([1.0, 2.0], device=device)
    with pytest.raises(pydiff.ConvergenceError, match="repeats itself every 2 iterations"):
        pydiff.fixed_point(lambda x, b: b - x, np.zeros(2), b, max_iter=100000)


@pytest.mark.parametrize(
    "x0,error,words",
    [
        (None, TypeError, "x0 is not an array of numbers"),
        ("abc", TypeError, "x0 is not an array of numbers"),
        (np.array([1 + 2j]), TypeError, "x0 is not an array of numbers"),
        (True, TypeError, "x0 is boolean"),
        (np.array([True, False]), TypeError, "x0 is boolean"),
        (np.array(1e300), ValueError, "x0 holds 1e\\+300, beyond the largest float32"),
        (np.array([0.0, np.nan]), ValueError, "x0 holds NaN or inf"),
        ([np.inf], ValueError, "x0 holds NaN or inf"),
    ],
)
def test_host_x0_that_is_not_float32_numbers_is_refused_by_name(device, x0, error, words):
    # breaker T 03: None and 1e300 became NaN/inf, reported as "forward solve diverged at
    # iteration 1" with NumPy RuntimeWarnings; True was taken as 1.0.
    a = pydiff.tensor([1.0], device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(error, match=words):
            pydiff.fixed_point(lambda x, a: 0.5 * x + a, x0, a)


def test_tensor_x0_holding_nan_is_refused_by_name(device):
    a = pydiff.tensor([1.0], device=device)
    x0 = pydiff.tensor([np.nan], device=device)
    with pytest.raises(ValueError, match="x0 holds NaN or inf"):
        pydiff.fixed_point(lambda x, a: 0.5 * x + a, x0, a)
