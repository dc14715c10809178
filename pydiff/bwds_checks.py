"""Checks and buffers of a ``.bwds`` call before anything runs: the result given
positionally (as SlangPy takes it), parameters holding what the call wrote (in place, or
through another parameter or ``_result``: the values it read are used instead, or the call
is refused), an upstream gradient (of the result or a written parameter) sharing an input's
gradient buffer, written struct arguments (SlangPy cannot build their backward), tensors
that want a gradient where none flows, parameters deterministic mode must sum apart, and
the buffers a backward kernel writes forward values into.

    args, kwargs = positional_result(fn, (x, y), {})      # -> (x,), {"_result": y}
    bound = values_read(fn, bound)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import slangpy as spy

from .arguments import PLAIN, map_tensors, nested_tensors
from .backward_scope import active_scope
from .call_shape import result_type
from .grid_races import refuse_grid_races
from .view_overlap import refuse_shifted_overlap
from .creation import tensor as make_tensor
from .errors import warn_once
from .host_values import element_base
from .policy import ZeroPolicy, get_zero_policy
from .unrecorded import warn_made_off_tape
from .signature import FunctionTarget, ParamInfo, field_at
from .stale_reads import refuse_stale_reads
from .storage import allocate
from .struct_values import field_tensors
from .tensor import Tensor


def primal_sink(device: Any, t: Tensor) -> spy.Tensor:
    """Where a backward kernel may write forward values nobody reads (per shape and dtype)."""
    key = (t.shape, t.element_type.full_name, "primal sink")
    if key not in device.scratch:
        device.scratch[key] = allocate(device, t.bind(False, False).shape, t.element_type)
    return device.scratch[key]


def upstream_arg(device: Any, t: Tensor, flush: bool = True) -> spy.Tensor:
    """A result tensor with gradient buffers as ``.bwds`` binds it: its buffers on a primal
    sink (the upstream gradient is read from ``grad_in``, nothing reads the values);
    ``flush=False`` for a call deferred after pending work (``Tensor.bind``)."""
    return t.bind_upstream(lambda: primal_sink(device, t), flush)


def half_seed(label: str, device: Any, shape: tuple | None, value: float) -> spy.Tensor:
    """A number seeding a half result of ``.bwds``: SlangPy's diffPair holds no half, so a
    half tensor of the call's ``shape`` carries the seed."""
    if shape is None:
        raise TypeError(
            f"{label}.bwds: a number as _result of a half function needs the call's "
            "shape, which pydiff cannot tell from these arguments; pass the result as a "
            "half tensor with gradients (y.with_grads(ones=True))"
        )
    seed = make_tensor(np.full(shape, value), dtype="half", device=device)
    return primal_sink(device, seed).with_grads(
        grad_in=seed.native, grad_out=seed.native, zero=False
    )


def warn_no_gradient(fn: FunctionTarget, p: ParamInfo, t: Tensor) -> None:
    """A tensor that wants a gradient, bound where none flows: say so once per call site."""
    if not t.requires_grad:
        return
    why = "no_diff" if p.no_diff or p.no_diff_tensor else f"a {p.type_name} (not differentiable)"
    what = (
        "no gradient flows back through what the call stores there (its upstream is not read)"
        if p.no_diff_tensor and p.access in ("write", "read_write")
        else "its gradient stays unchanged"
    )
    warn_once(
        f"{fn.label}: parameter '{p.name}' is {why}, so .bwds gives it no gradient, but the "
        f"tensor passed requires one: {what}. Pass t.detach() to say no gradient is wanted, "
        "or make the parameter differentiable (drop no_diff; a float type; a DiffTensor)"
    )


