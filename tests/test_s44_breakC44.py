"""breakC44: forward mode, the function transforms and gradcheck, as a demanding new user.

Defects found and fixed here:
- ``pydiff.gradcheck`` compared only the *tangent* that forward mode gives: a hand-written
  ``[ForwardDerivative]`` returning a wrong primal (``x*x + 1`` for ``x*x``) passed, though
  ``.fwds``, ``pydiff.jvp`` and a Python function's ``jvp`` then return that wrong value.
  The forward check now also compares forward mode's value with ``fn``'s own, element by
  element.
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops
from pydiff import modcheck

SRC = """
import slangpy;
[Differentiable][ForwardDerivative(sq_fwd)]
float sq_wrong_value(float x) { return x * x; }
DifferentialPair<float> sq_fwd(DifferentialPair<float> x)
{ return diffPair(x.p * x.p + 1.0, 2.0 * x.p * x.d); }

[Differentiable][ForwardDerivative(sq_fwd_ok)]
float sq_right(float x) { return x * x; }
DifferentialPair<float> sq_fwd_ok(DifferentialPair<float> x)
{ return diffPair(x.p * x.p, 2.0 * x.p * x.d); }

[Differentiable][ForwardDerivative(sc_fwd)]
void scale_inout(float s, inout float v) { v = v * s; }
void sc_fwd(DifferentialPair<float> s, inout DifferentialPair<float> v)
{ v = diffPair(v.p * s.p * 1.5, v.d * s.p + v.p * s.d); }
"""


@pytest.fixture(scope="module")
def mod():
    return pydiff.load_module_from_source("breakC44_fwd", SRC)


X = np.array([0.4, -0.9, 1.3, -0.2])


def test_gradcheck_catches_a_forward_derivative_with_a_wrong_value(mod):
    x = pydiff.tensor(X, requires_grad=True)
    # the tangent is right (2x u) and the backward is Slang's: only the value is wrong
    y, dy = mod.sq_wrong_value.fwds(x.detach().with_tangent(np.ones(4)))
    np.testing.assert_allclose(dy.numpy(), 2 * X, rtol=1e-6)
    np.testing.assert_allclose(y.numpy(), X**2 + 1, rtol=1e-6)  # not X**2
    with pytest.raises(pydiff.GradcheckError, match=r"forward mode: value element \d+ is"):
        pydiff.gradcheck(mod.sq_wrong_value, (x,))
    assert not pydiff.gradcheck(mod.sq_wrong_value, (x,), raise_exception=False)
    assert pydiff.gradcheck(mod.sq_wrong_value, (x,), check_forward=False)  # reverse is right
    assert pydiff.gradcheck(mod.sq_right, (x,))


def test_gradcheck_checks_the_value_a_forward_derivative_writes(mod):
    s = pydiff.tensor(np.array([0.7, -1.1, 2.0]), requires_grad=True)
    v = pydiff.tensor(np.array([1.5, 0.3, -0.6]), requires_grad=True)
    with pytest.raises(pydiff.GradcheckError, match="forward mode: value element"):
        pydiff.gradcheck(mod.scale_inout, (s, v), check_forward=True)
    np.testing.assert_allclose(v.numpy(), [1.5, 0.3, -0.6], rtol=1e-7)  # put back


OUT_SRC = """
import slangpy;
[Differentiable][ForwardDerivative(o_fwd)]
void out_wrong(float x, out float y) { y = x * 3.0; }
void o_fwd(DifferentialPair<float> x, out DifferentialPair<float> y)
{ y = diffPair(x.p * 2.0, 3.0 * x.d); }
"""


def test_pydiff_check_fails_a_forward_derivative_with_a_wrong_value(tmp_path):
    path = tmp_path / "wrong_value.slang"
    path.write_text(SRC + OUT_SRC)
    rows = modcheck.check_module(path)
    forward = {r.function: r for r in rows if r.mode == "forward"}
    for name in ("sq_wrong_value", "scale_inout", "out_wrong"):
        assert forward[name].status == "FAIL", forward[name]
        assert "forward value is not the function's" in forward[name].why
    assert forward["sq_right"].status == "PASS"
    # the tangents themselves are right: every backward and adjoint row passes
    assert all(r.status == "PASS" for r in rows if r.mode != "forward")


def test_module_jvp_names_a_tangent_of_the_wrong_shape(mod):
    x = pydiff.tensor(X)
    with pytest.raises(ValueError, match=r"jvp: tangents\[0\] \(for .*sq_right's parameter 'x'\)"):
        pydiff.jvp(mod.sq_right, (x,), (np.ones(1),))
    _, t = pydiff.jvp(mod.sq_right, (x,), (np.ones(4),))
    np.testing.assert_allclose(t.numpy(), 2 * X, rtol=1e-6)


class _ExpInPlace(pydiff.Function):
    """exp written into its input (no mark_dirty in pydiff), then returned."""

    @staticmethod
    def forward(ctx, x):
        y = pydiff.tensor(np.exp(x.numpy()))
        x.copy_(y)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return ops.mul(y, g)


def test_function_writing_an_input_that_requires_grad_is_refused():
    # before: x0.grad came back 0 (the gradient for the intermediate x never reached x0),
    # where d/dx0 sum(exp(x0)^2) = 2 exp(2 x0)
    x0 = pydiff.tensor(X, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"_ExpInPlace.forward wrote input 0 .* in place"):
        with pydiff.Tape():
            _ExpInPlace.apply(ops.mul(x0, 1.0))
    with pytest.raises(RuntimeError, match="wrote input 0"):  # a leaf too, as torch refuses
        with pydiff.Tape():
            _ExpInPlace.apply(x0)
    # held fixed or off a tape it is just a call
    c = pydiff.tensor(X)
    with pydiff.Tape():
        _ExpInPlace.apply(c)
    np.testing.assert_allclose(c.numpy(), np.exp(X), rtol=1e-6)

    class ExpFresh(_ExpInPlace):  # the fix the message gives: a new tensor
        @staticmethod
        def forward(ctx, x):
            y = pydiff.tensor(np.exp(x.numpy()))
            ctx.save_for_backward(y)
            return y

    x0 = pydiff.tensor(X, requires_grad=True)
    with pydiff.Tape() as tape:
        y = ExpFresh.apply(ops.mul(x0, 1.0))
        loss = ops.sum(ops.mul(y, y))
    tape.backward(loss)
    np.testing.assert_allclose(x0.grad.numpy(), 2 * np.exp(2 * X), rtol=1e-5)
