"""The forward call of a shader function: validate, bind pydiff tensors to SlangPy, run, and
record the call on the active tape (``forward_record``), with copies of values the call
overwrites.

    y = forward_call(fn, (2.0, x), {"_result": "tensor"})
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import slangpy as spy

from .arguments import (
    MISSING,
    PLAIN,
    map_tensors,
    nested_tensors,
    bind_arguments,
    prepare_arguments,
    check_device,
    deep_bind,
    fwd_tensor_struct,
    resolve_error,
    scalar_numpy_result,
)
from .creation import empty
from .determinism import is_deterministic
from .call_shape import as_zero_d, refuse_struct_grads, tensor_result, zero_d_call
from .call_plan import DECLINED, ForwardPlan
from .plan_layout import layout_key, remember
from .bwds_checks import refuse_narrowed_result, refuse_written_struct, refuse_written_twice
from .host_values import element_base, refuse_handed_out
from .signature import FunctionTarget, ParamInfo
from .stale_reads import mark_made
from .struct_grads import bind_struct_forward
from .struct_values import read_tensors
from . import capture_refusals, foreign, generated_calls
from .forward_record import any_grad, record
from .tape import active_tape
from .tensor import Tensor


def _wrap_result(fn: FunctionTarget, native_result: Any, given: Any) -> Any:
    if isinstance(given, Tensor):
        return given
    if isinstance(native_result, spy.Tensor):
        fn.module.device.queue.allocated(native_result.storage.size)  # (SlangPy made it)
        return Tensor(native_result, fn.module.device)
    return native_result


_SCALARS = ("float", "int", "uint")  # (element types broadcast as NumPy's)


def _pooled_result(fn: FunctionTarget, bound: list, options: dict, result: Any) -> Any:
    """A new float result from pydiff's pool, as the layout's plan makes it from the second
    call on, or None (SlangPy makes it). SlangPy's own buffer has another layout, on which
    later ops take other kernels: other roundings than every later call's (the determinism
    of docs/determinism.md). Only for float elementwise calls whose shape is the arguments'
    broadcast (float, int or uint tensors at parameters of their type, numbers). Other
    results are copied into the pool in deterministic mode (forward_call), as plans make them."""
    new = result is MISSING or type(result) is str and result == "tensor"
    if not new or any(k != "_result" for k in options) or fn.signature.return_type != "float":
        return None
    shapes = []
    for p, v in bound:
        if type(v) is Tensor:
            # an element parameter of the tensor's own scalar type: elementwise, broadcast
            if p.tensor_kind is not None or p.type_name not in _SCALARS or v.dtype != p.type_name:
                return None
            shapes.append(v.shape)
        elif type(v) not in PLAIN:
            return None
    try:
        shape = np.broadcast_shapes(*shapes) if shapes else ()
    except ValueError:
        return None  # (SlangPy's call names the parameter that does not broadcast)
    return empty(shape, device=fn.module.device) if shape else None


def _native_argument(fn: FunctionTarget, p: ParamInfo, value: Any) -> Any:
    if isinstance(value, Tensor):
        check_device(fn, value, f"parameter '{p.name}'")
        refuse_struct_grads(fn.label, p, value)
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
    if p.struct_fields is not None:
        return bind_struct_forward(fn.module.device, p, value)
    return deep_bind(value)


def forward_call(fn: FunctionTarget, args: tuple, kwargs: dict) -> Any:
    """Run ``fn`` forward on pydiff values; returns what SlangPy returns, tensors wrapped."""
    key = layout_key(args, kwargs)
    plan = fn.plans.get(key)  # a layout run before (None is never a key): per-call work only
    if plan is not None:
        out = plan.run(fn, args, kwargs.get("_result", MISSING))
        if out is not DECLINED:
            if plan.on_tape and (tape := active_tape()) is not None:
                record(tape, fn, list(zip(plan.params, args)), {}, out, {}, key)
            return out
    capture_refusals.refuse_full_path(fn.label, plan is not None, "no call plan covers its layout")
    fn.module.device.queue.flush()  # kernels queued in a batched backward run first
    # Torch tensors (never in a plan's layout): torch tensors in, torch tensors out, autograd.
    if "torch" in sys.modules and (run := foreign.handler(args, kwargs)) is not None:
        return run(fn, args, kwargs)
    if fn.module.traps:
        fn.check_traps(forward=True)  # patterns that crash even the forward kernel's build
    bound, options = bind_arguments(fn, args, kwargs)
    if isinstance(options.get("_result"), (bool, int, float, np.generic)):
        _check_host_result(fn, bound, options["_result"])  # not a seed (.bwds's), refused
    prepare_arguments(fn, bound, options)
    refuse_written_twice(fn, bound, options.get("_result"), fn.label, reads=True)
    zero_d = scalar_numpy_result(fn, bound, options)  # SlangPy cannot write a 0-d array
    native_args = [_native_argument(fn, p, value) for p, value in bound]
    result = options.get("_result", MISSING)
    if isinstance(result, Tensor):
        check_device(fn, result, "_result")
        options["_result"] = result.bind(True)
    elif result is not MISSING:
        _check_host_result(fn, bound, result)
    else:
        tensor_result(fn, bound, options)  # call shape () from a whole float3 tensor: a tensor
    tape = active_tape()
    aliased = _aliased_reads(fn, bound, result)
    needs_grad = any(p.reads_value and any_grad(v) for p, v in bound)
    if tape is not None and needs_grad:
        _refuse_aliases(fn, bound, result, aliased)
        refuse_narrowed_result(fn, bound, result, f"{fn.label} on a tape")
        if fn.signature.differentiable:
            refuse_written_struct(fn, bound, f"{fn.label} on a tape")
    snapshots = _snapshot_read_values(fn, bound, aliased, tape is not None and needs_grad)
    _mark_reread(fn, bound)
    out = generated_calls.call_forward(fn, bound, options, result)
    by_slangpy = out is None  # (its result: pydiff's pool, or SlangPy's own buffer)
    if by_slangpy:
        made = _pooled_result(fn, bound, options, result)
        by_slangpy = made is None
        if made is not None:  # (a call that writes a given tensor: as it writes _result)
            options["_result"] = made.bind(True)
        # Positional: SlangPy's keyword path costs ~10 us more per call.
        try:
            out = _wrap_result(
                fn, fn.native(*native_args, **options), result if made is None else made
            )
        except Exception as exc:
            raise resolve_error(fn, exc) from None
    elif out is generated_calls.RAN:
        out = None  # (a function over a grid returning nothing: SlangPy's call gives None)
    out = out.reshape(()) if zero_d else out
    if out is not result and type(out) in (Tensor, np.ndarray) and zero_d_call(bound):
        out = as_zero_d(out)  # the (1,) views of 0-d tensors gave a (1,) result: NumPy's ()
    plan = fn.plans.get(key)  # (one there declined this call: not made again)
    new_plan = plan is None and key is not None and not zero_d
    if new_plan:
        plan = ForwardPlan.make(fn, key, bound, result, snapshots, aliased, out)
    if (
        by_slangpy
        and plan is not None
        and plan.pools
        and type(out) is Tensor
        and is_deterministic()
    ):
        # SlangPy made it, the plan's calls make it pooled (an argument _pooled_result does
        # not cover): the same values in the pool's buffer, for the same bits downstream (a
        # copy; a large call a plan declines takes it on every call: deterministic mode only)
        out = empty(out.shape, device=fn.module.device).copy_(out)
    _count_writes(fn, bound, out if type(out) is Tensor and out is result else None, snapshots)
    mark_made(fn, bound, out if type(out) is Tensor else None)  # (for .bwds: stale_reads)
    if tape is not None:
        record(tape, fn, bound, options, out, snapshots, key)
    if new_plan:
        remember(fn, fn.plans, key, plan)
    return out


def _check_host_result(fn: FunctionTarget, bound: list, result: Any) -> None:
    """A forward call's ``_result`` that is not a pydiff tensor. A number has nowhere to put
    the values (SlangPy hands it back unchanged); a NumPy array, which SlangPy writes into,
    must hold the function's values (no integers for a float result), be C-contiguous, and
    be as large as the call (else several call elements write one element: a race)."""
    if isinstance(result, (bool, int, float, np.generic)):
        raise TypeError(
            f"{fn.label}: _result={result!r}: a number as _result only seeds the result's "
            "gradient in .bwds; a forward call writes its result into _result='tensor', "
            "'numpy', or a tensor or C-contiguous array of the call's shape"
        )
    if type(result) is not np.ndarray:
        return refuse_handed_out(result, f"{fn.label}: _result")  # (x.native: ValueError)
    returns = fn.signature.return_type
    base = element_base(returns)
    if base in ("float", "half", "double") and result.dtype.kind not in "fc":
        raise TypeError(
            f"{fn.label}: _result is a NumPy array of dtype {result.dtype} but the function "
            f"returns {returns}: every value would be truncated; pass a float32 array or "
            "_result='numpy'"
        )
    if not result.flags.c_contiguous:
        raise TypeError(
            f"{fn.label}: _result is a NumPy array with strides {result.strides} (a view "
            "that is not C-contiguous), which SlangPy cannot write into; pass a contiguous "
            "array (np.empty(shape, np.float32)) or _result='numpy', then copy into the view"
        )
    # Its shape against the call's: call_shape.check_written (prepare_arguments), run before.


def _aliased_reads(fn: FunctionTarget, bound: list, result: Any) -> dict[int, str]:
    """Parameters whose values the call reads from a storage that another parameter (or
    ``_result``) of the same call writes: {index: what writes it}. Such a call overwrites an
    input it read, as an in-place parameter does."""
    writers: dict[int, list[int]] = {}  # id(storage) -> writing parameters (-1: the result)
    for j in fn.signature.written:
        v = bound[j][1]
        for t in (v,) if type(v) is Tensor else () if type(v) in PLAIN else nested_tensors(v):
            writers.setdefault(id(t.storage), []).append(j)  # or tensors in a struct's fields
    if type(result) is Tensor:
        writers.setdefault(id(result.storage), []).append(-1)
    if not writers:
        return {}
    found: dict[int, str] = {}
    for i, (p, value) in enumerate(bound):
        if type(value) in PLAIN or not p.reads_value:
            continue
        for t in (value,) if type(value) is Tensor else nested_tensors(value):
            others = [j for j in writers.get(id(t.storage), ()) if j != i]
            if others:
                j = others[0]
                found[i] = "_result" if j == -1 else f"parameter '{bound[j][0].name}'"
                break
    return found


def _refuse_aliases(fn: FunctionTarget, bound: list, result: Any, aliased: dict) -> None:
    """On a tape, a call that writes a tensor it also reads through another parameter (or
    through ``_result``) would need the value before the call, and two gradients in one
    buffer: refused, with the way out."""
    for i, what in aliased.items():
        p = bound[i][0]
        if what == "_result":
            raise ValueError(
                f"{fn.label}: _result is the tensor passed as parameter '{p.name}' (or a view "
                "of its storage): on a tape, a call may not overwrite its own input through "
                "_result. Write to a new tensor (_result='tensor') and use that, or make the "
                "parameter inout in the shader"
            )
        raise ValueError(
            f"{fn.label}: {what}, which the call writes, is the tensor passed as parameter "
            f"'{p.name}', which it reads (or a view of its storage): on a tape, a call may not "
            "overwrite its own input through another parameter. Pass a new tensor to write "
            "into and use that, or make one inout parameter read and write the value"
        )


def _snapshot_read_values(
    fn: FunctionTarget, bound: list, aliased: dict, recording: bool
) -> dict[int, Tensor]:
    """Copies taken before the call of the values it reads and overwrites (in-place
    parameters, inputs aliasing a written parameter or ``_result``): their backward reruns
    the forward on them. Taken on a tape for every such tensor of a differentiable function,
    off a tape for tensors with gradient buffers (for an explicit ``.bwds``); one copy per
    storage."""
    copies: dict[tuple, Tensor] = {}

    def copy(t: Tensor) -> Tensor:
        key = (id(t.storage), t.shape)
        if key not in copies:
            copies[key] = t.copy_values()
        return copies[key]

    out: dict[int, Any] = {}
    for i, (p, value) in enumerate(bound):
        if type(value) in PLAIN or not (p.in_place or i in aliased):
            continue
        if not (any_grad(value) or (recording and fn.signature.differentiable)):
            continue
        if type(value) is Tensor:
            out[i] = copy(value)
        elif nested_tensors(value):  # an inout struct with tensor fields: copy each
            out[i] = map_tensors(value, copy)
    return out


def _count_writes(
    fn: FunctionTarget, bound: list, result: Tensor | None, snapshots: dict[int, Tensor]
) -> None:
    """Count the call's writes, and mark storages the call read and overwrote with the
    values it read (``Storage.before``: the copy, or None when none was kept), so that an
    explicit ``.bwds`` of this call differentiates at them or refuses."""
    label = fn.call_label
    storages = set()
    for t in [bound[i][1] for i in fn.signature.written] + [result]:
        for u in (t,) if type(t) is Tensor else () if t is None else nested_tensors(t):
            u.storage.wrote(label)  # the tensor, or those in a written struct's fields
            storages.add(id(u.storage))
    if not storages:
        return
    for i, (p, value) in enumerate(bound):
        if not p.reads_value or type(value) in PLAIN:
            continue
        for key, t, kept in read_tensors(p, value, snapshots.get(i)):
            if id(t.storage) in storages:
                st = t.storage
                st.read_by_writer += (key,)
                if st.before is None or kept is not None:
                    st.before = (st.version, kept)


def _mark_reread(fn: FunctionTarget, bound: list) -> None:
    """Values this function overwrote after reading them at a parameter, read again at that
    parameter by this call: an explicit ``.bwds`` could mean either call (refused there)."""
    for p, value in bound:
        if type(value) in PLAIN:
            continue
        for key, t, _ in read_tensors(p, value, None):
            if t.storage.last_writer == fn.call_label and key in t.storage.read_by_writer:
                t.storage.reread = True  # reset if this call writes the values again
