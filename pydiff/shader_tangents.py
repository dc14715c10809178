"""The tangent of a shader call inside ``pydiff.jvp`` of a Python function (``shader_call``,
the handler ``forward_trace`` runs the call through): ``fn.fwds`` (Slang's ``fwd_diff``) off a
tape, and ``ShaderTangent``, a recorded op differentiable again, under a tape recording for
``hvp`` (its backward runs the generated directional derivative's ``bwd_diff`` for d/dx and the
function's own ``bwds`` for d/du).

    y = shader_call(fn, (x,), {"_result": "tensor"})   # y, with its tangent set on the trace
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import foreign, forward_trace
from .arguments import map_tensors, nested_tensors
from .creation import tensor as make_tensor, zeros
from .forward_mode import dir_wrapper
from .function import Function, FunctionCtx
from .policy import zero_policy
from .tape import active_tape, suspend_recording
from .tensor import Tensor


def _fwds_tangent(fn: Any, args: Sequence[Any], names: list, tangents: Sequence[Any], y: Tensor):
    """J u of one shader call by ``fn.fwds`` (not recorded), as a contiguous tensor of y's."""
    values = [a if t is None else a.detach().with_tangent(t) for a, t in zip(args, tangents)]
    n = len(values) - len(names)
    _, dy = fn.fwds(*values[:n], **dict(zip(names, values[n:])))
    arr = np.asarray(dy.numpy() if isinstance(dy, Tensor) else dy, np.float32)
    return make_tensor(arr.reshape(y.expected_numpy_shape()), dtype=y.dtype, device=y.device)


def _with_tangent(t: Tensor, tangent: Any) -> Tensor:
    return t if tangent is None else t.detach().with_tangent(tangent)


class ShaderTangent(Function):
    """``t = J(x) u`` of a shader call as a recorded op (for ``hvp``): its backward gives the
    arguments x the gradient of <g, J(x) u> by ``bwd_diff`` of the directional derivative
    (``forward_mode.dir_wrapper``) and the tangents u the gradient J^T g by ``fn.bwds``.

    >>> t = ShaderTangent.apply(fn, (y.detach(),), slots, *args, *tangents)  # slots: which have one
    """

    @staticmethod
    def forward(ctx: FunctionCtx, fn: Any, result: tuple, slots: tuple, *values: Any) -> Tensor:
        (y,), n = result, len(slots)  # the call's result (not an input of this op)
        given = iter(values[n:])
        ctx.fn, ctx.y, ctx.call = fn, y, values[:n]
        ctx.per_arg = [next(given) if s else None for s in slots]
        return _fwds_tangent(fn, ctx.call, [], ctx.per_arg, y)

    @staticmethod
    def backward(ctx: FunctionCtx, g: Tensor) -> tuple:
        fn, args, per_arg, y = ctx.fn, ctx.call, ctx.per_arg, ctx.y
        # a struct, array or number given no direction: a zero one of its own type in the
        # wrapper (a struct's tangent type may lack its integer fields)
        fixed = frozenset(
            p.name
            for p, a, u in zip(fn.params, args, per_arg)
            if p.differentiable and u is None and not isinstance(a, Tensor)
        )
        d = dir_wrapper(fn, args, fixed)  # refuses what the compiler cannot differentiate twice
        call, leaves, plain, gx = [], [], [], []
        for p, a, u in zip(fn.params, args, per_arg):
            tensor = isinstance(a, Tensor)
            # int tensors (indices, counts) and no_diff arguments: no gradient, no leaf
            wants = tensor and p.differentiable and a.differentiable
            leaves.append(a.detach().requires_grad_(True) if wants else a)
            plain.append(a.detach().requires_grad_(True) if wants else a)
            call.append(leaves[-1])
            if tensor:
                gx.append(leaves[-1] if wants else None)
            if p.differentiable and p.name not in fixed:
                zero = zeros(a.shape, dtype=a.dtype, device=a.device) if tensor else 0.0
                call.append(u.detach() if u is not None else zero)
        with suspend_recording(), zero_policy("accumulate"):
            seed = y.detach().copy_values().with_grads(grad_in=g.copy_values())
            d.bwds(*call, _result=seed)  # d<g, J(x) u>/dx
            seed = y.detach().copy_values().with_grads(grad_in=g.copy_values())
            fn.bwds(*plain, _result=seed)  # d<g, J u>/du = J^T g
        gu = [x.grad for x, u in zip(plain, per_arg) if u is not None]
        return tuple(None if x is None else x.grad for x in gx) + tuple(gu)


