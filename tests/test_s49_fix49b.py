"""fix49b: outputs marked non-differentiable (tape.backward's message, gradcheck of a marked
output own_outputs copied), a [ForwardDerivative] that is not [Differentiable] (load-time
warning, hvp's refusal), gradcheck's tolerances per Jacobian block (input dtype x output
dtype). References: closed forms checked by float64 central differences (NumPy), never
pydiff's own output."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

X = np.array([0.5, -1.0, 2.0, 1.5])


def _central(f, x, h=1e-6):
    """float64 central differences of an elementwise f (the reference derivative)."""
    return (f(x + h) - f(x - h)) / (2 * h)


class _MarkedP2(pydiff.Function):
    """y = x^2 with a backward, and z = 3x marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y, z = ops.mul(x, x), ops.mul(x, 3.0)
        ctx.mark_non_differentiable(z)
        return y, z

    @staticmethod
    def backward(ctx, gy, gz):
        (x,) = ctx.saved_tensors
        return ops.mul(ops.mul(x, 2.0), gy)


class _MarkedP1(pydiff.Function):
    """The same without backward (its calls recorded on the tape)."""

    @staticmethod
    def forward(ctx, x):
        y, z = ops.mul(x, x), ops.mul(x, 3.0)
        ctx.mark_non_differentiable(z)
        return y, z


@pytest.mark.parametrize("cls", [_MarkedP2, _MarkedP1])
def test_backward_from_a_marked_output_says_it_was_marked(device, cls):
    """tape.backward(z) of an output marked non-differentiable said "computed by
    _MarkedP2.forward off a tape (no pydiff.Tape was recording)" (a tape was recording), or
    "nothing it depends on requires a gradient" (x does): now it names the Function and the
    mark."""
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        y, z = cls.apply(x)
    for out in (z, z.reshape((2, 2))):
        seed = np.ones(out.expected_numpy_shape())
        with pytest.raises(RuntimeError, match=f"{cls.__name__}.forward marked non-diff") as e:
            tape.backward(out, grad=seed)
        assert "off a tape" not in str(e.value)
    with pytest.raises(RuntimeError, match="mark_non_differentiable"):
        z.backward(grad=np.ones(4))
    tape.backward(y, grad=np.ones(4))  # the unmarked output: closed form 2x
    np.testing.assert_allclose(x.grad.numpy(), _central(lambda v: v * v, X), rtol=1e-5)


class _PassesInputMarked(pydiff.Function):
    """y = x^2, and x itself returned marked non-differentiable (own_outputs copies it)."""

    wrong = 1.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(x)
        return ops.mul(x, x), x

    @classmethod
    def backward(cls, ctx, gy, gx):
        (x,) = ctx.saved_tensors
        return ops.mul(ops.mul(x, 2.0 * cls.wrong), gy)


class _PassesInputMarkedWrong(_PassesInputMarked):
    wrong = 1.02  # 2% off


def test_gradcheck_leaves_out_a_marked_output_that_was_copied(device):
    """A marked output that is an input (copied by own_outputs) was checked as a zero
    Jacobian against its finite differences (the identity): a right Function failed."""
    ref = _central(lambda v: v * v, X)  # 2x, float64
    assert np.all(np.abs(2.04 * X - ref) > 1e-2 * np.abs(ref))  # 2% off is detectable
    x = pydiff.tensor(X, requires_grad=True, device=device)
    y, z = _PassesInputMarked.apply(x)
    assert not z.requires_grad and z.storage is not x.storage
    assert pydiff.gradcheck(_PassesInputMarked, (x,))
    assert not pydiff.gradcheck(_PassesInputMarkedWrong, (x,), raise_exception=False)
    with pydiff.Tape() as tape:  # the copy is marked too: a backward from it says so
        y, z = _PassesInputMarked.apply(x)
    with pytest.raises(RuntimeError, match="_PassesInputMarked.forward marked non-diff"):
        tape.backward(z, grad=np.ones(4))