def values_read(fn: FunctionTarget, bound: list) -> list:
    """A parameter whose values this function's latest forward call read and then overwrote
    (in place, or through another parameter or ``_result``): ``.bwds`` differentiates at the
    values the call read, kept by the forward call (``Storage.before``); without that copy,
    refused. Tensors in a struct argument's fields (nested too) alike, each by its path."""
    out = []
    for p, value in bound:
        if type(value) is Tensor and p.reads_value:
            value = _value_read(fn, p, value, p.name)
        elif p.reads_value and type(value) not in PLAIN and not p.writes_value:
            found = field_tensors(p, value)
            read = [
                _value_read(fn, field_param(p, path), t, f"{p.name}.{path}") for path, t in found
            ]
            if any(a is not b for a, (_, b) in zip(read, found)):
                each = iter(read)
                value = map_tensors(value, lambda t: next(each))
        out.append((p, value))
    return out


def field_param(p: ParamInfo, path: str) -> ParamInfo:
    """``p`` as the errors name the struct field at ``path``: 'p.inner.a' (its type)."""
    field = field_at(p, path)
    type_name = field.type_name if field is not None else p.type_name
    return dataclasses.replace(p, name=f"{p.name}.{path}", type_name=type_name)


def _value_read(fn: FunctionTarget, p: ParamInfo, value: Tensor, key: str) -> Tensor:
    """``value``, or its gradient buffers on the values the forward call read (see
    ``values_read``); ``key``: the parameter, or 'p.a' for a struct field."""
    st = value.storage
    kept = st.before
    if (
        kept is not None
        and kept[0] == st.version
        and st.last_writer == fn.call_label
        and key in st.read_by_writer  # not a later call's read at another one
    ):
        if st.reread:
            raise ValueError(_read_again(fn, p))
        if kept[1] is None or kept[1].shape != value.shape:
            raise ValueError(_overwritten(fn, p, value))
        return with_values_of(value, kept[1])
    if fn.call_label in st.written_over and p.writes_value:
        raise ValueError(_written_over(fn, p, st.last_writer))
    return value


def _written_over(fn: FunctionTarget, p: ParamInfo, writer: str) -> str:
    return (
        f"{fn.bwds_label}: parameter '{p.name}' ({p.type_name}) was read and overwritten in "
        f"place by {fn.call_label}, then written again by {writer}: the values the call read "
        "are gone (and some of those it wrote may remain), so .bwds cannot tell at which "
        "values to differentiate. Keep a copy before the call (before = "
        f"{p.name}.clone()) and pass it to .bwds, record the calls on a pydiff.Tape, or set "
        f"new values from the host ({p.name}.copy_from_numpy(...)) to differentiate there"
    )


def _overwritten(fn: FunctionTarget, p: ParamInfo, t: Tensor) -> str:
    grads = (
        "Give the tensor gradient buffers before the call (requires_grad=True / "
        ".with_grads()), record the call on a pydiff.Tape, or keep"
        if t.differentiable
        else "Record the call on a pydiff.Tape, or keep"
    )
    return (
        f"{fn.bwds_label}: parameter '{p.name}' ({p.type_name}) was overwritten by "
        f"{fn.call_label}, so it holds the value the call wrote, not the value it read, and "
        ".bwds would differentiate at the wrong point (off a tape, pydiff keeps the value read "
        "only for tensors that had gradient buffers at the call, of the shape passed here). "
        f"{grads} a copy before the call (before = {p.name}.clone()) and pass it to .bwds"
    )


def _read_again(fn: FunctionTarget, p: ParamInfo) -> str:
    return (
        f"{fn.bwds_label}: parameter '{p.name}' holds values that {fn.call_label} read and "
        f"then overwrote, and a later {fn.call_label} read them again at '{p.name}': .bwds "
        "cannot tell which of the two calls it differentiates. Keep a copy of the values each "
        f"call read (before = {p.name}.clone()) and pass it to .bwds, or record the calls on "
        "a pydiff.Tape"
    )


def with_values_of(t: Tensor, before: Tensor) -> Tensor:
    """``t``'s gradient buffers (and policy) on the values of ``before``, a copy taken before
    an in-place call: what that call's backward reads."""
    return Tensor(
        before.native_view(),
        t.device,
        t.grad_in,
        t.grad_out,
        storage=before.storage,
        zero_policy=t.zero_policy,
    )


