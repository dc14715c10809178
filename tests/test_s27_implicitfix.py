"""fixed_point: a long adjoint solve keeps nothing per step (F05), parameters read through
f's closure (F04), and the error a slow contraction leaves at a given tol (F06). References:
closed forms of x = a x + b (x* = b / (1 - a), dx*/da = b / (1 - a)^2) in float64."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pydiff


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, pydiff.Tensor))


def test_long_adjoint_solve_keeps_no_tensor_per_step_and_raises_convergence_error(device):
    # x = a x + 1e-4 from x0 = x* = 1: the forward stops at once, the adjoint needs ~1e5
    # steps (rho = 0.9999) and gets 600. Each step's VJP buffers were kept by the outer
    # backward until it ended (3 tensors a step: ~21 KB, fds, then a segfault at ~20,000).
    a = pydiff.tensor([0.9999], device=device, requires_grad=True)
    calls, live = [0], {}

    def f(x, a):
        calls[0] += 1
        if calls[0] in (100, 500):  # both in the adjoint solve
            live[calls[0]] = _live_tensors()
        return a * x + 1e-4

    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(f, np.ones(1), a, max_iter=600)
    assert calls[0] < 10
    with pytest.raises(pydiff.ConvergenceError, match="adjoint solve.*max_iter=600"):
        tape.backward(x)
    assert live[500] - live[100] < 50, f"{live[500] - live[100]} tensors kept over 400 VJPs"


@pytest.mark.parametrize(
    "make_f",
    [
        lambda a: lambda x, b: b * x + a,  # the parameter itself, from the closure
        lambda a: lambda x, b: b * x + a.reshape(2),  # a view of it made inside f
        lambda a: lambda x, b: b * x + b.reshape(2),  # (a view of f's own argument)
    ],
    ids=["closure", "closure_view", "argument_view"],
)
def test_parameter_read_through_the_closure_gets_its_whole_gradient(device, make_f):
    # x = a x + a: x* = a / (1 - a), dx*/da = 1 / (1 - a)^2
    a_np = np.float32([0.5, 0.2])
    want = 1.0 / (1.0 - a_np.astype(np.float64)) ** 2
    a = pydiff.tensor(a_np, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(make_f(a), np.zeros(2), a)
    tape.backward(x, grad=np.ones(2))
    np.testing.assert_allclose(x.numpy(), a_np / (1.0 - a_np), rtol=1e-5)
    np.testing.assert_allclose(a.grad.numpy(), want, rtol=1e-5)

    def solve(a):
        return pydiff.fixed_point(make_f(a), np.zeros(2), a)

    g = pydiff.grad(lambda a: pydiff.ops.sum(solve(a)))(pydiff.tensor(a_np, device=device))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5)
    _, tangent = pydiff.jvp(solve, (pydiff.tensor(a_np, device=device),), (np.ones(2),))
    np.testing.assert_allclose(tangent.numpy(), want, rtol=1e-5)


def test_closure_reads_that_are_not_parameters_are_still_refused(device):
    a = pydiff.tensor([0.5, 0.2], device=device, requires_grad=True)
    c = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pytest.raises(ValueError, match="not one of params"):
        with pydiff.Tape():
            pydiff.fixed_point(lambda x, b: b * x + c, np.zeros(2), a)
    with pytest.raises(ValueError, match="carries a tangent but is not one of params"):
        pydiff.jvp(
            lambda a, c: pydiff.fixed_point(lambda x, b: b * x + c, np.zeros(2), a),
            (pydiff.tensor([0.5, 0.2], device=device), pydiff.tensor([1.0, 2.0], device=device)),
            (np.ones(2), np.ones(2)),
        )


def test_slow_contraction_stops_on_the_estimated_error_not_the_step(device):
    # A step s leaves an error s rho / (1 - rho): stopped on the step, rho = 0.99 gave x* off
    # by 1e-4 and rho = 0.999 by 1e-3 (tol = 1e-6). The float32 iteration itself cannot get
    # nearer than about one unit / (1 - rho) (6e-6 here), hence rtol (rho = 0.999 gives
    # 4e-5, at its floor, in 45 s on lavapipe: not run here).
    rho, rtol = 0.99, 2e-5
    a = pydiff.tensor([rho], device=device, requires_grad=True)
    a64, b = float(a.numpy()[0]), float(np.float32(1 - rho))
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, a: a * x + b, np.zeros(1), a, max_iter=100000)
    np.testing.assert_allclose(x.numpy(), [b / (1 - a64)], rtol=rtol)
    tape.backward(x)
    np.testing.assert_allclose(a.grad.numpy(), [b / (1 - a64) ** 2], rtol=2 * rtol)
