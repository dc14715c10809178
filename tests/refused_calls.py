"""Shared setup of the tests that a refused call or backward changes nothing
(test_s40_guards.py, test_s40_brkg.py): modules of their own per test, tensors holding a known
gradient, an argument SlangPy refuses when it binds the call, the upstream gradient of ones, and
a Function whose backward always refuses.

    m = fresh_module(device, "s40_x", SOURCE)                  # a module name used once
    x, y = with_grad(device, [1.0, 2.0, 3.0, 4.0], 7.0), upstream(device)
    with pytest.raises(ValueError):
        m.prod2.bwds(x, bad_broadcast(device), _result=y)      # 3 elements against 4
"""

from __future__ import annotations

import itertools

import numpy as np

import pydiff

N = 4  # the elements of the tests' tensors; bad_broadcast's has one fewer
_names = itertools.count()


def fresh_module(device: pydiff.Device, prefix: str, source: str) -> pydiff.Module:
    """``source`` as a module of a name no other test loads (``prefix_<k>``)."""
    return pydiff.load_module_from_source(f"{prefix}_{next(_names)}", source, device=device)


def with_grad(device: pydiff.Device, values, grad_fill: float) -> pydiff.Tensor:
    """A float32 tensor of ``values`` that requires grad, its gradient filled with
    ``grad_fill``."""
    t = pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=True)
    t.grad.copy_from_numpy(np.full(t.shape, grad_fill, np.float32))
    return t


def bad_broadcast(device: pydiff.Device) -> pydiff.Tensor:
    """A later argument SlangPy refuses when it binds the call (N - 1 elements against N)."""
    return with_grad(device, np.arange(N - 1), 5.0)


def upstream(device: pydiff.Device, n: int = N) -> pydiff.Tensor:
    """A result tensor of ``n`` zeros whose upstream gradient is ones."""
    return pydiff.zeros((n,), device=device).with_grads(ones=True)


class AlwaysRaises(pydiff.Function):
    """y = 2a, whose backward always raises ValueError("this backward refuses")."""

    @staticmethod
    def forward(ctx, a):
        return pydiff.tensor(2 * a.numpy(), device=a.device)

    @staticmethod
    def backward(ctx, g):
        raise ValueError("this backward refuses")
