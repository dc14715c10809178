"""Checks and buffers of a ``.bwds`` call before anything runs: the result given
positionally (as SlangPy takes it), in-place parameters holding what the call wrote (the
values it read are used instead, or the call is refused), a result sharing an input's
gradient buffer, tensors that want a gradient where none flows, and the buffers a backward
kernel writes forward values into.

    args, kwargs = positional_result(fn, (x, y), {})      # -> (x,), {"_result": y}
    bound = values_read(fn, bound)
"""

from __future__ import annotations

from typing import Any

import slangpy as spy

from .errors import warn_once
from .signature import FunctionTarget, ParamInfo
from .storage import allocate
from .tensor import Tensor


def primal_sink(device: Any, t: Tensor) -> spy.Tensor:
    """Where a backward kernel may write forward values nobody reads (per shape and dtype)."""
    key = (t.shape, t.native.dtype.full_name, "primal sink")
    if key not in device.scratch:
        device.scratch[key] = allocate(device, t.native.shape, t.native.dtype)
    return device.scratch[key]


def warn_no_gradient(fn: FunctionTarget, p: ParamInfo, t: Tensor) -> None:
    """A tensor that wants a gradient, bound where none flows: say so once per call site."""
    if not t.requires_grad:
        return
    why = "no_diff" if p.no_diff else f"a {p.type_name} (not differentiable)"
    warn_once(
        f"{fn.label}: parameter '{p.name}' is {why}, so .bwds gives it no gradient, but the "
        "tensor passed requires one: its gradient stays unchanged. Pass t.detach() to say no "
        "gradient is wanted, or make the parameter differentiable (drop no_diff; a float type; "
        "a DiffTensor)"
    )


def values_read(fn: FunctionTarget, bound: list) -> list:
    """A parameter the call reads and writes, holding what this function's forward call
    wrote: ``.bwds`` differentiates at the value the call read, kept by the forward call
    (for tensors with gradient buffers); without that copy, refused."""
    out = []
    for p, value in bound:
        if type(value) is Tensor and p.in_place and value.storage.last_writer == fn.call_label:
            kept = value.storage.before
            if kept is None or kept[0] != value.storage.version or kept[1].shape != value.shape:
                raise ValueError(
                    f"{fn.bwds_label}: parameter '{p.name}' ({p.type_name}) was overwritten "
                    f"by {fn.call_label}, so it holds the value the call wrote, not the value "
                    "it read, and .bwds would differentiate at the wrong point (pydiff keeps "
                    "the value read only for tensors that had gradient buffers at the call). "
                    "Give the tensor gradient buffers before the call (requires_grad=True / "
                    f".with_grads()), record the call on a pydiff.Tape, or keep a copy before "
                    f"the call (before = {p.name}.clone()) and pass it to .bwds"
                )
            value = with_values_of(value, kept[1])
        out.append((p, value))
    return out


def with_values_of(t: Tensor, before: Tensor) -> Tensor:
    """``t``'s gradient buffers (and policy) on the values of ``before``, a copy taken before
    an in-place call: what that call's backward reads."""
    return Tensor(
        before.native,
        t.device,
        t.grad_in,
        t.grad_out,
        storage=before.storage,
        zero_policy=t.zero_policy,
    )


def refuse_shared_result_grad(fn: FunctionTarget, bound: list, result: Any) -> None:
    """The result's upstream gradient and an input's gradient in one buffer: the backward
    would add the input's gradient to the upstream it reads (in place through _result)."""
    if type(result) is not Tensor or result.grad_in is None:
        return
    for p, value in bound:
        if type(value) is Tensor and value.grad_out is not None and p.reads_value:
            if value.grad_out.storage is result.grad_in.storage:
                raise ValueError(
                    f"{fn.bwds_label}: _result's gradient buffer is also the gradient buffer of "
                    f"parameter '{p.name}' (the call wrote its input through _result?): the "
                    "input's gradient would be added to the upstream gradient it is computed "
                    "from. Pass the result and the input with gradient buffers of their own"
                )


def positional_result(fn: FunctionTarget, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """SlangPy's ``f.bwds(x, result)``: one argument more than the parameters of a function
    that returns a value is the result (with its gradient), as ``_result=``."""
    if len(args) != len(fn.params) + 1 or fn.signature.return_type == "void":
        return args, kwargs
    if "_result" in kwargs:
        raise TypeError(
            f"{fn.bwds_label}: the result is given twice, as the last positional argument and "
            "as _result=; pass it once"
        )
    return args[:-1], {**kwargs, "_result": args[-1]}
