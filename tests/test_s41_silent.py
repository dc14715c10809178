"""Session 41, silent: gaps where a gradient could come out silently wrong or a refused
backward could change gradients, each checked against closed forms or NumPy."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff.tensor import Tensor

X = np.array([0.3, -0.7, 1.1])


# --- 1. copy_'s mark through copy_values and the host (non-contiguous) copy_ -------------


def test_copy_values_of_copied_values_keeps_the_mark(device):
    # Before: y.copy_(x); w = y.copy_values() (or of y * 2, no tape records it): grad of
    # (w * x).sum() came out x (resp. 2x), where a copy_ that carried the gradient gives 2x
    # (resp. 4x): silently wrong. Now w stays marked and the recorded call is refused,
    # as a copy_ of y is.
    for scale in (None, 2.0):

        def f(x, scale=scale):
            y = pydiff.zeros((3,), device=device)
            y.copy_(x)
            w = (y if scale is None else y * scale).copy_values()
            return (w * x).sum()

        with pytest.raises(RuntimeError, match=r"copy_ of values with a gradient path"):
            pydiff.grad(f)(X)

    # a snapshot of a tensor that requires a gradient stays a constant on purpose
    np.testing.assert_allclose(pydiff.grad(lambda x: (x.copy_values() * x).sum())(X), X)


def test_host_copy_of_a_non_contiguous_source_keeps_the_mark(device):
    # Before: a.copy_(values with a gradient path); w.copy_(v) for a strided view v of a
    # (copied by the host): w lost the mark, and grad of (w * x).sum() came out x where 2x
    # is right. Now w is marked as a device copy_ would be, and refused.
    def f(x):
        a = pydiff.zeros((3, 2), device=device)
        a.copy_(x.reshape((3, 1)) * pydiff.ones((3, 2), device=device))
        v = Tensor(a.native.view(shape=(3,), strides=(2,)), a.device, storage=a.storage)
        assert not v.native.is_contiguous()
        w = pydiff.zeros((3,), device=device)
        w.copy_(v)
        np.testing.assert_allclose(w.numpy(), X, rtol=1e-6)
        return (w * x).sum()

    with pytest.raises(RuntimeError, match=r"copy_ of values with a gradient path"):
        pydiff.grad(f)(X)

    def g(x):  # the same from a detached source: a constant on purpose, exact
        a = pydiff.tensor(np.repeat(X[:, None], 2, 1), device=device)
        v = Tensor(a.native.view(shape=(3,), strides=(2,)), a.device, storage=a.storage)
        w = pydiff.zeros((3,), device=device)
        w.copy_(v)
        return (w * x).sum()

    np.testing.assert_allclose(pydiff.grad(g)(X), X, rtol=1e-6)
