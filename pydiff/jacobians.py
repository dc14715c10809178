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

from . import foreign

from .forward_program import (
    as_data,
    float_primal,
    held_primal,
    prepare,
    refuse_inside_tape,
    traced,
)
from .grad_transforms import argnum_tuple
from .module import OverloadedFunction, ShaderFunction
from .tensor import Tensor
from .transforms import vjp


def _callable(fn: Any, what: str) -> Callable[..., Any]:
    if isinstance(fn, (ShaderFunction, OverloadedFunction)):
        return lambda *a: fn(*a, _result="tensor")
    if not callable(fn):
        raise TypeError(f"{what}: fn must be a callable or a module function, not {type(fn)}")
    return fn


def _outputs(out: Any, what: str) -> tuple[Tensor, ...]:
    outs = out if isinstance(out, tuple) else (out,)
    for k, o in enumerate(outs):
        if not isinstance(o, Tensor):
            raise TypeError(
                f"{what}: fn returned a {type(o).__name__} (output {k}); it must return pydiff "
                "Tensors (a tuple for several)"
            )
    return outs


def _arrange(per_output: list, many_outputs: bool, argnums: Any) -> Any:
    """torch.func's nesting: outputs outside (a tuple for several), argnums inside."""
    single = isinstance(argnums, numbers.Integral)
    items = [per_arg[0] if single else tuple(per_arg) for per_arg in per_output]
    return tuple(items) if many_outputs else items[0]


def _inputs(args: tuple, nums: tuple, what: str) -> tuple[list, list]:
    """The arguments (those differentiated as float tensors, the rest as data) and the
    differentiated ones' shapes."""
    xs = [
        float_primal(x, what, i)
        if i in nums
        else as_data(held_primal(x, what, i), f"{what}: argument {i}")
        for i, x in enumerate(args)
    ]
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
    (nested as torch.func: a tuple over outputs when fn returns a tuple, inside it a tuple
    over ``argnums`` when that is a tuple); at most ``max_inputs`` elements.

    >>> J = pydiff.jacfwd(lambda x: (x * x)[1:])(pydiff.tensor([1.0, 2.0, 3.0]))
    >>> J.shape                                   # (2, 3): rows 2 x_i e_i
    """
    call = _callable(fn, "jacfwd")

    @functools.wraps(call)
    def run(*args: Any) -> Any:
        nums = argnum_tuple(argnums, len(args), "jacfwd")
        xs, shapes = _inputs(args, nums, "jacfwd")
        _limit(sum(int(np.prod(s)) for s in shapes), max_inputs, "jacfwd", "max_inputs", "inputs")
        per_arg, many = [], False
        for i, shape in zip(nums, shapes):
            size, columns, outs = int(np.prod(shape)), None, ()
            for e in range(size):
                u = np.zeros(size)
                u[e] = 1.0
                dirs = [u.reshape(shape) if k == i else None for k in range(len(xs))]
                ys, us = prepare("jacfwd", xs, dirs, "tangents")
                out, t = traced(call, ys, us, "jacfwd")
                many, outs = isinstance(out, tuple), _outputs(out, "jacfwd")
                ts = t if many else (t,)
                columns = columns or [[] for _ in outs]
                for c, tangent in zip(columns, ts):
                    c.append(np.asarray(tangent.numpy(), np.float64).reshape(-1))
            per_arg.append(
                [
                    np.stack(c, axis=-1).reshape(tuple(o.expected_numpy_shape()) + tuple(shape))
                    for c, o in zip(columns, outs)
                ]
            )
        return _arrange([list(j) for j in zip(*per_arg)], many, argnums)

    return run


def jacrev(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, *, max_outputs: int = 1024
) -> Callable[..., Any]:
    """The Jacobian function of ``fn`` by reverse mode: one VJP (``pydiff.vjp``, a tape) per
    output element. Returns NumPy float64 of shape ``out.shape + x.shape`` (nested as
    ``jacfwd``); at most ``max_outputs`` output elements.

    >>> J = pydiff.jacrev(lambda x: (x * x)[1:])(pydiff.tensor([1.0, 2.0, 3.0]))
    >>> J.shape                                   # (2, 3)
    """
    call = _callable(fn, "jacrev")

    @functools.wraps(call)
    def run(*args: Any) -> Any:
        refuse_inside_tape("jacrev")
        nums = argnum_tuple(argnums, len(args), "jacrev")
        xs, shapes = _inputs(args, nums, "jacrev")
        with foreign.data_calls():  # off a tape: torch data in fn still gives pydiff results
            out = call(*xs)
        many, outs = isinstance(out, tuple), _outputs(out, "jacrev")
        out_shapes = [o.expected_numpy_shape() for o in outs]
        sizes = [int(np.prod(s)) for s in out_shapes]
        _limit(sum(sizes), max_outputs, "jacrev", "max_outputs", "output elements")
        per_output = []

        def of_differentiated(*ds: Any) -> Any:  # the other arguments held as given
            given = dict(zip(nums, ds))
            return call(*(given.get(i, x) for i, x in enumerate(xs)))

        for j, (out_shape, m) in enumerate(zip(out_shapes, sizes)):
            rows: list[list[np.ndarray]] = [[] for _ in nums]
            for e in range(m):
                seeds = [np.zeros(s) for s in out_shapes]
                seeds[j].reshape(-1)[e] = 1.0
                ds = tuple(xs[i] for i in nums)
                _, grads = vjp(of_differentiated, ds, tuple(seeds) if many else seeds[0])
                for r, g, shape in zip(rows, grads, shapes):
                    r.append(np.zeros(shape) if g is None else np.asarray(g.numpy(), np.float64))
            per_output.append(
                [
                    np.stack(r).reshape(tuple(out_shape) + tuple(shape))
                    for r, shape in zip(rows, shapes)
                ]
            )
        return _arrange(per_output, many, argnums)

    return run
