"""grad_dtype and differentiable memoised per SlangPy element type (perf47b): the memo gives
what SlangPy's reflection says, per type, and never memoises a refusal."""

import numpy as np
import pytest

import pydiff


def test_grad_dtype_is_the_reflections_derivative_per_type():
    for dtype in (np.float32, np.int32):
        t = pydiff.tensor(np.ones(4, dtype))
        element = t.native.dtype
        want = bool(getattr(element, "differentiable", False))
        assert t.differentiable is want and t.differentiable is want  # (memoised: same)
        if want:
            assert t.grad_dtype is element.derivative
            assert t.grad_dtype is element.derivative


def test_refusals_are_not_memoised():
    t = pydiff.tensor(np.ones(4, np.int32))
    for _ in range(2):  # (the second read asks again: still refused)
        with pytest.raises(TypeError, match="cannot have gradients"):
            t.grad_dtype


def test_gradient_through_memoised_types_matches_closed_form():
    x = pydiff.tensor(np.array([1.0, -2.0, 3.0], np.float32), requires_grad=True)
    for _ in range(2):  # (second step: the memo serves the gradient buffers' type)
        x.zero_grad()
        with pydiff.Tape() as tape:
            y = pydiff.ops.sum(pydiff.ops.mul(x, x))
        tape.backward(y)
        np.testing.assert_allclose(x.grad.numpy(), 2 * np.array([1.0, -2.0, 3.0]), rtol=1e-6)