def _fields_needing_grad(value: Any, path: str = "") -> list[str]:
    """Where tensors that require a gradient sit inside a struct (dict) or list argument
    (``['a']['b']``, ``[1]``)."""
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return [path] if path and isinstance(value, Tensor) and value.requires_grad else []
    return [found for at, v in items for found in _fields_needing_grad(v, at)]


def _refuse_nested_grad(fn: Any, param: int | str, value: Any) -> None:
    """Reverse over forward (hvp, hessian, jvp on a tape) gives gradients to the arguments of
    a shader call, not to the tensors inside its struct or list arguments: refused by name."""
    found = _fields_needing_grad(value)
    if found:
        name = fn.params[param].name if isinstance(param, int) else param
        fields = ", ".join(f"{name}{at}" for at in found)
        raise NotImplementedError(
            f"{fn.label}: parameter '{name}' holds a tensor that requires a gradient inside a "
            f"struct (dict) or list argument ({fields}) while a tape records (hvp, hessian, or "
            "jvp inside a 'with pydiff.Tape()' block): reverse over forward through a shader "
            "call cannot give it one. Make that value a parameter of its own (a float, vector "
            "or array), or pass it detached (t.detach()) to hold it fixed"
        )


def shader_call(fn: Any, args: tuple, kwargs: dict) -> Any:
    """A shader call under ``pydiff.jvp``'s trace: the result, with its tangent stored.
    Torch data among the arguments are pydiff data here (results must be pydiff tensors)."""
    trace = forward_trace.active()
    args, kwargs = foreign.as_data(fn, args, kwargs, f"{fn.label} inside pydiff.jvp/hvp")
    names = [k for k in kwargs if not k.startswith("_")]
    values = list(args) + [kwargs[k] for k in names]
    tangents = forward_trace.tangents_of(values)
    # tensors with tangents inside struct (dict) and array (list) arguments, per argument
    inner = [
        [t for t in nested_tensors(v) if trace.tangent(t) is not None]
        if isinstance(v, (dict, list, tuple))
        else []
        for v in values
    ]
    with forward_trace.suspended():
        if all(t is None for t in tangents) and not any(inner):
            return fn(*args, **kwargs)
        for p in fn.params:
            if p.writes_value:
                raise NotImplementedError(
                    f"{fn.label} writes its parameter '{p.name}': forward mode of a Python "
                    "function (pydiff.jvp, jacfwd, hvp, hessian) follows returned results only; "
                    "return the value, or use pydiff.jvp / fn.fwds on the shader function itself"
                )
        y = fn(*args, **kwargs)
        if not isinstance(y, Tensor):
            raise TypeError(
                f"{fn.label} returned a {type(y).__name__} inside pydiff.jvp: call it with "
                "_result='tensor' so that its result can carry a tangent"
            )
        recorded = [a for a in values + list(tangents) if isinstance(a, Tensor)]
        recorded += [x for v, ts in zip(values, inner) for x in nested_tensors(v) + ts]
        recorded += [trace.tangent(t) for ts in inner for t in ts]
        if active_tape() is None or not any(a.requires_grad for a in recorded):
            values = [
                map_tensors(v, lambda t: _with_tangent(t, trace.tangent(t))) if ts else v
                for v, ts in zip(values, inner)
            ]
            trace.set(y, _fwds_tangent(fn, values, names, tangents, y))
            return y
        for k, ts in enumerate(inner):
            if ts:
                name = names[k - len(args)] if k >= len(args) else fn.params[k].name
                raise NotImplementedError(
                    f"{fn.label}: parameter '{name}' holds a value with a direction inside a "
                    "struct (dict) or list argument while a tape records (hvp, hessian, or jvp "
                    "inside a 'with pydiff.Tape()' block): reverse over forward through a shader "
                    "call cannot follow it there. Make that value a parameter of its own (a "
                    "float, vector or array), or run jvp / jacfwd / jacrev outside the tape"
                )
        for k, v in enumerate(values):
            _refuse_nested_grad(fn, names[k - len(args)] if k >= len(args) else k, v)
        if names:
            raise NotImplementedError(
                f"{fn.label}: inside hvp/hessian (reverse over forward through a shader call) "
                f"pass its arguments by position, not as {names}"
            )
        slots = tuple(t is not None for t in tangents)
        given = [t for t in tangents if t is not None]
        # (y in a tuple, detached: the call's result, read for its shape, is no input)
        trace.set(y, ShaderTangent.apply(fn, (y.detach(),), slots, *args, *given))
        return y
