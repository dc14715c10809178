"""The forward call of a shader function: validate, bind pydiff tensors to SlangPy, run, and
record the call on the active tape (with copies of values the call overwrites).

    y = forward_call(fn, (2.0, x), {"_result": "tensor"})
"""

from __future__ import annotations

from typing import Any

import slangpy as spy

from .arguments import (
    MISSING,
    PLAIN,
    bind_arguments,
    prepare_arguments,
    check_device,
    deep_bind,
    fwd_tensor_struct,
    resolve_error,
)
from .backward_call import backward_call
from .bwds_checks import with_values_of
from .errors import warn_once
from .signature import FunctionTarget, ParamInfo
from .tape import Tape, active_tape
from .tensor import Tensor


def _wrap_result(fn: FunctionTarget, native_result: Any, given: Any) -> Any:
    if isinstance(given, Tensor):
        return given
    if isinstance(native_result, spy.Tensor):
        return Tensor(native_result, fn.module.device)
    return native_result


def _native_argument(fn: FunctionTarget, p: ParamInfo, value: Any) -> Any:
    if isinstance(value, Tensor):
        check_device(fn, value, f"parameter '{p.name}'")
        if p.tensor_kind == "diff" and not value.requires_grad:
            raise ValueError(
                f"{fn.module.name}.{fn.name}: parameter '{p.name}' is a concrete "
                f"{p.type_name}, which binds gradient buffers even in the forward call; pass "
                f"a tensor with gradients (requires_grad=True / .with_grads()) or declare the "
                f"parameter as the interface type I{p.type_name}"
            )
        if p.tensor_kind == "fwd":
            return fwd_tensor_struct(fn, p, value)
        return value.bind(True)
    if type(value) in PLAIN:
        return value
    return deep_bind(value)


def forward_call(fn: FunctionTarget, args: tuple, kwargs: dict) -> Any:
    """Run ``fn`` forward on pydiff values; returns what SlangPy returns, tensors wrapped."""
    if fn.module.traps:
        fn.check_traps(forward=True)  # patterns that crash even the forward kernel's build
    bound, options = bind_arguments(fn, args, kwargs)
    prepare_arguments(fn, bound, options)
    native_args = [_native_argument(fn, p, value) for p, value in bound]
    result = options.get("_result", MISSING)
    if isinstance(result, Tensor):
        check_device(fn, result, "_result")
        options["_result"] = result.bind(True)
    tape = active_tape()
    if tape is not None and isinstance(result, Tensor):
        _refuse_result_alias(fn, bound, result)
    snapshots = _snapshot_in_place(bound, tape is not None)
    # Positional: SlangPy's keyword path costs ~10 us more per call.
    try:
        out = _wrap_result(fn, fn.native(*native_args, **options), result)
    except Exception as exc:
        raise resolve_error(fn, exc) from None
    label = fn.call_label
    for i in fn.signature.written:
        value = bound[i][1]
        if type(value) is Tensor:
            value.storage.wrote(label)
            if i in snapshots:  # the values read, for this call's .bwds
                value.storage.before = (value.storage.version, snapshots[i])
    if type(out) is Tensor and out is result:
        out.storage.wrote(label)
    if tape is not None:
        _record(tape, fn, bound, options, out, snapshots)
    return out


def _refuse_result_alias(fn: FunctionTarget, bound: list, result: Tensor) -> None:
    """On a tape, ``_result=`` naming a tensor the call also reads would be an in-place
    update through the result, whose backward needs the value before the call (and two
    gradients in one buffer): refused, with the way out."""
    for p, value in bound:
        if type(value) is Tensor and p.reads_value and value.storage is result.storage:
            raise ValueError(
                f"{fn.label}: _result is the tensor passed as parameter '{p.name}' (or a view of "
                "its storage): on a tape, a call may not overwrite its own input through "
                "_result. Write to a new tensor (_result='tensor') and use that, or make the "
                f"parameter inout in the shader"
            )


def _snapshot_in_place(bound: list, recording: bool) -> dict[int, Tensor]:
    """Copies of in-place arguments taken before the call: their backward needs them (on a
    tape always; off a tape for tensors with gradient buffers, for an explicit ``.bwds``)."""
    return {
        i: value.clone()
        for i, (p, value) in enumerate(bound)
        if p.in_place
        and type(value) is Tensor
        and (p.differentiable or p.is_diff_tensor)
        and (recording or value.requires_grad)
    }


def _record(
    tape: Tape, fn: FunctionTarget, bound: list, options: dict, out: Any, snapshots: dict
) -> None:
    """Put a forward call on the tape, giving its outputs gradient buffers when needed."""
    reads, writes, values = [], [], []
    needs_grad = False
    for i, (p, value) in enumerate(bound):
        if type(value) is not Tensor:
            values.append(value)
            continue
        needs_grad = needs_grad or (p.reads_value and value.requires_grad)
        if i in snapshots:
            # The backward reads the value before the call (the copy) and adds into the
            # gradient buffers of the tensor the caller holds.
            snap = snapshots[i]
            view = with_values_of(value, snap)
            reads.append((f"parameter '{p.name}' of {fn.label}", snap))
            writes.append(value)
            values.append((view, value))
            continue
        if p.reads_value:
            reads.append((f"parameter '{p.name}' of {fn.label}", value))
        if p.writes_value:
            writes.append(value)
        values.append(value)
    if type(out) is Tensor:
        writes.append(out)
    if not needs_grad:
        return  # constants as far as gradients go
    if not fn.signature.differentiable:
        _record_cut(tape, fn, reads, writes)
        return
    for t in writes:
        if not t.requires_grad:
            t.requires_grad_(True)
    for v in values:
        if type(v) is tuple:  # in-place: the view shares the (maybe new) gradient buffers
            v[0].share_grads(v[1])
    bwd_values = tuple(v[0] if type(v) is tuple else v for v in values)
    extra = {k: v for k, v in options.items() if k != "_result"}
    if type(out) is Tensor:
        extra["_result"] = out

    def run_backward(entry: Any) -> None:
        backward_call(fn, bwd_values, dict(extra))

    tape.record(fn.label, reads, writes, run_backward)


def _record_cut(tape: Tape, fn: FunctionTarget, reads: list, writes: list) -> None:
    """A function without derivatives read a tensor that wants a gradient: its float
    outputs join the tape, so a backward that needs a gradient through them says that none
    flows (once per call site) instead of leaving the inputs' gradients silently unchanged."""
    outs = [t for t in writes if t.differentiable]
    if not outs:
        return  # integer results (indices, masks): piecewise constant, no gradient to lose
    for t in outs:
        if not t.requires_grad:
            t.requires_grad_(True)
    wanting = ", ".join(desc for desc, t in reads if t.requires_grad)

    def run_backward(entry: Any) -> None:
        warn_once(
            f"tape.backward: the gradient flows through {fn.label}, which is not "
            f"[Differentiable], so {wanting} get(s) no gradient through it. Mark it "
            f"[Differentiable] in {fn.module.file}, or pass t.detach() to say no gradient "
            "is wanted"
        )

    tape.record(fn.label, reads, writes, run_backward)