def refuse_shared_result_grad(fn: FunctionTarget, bound: list, result: Any) -> None:
    """An upstream gradient (of the result, or of a parameter the call writes) and another
    parameter's gradient in one buffer: the backward would add that input's gradient to the
    upstream it reads (a call writing its own input through _result or another parameter)."""
    upstream = [(f"parameter '{p.name}'", i, v) for i, (p, v) in enumerate(bound) if p.writes_value]
    upstream.append(("_result", -1, result))
    for what, j, w in upstream:
        if type(w) is not Tensor or w.grad_in is None:
            continue
        for i, (p, value) in enumerate(bound):
            if i == j or not p.reads_value or type(value) in PLAIN:
                continue
            for field, t in [("", value)] if type(value) is Tensor else field_tensors(p, value):
                if t.grad_out is None or t.grad_out.storage is not w.grad_in.storage:
                    continue
                at = f", field '{field}'" if field else ""
                raise ValueError(
                    f"{fn.bwds_label}: {what}'s gradient buffer is also the gradient buffer of "
                    f"parameter '{p.name}'{at} (the call wrote its input through {what}?): the "
                    "input's gradient would be added to the upstream gradient it is computed "
                    "from. Pass the written tensor and the input with gradient buffers of their "
                    "own (x.with_grads(...))"
                )
    _refuse_read_gradient(fn, bound)
    _refuse_read_reset(fn, bound)


def reads_a_gradient(values: tuple, result: Any) -> bool:
    """Whether a tensor among ``values`` (a recorded call's, as its backward gets them) is
    (a view of) a gradient buffer of one of them or of ``result``: its backward may then be
    refused for the aliasing (read under RESET, read while added into, added into its own
    upstream), whatever layout ran before, so a tape keeps the gradients (``may_refuse``)."""
    tensors = [t for v in (*values, result) for t in nested_tensors(v)]
    grads = {id(g) for t in tensors for g in t.grad_storages() if g is not None}
    return bool(grads) and any(id(t.storage) in grads for t in tensors)


def _refuse_read_reset(fn: FunctionTarget, bound: list) -> None:
    """A tensor the call reads that is the gradient buffer the RESET policy clears before
    this backward adds into it (``f.bwds(x, x.grad)``): the call would read zeros, a silent
    0 for what depends on them. (Under ACCUMULATE each element is read and added by one
    thread: kept.)"""
    resets: dict[int, str] = {}
    scope = active_scope()  # (an enclosing backward: a buffer it reset already is not again)
    for p, v in bound:
        if type(v) is Tensor and p.differentiable and (g := v.grad_out) is not None:
            if (v.zero_policy or get_zero_policy()) is ZeroPolicy.RESET and not (
                scope is not None and scope.applied(g)
            ):
                resets.setdefault(id(g.storage), p.name)
    for p, v in bound if resets else ():
        if type(v) is Tensor and p.reads_value and id(v.storage) in resets:
            raise ValueError(
                f"{fn.bwds_label}: parameter '{p.name}' reads the gradient buffer of parameter "
                f"'{resets[id(v.storage)]}', which the RESET zeroing policy clears before this "
                "backward adds into it: the call would read zeros. Pass a copy "
                f"({p.name}.copy_values()) or run it under another zeroing policy"
            )


def _refuse_read_gradient(fn: FunctionTarget, bound: list) -> None:
    """A tensor the call reads that is (a view of) the gradient buffer an interface tensor
    parameter's gradient is added into during the kernel: threads would read values other
    threads are adding to (a race: a wrong gradient, silently)."""
    adds: dict[int, str] = {}
    for p, v in bound:
        if type(v) is Tensor and p.tensor_kind in ("idiff", "diff") and p.reads_value:
            direct = p.access == "read" or v.grad_in is not v.grad_out  # (one buffer: a new
            if v.grad_out is not None and not p.no_diff_tensor and direct:  # one, copied after)
                adds.setdefault(id(v.grad_out.storage), p.name)
    for p, v in bound:
        if adds and type(v) is Tensor and p.reads_value and id(v.storage) in adds:
            raise ValueError(
                f"{fn.bwds_label}: parameter '{p.name}' reads a tensor that is (a view of) the "
                f"gradient buffer of parameter '{adds[id(v.storage)]}', which the backward "
                "adds into while its threads read it: the gradients would depend on the "
                f"order the threads run in. Pass a copy ({p.name}.clone()) or give the tensor "
                "a gradient buffer of its own (x.with_grads())"
            )


