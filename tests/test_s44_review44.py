"""Adversarial review of fuse44 (a classifier head's product held back for the cross-entropy)
and lazy44 (an op's output gradient buffer owed until first needed): cases that gave a wrong
value or gradient, checked against float64 NumPy."""

import copy

import numpy as np

import pydiff
from pydiff import ops


def test_copy_copy_of_an_output_with_owed_gradient_shares_it():
    """``copy.copy`` of an op's output on a tape: the copy shares the gradient buffers (the
    documented contract). With the buffer owed (lazy44) each object made its own, so the
    gradient through the copy never reached the producer's backward: x.grad was wrong by ~3."""
    rng = np.random.default_rng(5)
    xn = rng.standard_normal((8, 4)).astype(np.float32)
    x = pydiff.tensor(xn, requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.relu(x)
        yc = copy.copy(y)
        s = ops.sum(ops.mul(yc, yc))
    tape.backward(s)
    x64 = xn.astype(np.float64)
    want = 2.0 * np.maximum(x64, 0.0) * (x64 > 0)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6, atol=1e-6)
    assert y.grad is yc.grad
    np.testing.assert_allclose(y.grad.numpy(), 2.0 * np.maximum(x64, 0.0), rtol=1e-6)
