"""Which calls the generated elementwise kernels cover (``generated``): every parameter an
``in float``, each argument a number, a contiguous float4-storage float tensor of the call's
shape or a one-element tensor broadcast over it, a ``float`` result, nothing SlangPy must
decide (``generated_helpers.left_to_slangpy``); for a backward, a float upstream and
gradient buffers that no value the kernel reads shares. Each refusal is a reason, the text
``generated.stats()`` counts; ``kinds_of`` gives the layout a covered call's kernel is
compiled for.

    reason = uncovered(fn, args, shape) or uncovered_backward(fn, args, upstream, grads)
    kinds = kinds_of(args, shape)          # ("n", "t", "s"): number, tensor, broadcast
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import generated_helpers
from .generated_switch import enabled
from .signature import FunctionTarget
from .tensor import Tensor, float4_ready

NUMBERS = (float, int, np.float32, np.float64)  # not bool: SlangPy's path decides


def call_shape(args: list, extra: tuple = ()) -> tuple[int, ...] | None:
    """NumPy's broadcast of the tensor arguments' shapes (and ``extra`` shapes), or None."""
    shapes = [v.shape for v in args if type(v) is Tensor] + list(extra)
    try:
        return tuple(np.broadcast_shapes(*shapes)) if shapes else None
    except ValueError:
        return None


def argument_kind(value: Any, shape: tuple) -> str | None:
    """``"t"`` a tensor of the call's shape, ``"s"`` a one-element tensor broadcast over it,
    ``"n"`` a number; None: not covered."""
    if type(value) is Tensor:
        if value.shape == shape:
            return "t"
        if value.numel == 1 and len(value.shape) <= len(shape):
            return "s"
        return None
    return "n" if type(value) in NUMBERS else None


def kinds_of(args: list, shape: tuple) -> tuple[str, ...]:
    """The kernel's layout: each argument's kind (``argument_kind``), after ``uncovered``."""
    return tuple(argument_kind(v, shape) or "?" for v in args)


def uncovered_value(fn: FunctionTarget, name: str, value: Any, shape: tuple) -> str | None:
    """Why ``value`` (an argument or tangent, ``name`` in the reason) is not covered, or None."""
    kind = argument_kind(value, shape)
    if kind is None:
        if type(value) is Tensor:
            return f"{name}: tensor of shape {value.shape}, neither the call's nor one element"
        return f"{name}: {type(value).__name__} argument"
    if kind != "n":
        if value.device is not fn.module.device or value.dtype != "float":
            return f"{name}: tensor of another device or dtype"
        if not float4_ready(value):
            return f"{name}: tensor not contiguous float4 storage"
    return None


def uncovered(fn: FunctionTarget, args: list, shape: tuple) -> str | None:
    """Why the call is not covered, or None when it is."""
    sig = fn.signature
    if not enabled():
        return "PYDIFF_GENERATED=0"
    if (reason := generated_helpers.left_to_slangpy(fn, True)) is not None:
        return reason  # (trap findings, overloads: SlangPy picks by value, mutable statics)
    if sig.return_type != "float":
        return f"returns {sig.return_type}"
    if len(args) != len(sig.params):
        return "argument count"
    for p, value in zip(sig.params, args):
        if p.type_name != "float" or p.io != "in" or p.tensor_kind is not None or p.generic:
            return f"parameter '{p.name}' is {p.io} {p.type_name}"
        reason = uncovered_value(fn, f"parameter '{p.name}'", value, shape)
        if reason:
            return reason
    if not any(type(v) is Tensor and v.shape == shape for v in args):
        return "no tensor argument of the call's shape"
    return None


def uncovered_backward(
    fn: FunctionTarget, args: list, upstream: Tensor, grads: dict[int, Tensor]
) -> str | None:
    """Why a backward of a covered call is not covered (its upstream, its gradient buffers),
    or None when it is."""
    if not fn.signature.differentiable:
        return "not differentiable"
    if not grads:
        return "no gradient wanted"
    dev = fn.module.device
    if type(upstream) is not Tensor or upstream.device is not dev or upstream.dtype != "float":
        return "upstream gradient not a float tensor of the device"
    if not float4_ready(upstream):
        return "upstream not contiguous float4 storage"
    if any(not 0 <= i < len(args) or type(args[i]) is not Tensor for i in grads):
        return "gradient wanted for a number"  # Python floats: SlangPy's path too
    read = {id(upstream.storage)} | {id(v.storage) for v in args if type(v) is Tensor}
    full = {id(g.storage) for i, g in grads.items() if args[i].shape == upstream.shape}
    for i, g in grads.items():
        if fn.signature.params[i].no_diff:
            return f"gradient wanted for no_diff parameter '{fn.signature.params[i].name}'"
        if type(g) is not Tensor or g.device is not dev or g.dtype != "float":
            return "gradient buffer not a float tensor of the device"
        if id(g.storage) in read:
            return "gradient buffer shared with a value the call reads"
        if args[i].shape != upstream.shape:  # broadcast: reduce_into adds into its grad_out
            if g is not args[i].grad_out or id(g.storage) in full:
                return "broadcast gradient not the parameter's own buffer"
        elif g.shape != upstream.shape or not float4_ready(g):
            return "gradient buffer not contiguous float4 storage of the call"
    return None