def bwds_arguments_checked(fn: FunctionTarget, bound: list, result: Any) -> None:
    """``.bwds``'s checks of its arguments as given: written struct arguments and written
    parameters on one storage refused; copies made off a tape from tensors that want a
    gradient (``x[:, 1:]``, ``x.T``) warned; a ``_result`` no upstream can be refused first
    (the forward call's refusals of such values would name no upstream)."""
    if isinstance(result, (str, list, tuple, dict, set, bytes, complex, bool, type)):
        raise TypeError(
            f"{fn.bwds_label}: _result must be a pydiff.Tensor with gradients, a number or a "
            f"slangpy.diffPair, not {type(result).__name__}; e.g. "
            "pydiff.tensor(upstream).with_grads() and copy the upstream into its .grad"
        )
    refuse_written_struct(fn, bound, fn.bwds_label)
    refuse_written_twice(fn, bound, result, fn.bwds_label)
    refuse_narrowed_result(fn, bound, result, fn.bwds_label)
    refuse_stale_reads(fn, bound, result)  # inputs written since the call that made result
    for p, value in bound:
        if type(value) is not Tensor or value.grad_out is not None or not p.differentiable:
            continue
        warn_made_off_tape(fn, p.name, value)


_FLOAT_BITS = {"half": 16, "float": 32, "double": 64}


def refuse_narrowed_result(fn: FunctionTarget, bound: list, result: Any, where: str) -> None:
    """Refuse a float ``_result`` tensor narrower than the function's float result (a half
    tensor for a float function) where the result gets gradients: ``.bwds`` and a call a
    tape records. Its values would be stored rounded while the backward differentiates the
    unrounded ones, and their gradient held in half (nothing below 6e-8: flushed to 0).
    Off a tape a forward call narrows, as torch's ``out=`` does (torch refuses ``out=``
    under autograd).

    >>> refuse_narrowed_result(fn, bound, y_half, "m.f.bwds")   # TypeError for a float f
    """
    if type(result) is not Tensor:
        return
    returns = result_type(fn, bound)
    want, got = element_base(returns), element_base(result.element_type.full_name)
    if want not in _FLOAT_BITS or got not in _FLOAT_BITS or _FLOAT_BITS[got] >= _FLOAT_BITS[want]:
        return
    raise TypeError(
        f"{where}: _result is a {result.dtype} tensor but the function returns {returns}, "
        f"and the result gets gradients here: its values would be rounded to {got} while the "
        f"backward differentiates the {want} values, and its gradient held in {got} (small "
        f"gradients flush to 0). Pass a {want} tensor as _result (or none), then convert "
        f"with .astype({got!r}), which a tape records with its gradient; off a tape and "
        "without .bwds a forward call may write into a narrower tensor"
    )


def refuse_stale(scope: Any, fn: FunctionTarget, bound: list) -> None:
    """The STRICT policy's refusals for the buffers ``.bwds`` adds the gradients of its
    ``in`` parameters into, all before the call's policies change any (RESET zeroing)."""
    for p, v in bound:
        if type(v) is Tensor and p.differentiable and p.io == "in" and v.grad_out is not None:
            scope.check_stale(v, v.grad_out, f"{fn.label}: parameter '{p.name}'")
        elif type(v) not in PLAIN and p.io == "in":
            for path, t in field_tensors(p, v):  # (those struct_grads adds gradients into)
                field = field_at(p, path)
                if t.grad_out is None or field is None:
                    continue
                flows = p.differentiable and path.split(".")[0] not in p.no_grad_fields
                if field.tensor_kind is None and not flows:
                    continue
                if field.tensor_kind is not None and not (
                    field.diff_tensor and field.access == "read"
                ):
                    continue
                where = f"{fn.label}: parameter '{p.name}', field '{path}'"
                scope.check_stale(t, t.grad_out, where)


