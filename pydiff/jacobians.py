"""``pydiff.jacfwd`` and ``pydiff.jacrev``: the Jacobian of a Python function of pydiff calls
(or of a module function) by forward mode (one JVP per input element) or reverse mode (one
VJP per output element), as NumPy float64 of shape ``output shape + input shape``.

    J = pydiff.jacfwd(f)(x)                     # (*f(x).shape, *x.shape)
    Jw, Jb = pydiff.jacrev(f, argnums=(0, 1))(w, b, x)
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Callable, Sequence

import numpy as np

from .forward_program import float_primal, prepare, traced
from .grad_transforms import argnum_tuple, as_data
from .module import OverloadedFunction, ShaderFunction
from .tensor import Tensor
from .transforms import vjp


def _callable(fn: Any, what: str) -> Callable[..., Any]:
    if isinstance(fn, (ShaderFunction, OverloadedFunction)):
        return lambda *a: fn(*a, _result="tensor")
    if not callable(fn):
        raise TypeError(f"{what}: fn must be a callable or a module function, not {type(fn)}")
    return fn


def _one_output(out: Any, what: str) -> Tensor:
    if not isinstance(out, Tensor):
        kind = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(
            f"{what}: fn returned {kind}; the Jacobian needs one pydiff Tensor output (call it "
            "once per output)"
        )
    return out


def _inputs(args: tuple, nums: tuple, what: str) -> tuple[list, list]:
    """The arguments (those differentiated as float tensors, the rest as data) and the
    differentiated ones' shapes."""
    xs = [float_primal(x, what, i) if i in nums else as_data(x) for i, x in enumerate(args)]
    return xs, [xs[i].expected_numpy_shape() for i in nums]


def _limit(count: int, limit: int, what: str, name: str, per: str) -> None:
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
        raise ValueError(f"{what}: {name} must be a positive int, got {limit!r}")
    if count > limit:
        raise ValueError(
            f"{what}: {count} {per} need {count} passes; above {name}={limit} (raise it, or use "
            "pydiff.jvp / pydiff.vjp for products with single vectors)"
        )


def jacfwd(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, *, max_inputs: int = 1024
) -> Callable[..., Any]:
    """The Jacobian function of ``fn`` by forward mode: one JVP (``pydiff.jvp``) per element
    of the differentiated arguments. Returns NumPy float64 of shape ``out.shape + x.shape``
    (a tuple of them when ``argnums`` is a tuple); at most ``max_inputs`` elements.

    >>> J = pydiff.jacfwd(lambda x: (x * x)[1:])(pydiff.tensor([1.0, 2.0, 3.0]))
    >>> J.shape                                   # (2, 3): rows 2 x_i e_i
    """
    call = _callable(fn, "jacfwd")

    @functools.wraps(call)
    def run(*args: Any) -> Any:
        nums = argnum_tuple(argnums, len(args), "jacfwd")
        xs, shapes = _inputs(args, nums, "jacfwd")
        _limit(sum(int(np.prod(s)) for s in shapes), max_inputs, "jacfwd", "max_inputs", "inputs")
        jacobians = []
        for i, shape in zip(nums, shapes):
            columns, out_shape = [], None
            for e in range(int(np.prod(shape))):
                u = np.zeros(int(np.prod(shape)))
                u[e] = 1.0
                dirs = [u.reshape(shape) if k == i else None for k in range(len(xs))]
                ys, us = prepare("jacfwd", xs, dirs, "tangents")
                out, t = traced(call, ys, us, "jacfwd")
                out_shape = _one_output(out, "jacfwd").expected_numpy_shape()
                columns.append(np.asarray(t.numpy(), np.float64).reshape(-1))
            jacobians.append(np.stack(columns, axis=-1).reshape(tuple(out_shape) + tuple(shape)))
        return jacobians[0] if isinstance(argnums, numbers.Integral) else tuple(jacobians)

    return run


def jacrev(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, *, max_outputs: int = 1024
) -> Callable[..., Any]:
    """The Jacobian function of ``fn`` by reverse mode: one VJP (``pydiff.vjp``, a tape) per
    output element. Returns NumPy float64 of shape ``out.shape + x.shape`` (a tuple of them
    when ``argnums`` is a tuple); at most ``max_outputs`` output elements.

    >>> J = pydiff.jacrev(lambda x: (x * x)[1:])(pydiff.tensor([1.0, 2.0, 3.0]))
    >>> J.shape                                   # (2, 3)
    """
    call = _callable(fn, "jacrev")

    @functools.wraps(call)
    def run(*args: Any) -> Any:
        nums = argnum_tuple(argnums, len(args), "jacrev")
        xs, shapes = _inputs(args, nums, "jacrev")
        primals = [
            x if i in nums else x.detach() if isinstance(x, Tensor) else x for i, x in enumerate(xs)
        ]
        out = _one_output(call(*primals), "jacrev")
        out_shape = out.expected_numpy_shape()
        m = int(np.prod(out_shape))
        _limit(m, max_outputs, "jacrev", "max_outputs", "output elements")
        rows: list[list[np.ndarray]] = [[] for _ in nums]
        for e in range(m):
            seed = np.zeros(m)
            seed[e] = 1.0
            _, grads = vjp(call, primals, seed.reshape(out_shape))
            for r, i, shape in zip(rows, nums, shapes):
                g = grads[i]
                r.append(np.zeros(shape) if g is None else np.asarray(g.numpy(), np.float64))
        jacobians = [
            np.stack(r).reshape(tuple(out_shape) + tuple(shape)) for r, shape in zip(rows, shapes)
        ]
        return jacobians[0] if isinstance(argnums, numbers.Integral) else tuple(jacobians)

    return run
