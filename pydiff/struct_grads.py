"""The gradient buffers of the tensors in a struct (dict) argument of ``.bwds``, field by
field, as those of a parameter of the field's type.

A ``DiffTensor`` field gets its gradient through its own buffers whether or not the struct
is ``IDifferentiable`` (its loads add into ``grad_out``, as SlangPy binds it): it is bound
with the tensor's gradient buffers, under the tensor's zeroing policy, as a ``DiffTensor``
parameter is. A written ``RWDiffTensor``/``WDiffTensor`` field wanting a gradient is refused
(its upstream, and the values the call read, are bound only for a parameter of its own).

    m.f.bwds(spy.grid((3,)), {"t": t, "s": 2.0}, _result=1.0)   # t.grad += d/dt
"""

from __future__ import annotations

from typing import Any

from .arguments import check_device, deep_bind, nested_tensors, scratch
from .bwds_checks import primal_sink
from .errors import warn_once
from .signature import FieldInfo, ParamInfo, field_at
from .tensor import Tensor


def bind_struct(b: Any, p: ParamInfo, value: Any, path: str = "") -> Any:
    """A struct argument of ``.bwds`` with each tensor in its fields bound for SlangPy.
    ``b``: the call's ``backward_args.BackwardArgs`` (its policies, scratch and copies).

    A differentiable float field always gets gradient buffers (scratch ones where none is
    wanted, as SlangPy's cached kernel may expect them); values of its own where the call
    writes; a ``DiffTensor`` field its tensor's gradient buffers (``bind_tensor_field``)."""
    if type(value) is not Tensor:
        if isinstance(value, dict):
            return {
                k: bind_struct(b, p, v, f"{path}.{k}" if path else str(k)) for k, v in value.items()
            }
        if isinstance(value, (list, tuple)) and nested_tensors(value):
            return type(value)(bind_struct(b, p, v, path) for v in value)
        return value
    check_device(b.fn, value, f"parameter '{p.name}', field '{path}'")
    field = field_at(p, path)
    if field is not None and field.tensor_kind is not None:
        return bind_tensor_field(b, p, field, value, path)
    if not value.differentiable or path.split(".")[0] in p.no_grad_fields:
        if p.writes_value:
            if p.reads_value:
                return value.copy_values().native
            return primal_sink(b.device, value)
        return value.native
    if p.writes_value:
        if p.reads_value or not value.requires_grad:
            return b.own_primal(value, b.separate_grads(value, p), keep=p.reads_value)
        return b.own_primal(value, value.bind(True), keep=False)
    if not value.requires_grad:
        return b.separate_grads(value, p)  # zeros read, sink written
    b.accumulating(value, p)
    return value.bind(True)


def bind_tensor_field(b: Any, p: ParamInfo, field: FieldInfo, t: Tensor, path: str) -> Any:
    """A tensor field (``Tensor``, ``DiffTensor``, ``RWDiffTensor``...) as a tensor
    parameter of its type is bound: the backward's rerun of the forward writes into values
    of its own, never the caller's; a read ``DiffTensor`` adds into the tensor's gradient
    buffers (its zeroing policy applied first), or into a scratch buffer when it wants none."""
    writes = field.access in ("write", "read_write")
    reads = field.access in ("read", "read_write")
    if not field.diff_tensor:
        if writes:
            return t.copy_values().native if reads else primal_sink(b.device, t)
        return t.native
    if field.no_diff:
        return _no_diff_field(b, p, t, path, writes, reads)
    if writes:
        if t.requires_grad:
            raise ValueError(
                f"{b.label}.bwds: parameter '{p.name}', field '{path}' is a {field.type_name} "
                "the call writes, given a tensor that requires a gradient: .bwds binds the "
                "upstream gradient of a written tensor (and the values the call read) only "
                "for a tensor parameter of its own. Pass the tensor as its own "
                f"{field.type_name} parameter, or pass it detached (t.detach()) to say no "
                "gradient is wanted"
            )
        return b.own_primal(t, b.separate_grads(t, p), keep=reads)
    if not t.requires_grad:
        sink = b.scratch_grads(t, "sink")
        return t.native.with_grads(grad_in=sink, grad_out=sink, zero=False)
    b.accumulating(t, p, f"{b.label}: parameter '{p.name}', field '{path}'")
    return t.bind(True)


def bind_struct_forward(device: Any, p: ParamInfo, value: Any, path: str = "") -> Any:
    """A struct argument of a forward call, bound for SlangPy: a concrete ``DiffTensor`` /
    ``WDiffTensor`` field given a tensor without gradient buffers (a ``no_diff`` field, say)
    gets scratch ones, which the forward never touches (SlangPy raised "Missing required
    input gradients"); the rest as given.

    >>> m.f(spy.grid((n,)), x, {"y": pydiff.zeros((n,)), "z": z})   # WDiffTensor y, z
    """
    if isinstance(value, dict):
        return {
            k: bind_struct_forward(device, p, v, f"{path}.{k}" if path else str(k))
            for k, v in value.items()
        }
    if type(value) is not Tensor or value.requires_grad:
        return deep_bind(value)
    field = field_at(p, path) if path else None
    if field is None or field.tensor_kind != "diff":
        return value.bind(True)
    sink = scratch(device, value, "sink")
    return value.native.with_grads(grad_in=sink, grad_out=sink, zero=False)


def _no_diff_field(b: Any, p: ParamInfo, t: Tensor, path: str, writes: bool, reads: bool) -> Any:
    """A diff tensor field marked ``no_diff``: its loads add into a sink, its stores' backward
    reads zeros (as a ``no_diff`` tensor parameter); the tensor's gradient stays as it was."""
    if t.requires_grad:
        warn_once(
            f"{b.label}: parameter '{p.name}', field '{path}' is no_diff, so .bwds gives it no "
            "gradient, but the tensor passed requires one: its gradient stays unchanged. Pass "
            "t.detach() to say no gradient is wanted, or drop the field's no_diff"
        )
    sink = b.scratch_grads(t, "sink")
    if not writes:
        return t.native.with_grads(grad_in=sink, grad_out=sink, zero=False)
    primal = t.copy_values().native if reads else primal_sink(b.device, t)
    return primal.with_grads(grad_in=b.scratch_grads(t, "zeros"), grad_out=sink, zero=False)