def refuse_written_twice(
    fn: FunctionTarget, bound: list, result: Any, where: str, reads: bool = False
) -> None:
    """Two written parameters (``out``/``inout``, or one and ``_result``) on one storage: the
    call keeps the last write, its backward adds the gradients of both (wrong): the forward
    call and ``.bwds`` refuse it, naming both (``IRWDiffTensor``s: ``refuse_shared_result_grad``;
    ``reads``, the forward call's: grid_races' and view_overlap's checks too)."""
    if reads:
        refuse_grid_races(fn, bound, where)
        refuse_shifted_overlap(fn, bound, result, where)
    seen: dict[int, tuple[str, bool]] = {}
    written = [(bound[j][0], bound[j][1]) for j in fn.signature.written]
    for p, value in written + [(None, result)]:
        what = "_result" if p is None else f"parameter '{p.name}'"
        whole = p is None or p.tensor_kind is None  # writes every element it is given
        for t in nested_tensors(value):  # (or those in a written struct's fields)
            other, other_whole = seen.setdefault(id(t.storage), (what, whole))
            if other != what and (whole or other_whole):
                raise ValueError(
                    f"{where}: {other} and {what} are the same tensor (or views of one "
                    f"storage, shape {t.shape}), and the call writes both: only the last "
                    "write is kept, while the backward would add the gradients of both "
                    "outputs into what it reads. Pass a tensor of its own to each written "
                    "parameter"
                )


def refuse_written_struct(fn: FunctionTarget, bound: list, where: str) -> None:
    """A struct argument (a dict) the call writes (``out``/``inout``): SlangPy 0.43's
    backward of it fails inside its generated code, so it is refused first, with the fix."""
    for p, value in bound:
        if p.writes_value and isinstance(value, dict):
            raise TypeError(
                f"{where}: parameter '{p.name}' is an {p.io} {p.type_name} given as a dict (a "
                "struct the call writes): SlangPy 0.43 cannot build the backward of a function "
                "that writes a struct argument (its generated code fails to compile). Return "
                "the struct as the function's result instead, or write each field through an "
                "out/inout parameter (or a tensor) of its own"
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


_GENERATED_ARGS = {"GridArg", "CallIdArg", "ThreadIdArg", "WangHashArg", "RandFloatArg"}


def maybe_broadcast(bound: list, result: Any) -> list[str]:
    """When pydiff cannot tell a call's shape, the vectorised inputs that may be broadcast
    (smaller than another argument, or beside a grid/call-id argument): their gradients may
    be added with float atomics, which deterministic mode must not keep quiet about."""
    tensors = [v for _, v in bound if type(v) is Tensor] + (
        [result] if type(result) is Tensor else []
    )
    largest = max(
        [t.numel for t in tensors] + [v.size for _, v in bound if isinstance(v, np.ndarray)],
        default=0,
    )
    generated = any(type(v).__name__ in _GENERATED_ARGS for _, v in bound)
    found = []
    for p, v in bound:
        if (
            type(v) is Tensor
            and p.tensor_kind is None
            and p.differentiable
            and v.requires_grad
            and (generated or v.numel < largest)
        ):
            found.append(
                f"pydiff cannot tell the shape of this call (a grid without a fixed shape, a "
                f"struct argument, or a tensor whose element type pydiff cannot match to its "
                f"parameter's), so parameter '{p.name}' may be "
                "broadcast and its gradient added with float atomics; pass tensors whose dtype "
                "matches each parameter (e.g. dtype='float3') to let pydiff sum it in order"
            )
    return found


def shared_grads(bound: list) -> set[int]:
    """Gradient buffers that more than one parameter of this call adds into: their atomic
    adds to one element would meet in any order, so each gets a buffer of its own."""
    seen: set[int] = set()
    shared: set[int] = set()
    for p, value in bound:
        if type(value) is Tensor and value.grad_out is not None and p.writes_gradient:
            key = id(value.grad_out.storage)
            (shared if key in seen else seen).add(key)
    return shared
