"""Forward calls and ``.bwds``: bind pydiff tensors to a SlangPy call, validating first.

Everything SlangPy 0.43 leaves to the user, or gets silently wrong, is handled here: which
gradient buffers each parameter needs, scratch buffers for inputs that need no gradient,
separate grad_in/grad_out for values a call both reads and writes, the ``inout`` backward
(through a generated wrapper), zeroing policies and plain numbers as upstream gradients.

    y = forward_call(fn, (2.0, x), {"_result": "tensor"})
    backward_call(fn, (2.0, x), {"_result": y})
"""

from __future__ import annotations

import difflib
from typing import Any

import numpy as np
import slangpy as spy

from . import broadcast_grad
from .determinism import is_deterministic, warn_nondeterministic
from .fixed_point import FixedPointAccumulator, dummy_fields
from .params import ParamInfo
from .policy import BackwardScope, ZeroPolicy, _active_scope, backward_scope, get_zero_policy
from .tape import _active_tape
from .tensor import Tensor, copy_tensor, new_native

_MISSING = object()
_PLAIN = (float, int, bool)
_SCALAR_RESULTS = {"float", "half", "double"}


def _bind(fn: Any, args: tuple, kwargs: dict) -> tuple[list[tuple[ParamInfo, Any]], dict]:
    """Match arguments to parameters by position and name; ``_``-options are returned apart."""
    params = fn.params
    if len(args) == len(params) and all(k[0] == "_" for k in kwargs):
        return list(zip(params, args)), dict(kwargs)  # the common, all-positional call
    options = {k: v for k, v in kwargs.items() if k.startswith("_")}
    named = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    label = fn.label
    if len(args) > len(params):
        raise TypeError(f"{label}() takes {len(params)} arguments but {len(args)} were given")
    values: dict[str, Any] = {p.name: a for p, a in zip(params, args)}
    by_name = {p.name: p for p in params}
    for key, value in named.items():
        if key not in by_name:
            close = difflib.get_close_matches(key, list(by_name), n=2)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{label}() has no parameter {key!r}{hint}")
        if key in values:
            raise TypeError(f"{label}() got two values for parameter {key!r}")
        values[key] = value
    missing = [p.name for p in params if p.name not in values]
    if missing:
        raise TypeError(f"{label}() is missing argument(s): {', '.join(missing)}")
    return [(p, values[p.name]) for p in params], options


def _check_device(fn: Any, t: Tensor, where: str) -> None:
    if t._device is not fn.module._device and t._device != fn.module._device:
        raise ValueError(
            f"{fn.module.name}.{fn.name}: {where} is on device {t.device!r} but the module was "
            f"loaded on {fn.module.device!r}; create the tensor on the module's device"
        )


def _deep_native(value: Any) -> Any:
    """Replace pydiff tensors inside dicts/lists (struct arguments) by SlangPy tensors."""
    if isinstance(value, Tensor):
        return value._as_native(True)
    if isinstance(value, dict):
        return {k: _deep_native(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (Tensor, dict, list)) for v in value):
        return type(value)(_deep_native(v) for v in value)
    return value


def scratch(device: Any, t: Tensor, role: str) -> spy.Tensor:
    """Device-wide scratch tensors shaped like ``t``: 'zeros' (read, never written) or 'sink'
    (written, never read). Shared per shape and dtype."""
    key = (t.shape, t._native.dtype.full_name, role)
    pool = device.scratch
    if key not in pool:
        pool[key] = new_native(device, t._native.shape, t._grad_dtype(), zero=role == "zeros")
    return pool[key]


def fwd_tensor_struct(fn: Any, p: ParamInfo, t: Tensor, tangent: Any = None,
                      grad_in: Any = None, grad_out: dict | None = None) -> dict:
    """The fields of pydiff's FwdDiffTensor<N> / RWFwdDiffTensor<N> for a pydiff tensor;
    ``grad_out`` is a FixedPointGrad's fields (FixedPointAccumulator.fields())."""
    if t.dtype != "float" or len(t.shape) != p.fwd_dims:
        raise ValueError(
            f"{fn.label}: parameter '{p.name}' is a {p.type_name}, which takes a float tensor with "
            f"exactly {p.fwd_dims} dimension(s); got dtype {t.dtype} and shape {t.shape} (SlangPy "
            "cannot vectorise over this struct: index the extra dimensions inside the function)"
        )
    dev = fn.module.device
    return {
        "primal": t._native,
        "tangent": tangent if tangent is not None else scratch(dev, t, "zeros"),
        "grad_in": grad_in if grad_in is not None else scratch(dev, t, "zeros"),
        "grad_out": grad_out if grad_out is not None else dummy_fields(dev),
    }


def _wrap_result(fn: Any, native_result: Any, given: Any) -> Any:
    if isinstance(given, Tensor):
        return given
    if isinstance(native_result, spy.Tensor):
        return Tensor(native_result, fn.module.device)
    return native_result


def forward_call(fn: Any, args: tuple, kwargs: dict) -> Any:
    bound, options = _bind(fn, args, kwargs)
    native_args: list[Any] = []
    for p, value in bound:
        if isinstance(value, Tensor):
            _check_device(fn, value, f"parameter '{p.name}'")
            if p.tensor_kind == "diff" and not value.requires_grad:
                raise ValueError(
                    f"{fn.module.name}.{fn.name}: parameter '{p.name}' is a concrete "
                    f"{p.type_name}, which binds gradient buffers even in the forward call; pass "
                    f"a tensor with gradients (requires_grad=True / .with_grads()) or declare the "
                    f"parameter as the interface type I{p.type_name}"
                )
            if p.tensor_kind == "fwd":
                native_args.append(fwd_tensor_struct(fn, p, value))
                continue
            native_args.append(value._as_native(True))
        elif type(value) in _PLAIN:
            native_args.append(value)
        else:
            native_args.append(_deep_native(value))
    result = options.get("_result", _MISSING)
    if isinstance(result, Tensor):
        _check_device(fn, result, "_result")
        options["_result"] = result._as_native(True)
    tape = _active_tape.get()
    snapshots = _snapshot_in_place(fn, bound) if tape is not None else None
    # Positional: SlangPy's keyword path costs ~10 us more per call.
    try:
        out = _wrap_result(fn, fn.native(*native_args, **options), result)
    except Exception as exc:
        raise _resolve_error(fn, exc) from None
    for i in fn._written_params:
        value = bound[i][1]
        if type(value) is Tensor:
            value._state.wrote(fn._call_label)
    if type(out) is Tensor and out is result:
        out._state.wrote(fn._call_label)
    if tape is not None:
        _record(tape, fn, bound, options, out, snapshots)
    return out


def _resolve_error(fn: Any, exc: Exception) -> Exception:
    """SlangPy's overload-resolution report lists every candidate (hundreds of lines for a
    name shared with a Slang builtin); keep its head and say what to do."""
    if type(exc).__name__ != "ResolveException":
        return exc
    lines = str(exc).splitlines()
    head = "\n".join(lines[:12])
    more = f"\n... ({len(lines) - 12} more lines of SlangPy's report)" if len(lines) > 12 else ""
    hint = ""
    if sum(1 for ln in lines[:60] if f" {fn.name}(" in ln) > 3:
        hint = (f"\nHint: '{fn.name}' is also the name of Slang built-in functions, which SlangPy "
                "cannot tell apart from yours; rename your function.")
    return TypeError(f"{fn.label}: SlangPy could not match the arguments to the function:\n"
                     f"{head}{more}{hint}")


def _snapshot_in_place(fn: Any, bound: list) -> dict[int, Tensor]:
    """Copies of in-place arguments taken before the call: their backward needs them."""
    return {
        i: value.clone()
        for i, (p, value) in enumerate(bound)
        if p.in_place and type(value) is Tensor and (p.differentiable or p.is_diff_tensor)
    }


def _record(tape: Any, fn: Any, bound: list, options: dict, out: Any, snapshots: dict) -> None:
    """Put a forward call on the tape, giving its outputs gradient buffers when needed."""
    reads, writes, values = [], [], []
    needs_grad = False
    for i, (p, value) in enumerate(bound):
        if type(value) is not Tensor:
            values.append(value)
            continue
        needs_grad = needs_grad or (p.reads_value and value.requires_grad)
        if i in snapshots:
            snap = snapshots[i]
            view = Tensor(snap._native, value._device, value._grad_in, value._grad_out,
                          _state=snap._state, zero_policy=value._zero_policy)
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
    if not fn._differentiable or not needs_grad:
        return  # constants as far as gradients go
    for t in writes:
        if not t.requires_grad:
            t.requires_grad_(True)
    for v in values:
        if type(v) is tuple:  # in-place: the view shares the (maybe new) gradient buffers
            v[0]._grad_in, v[0]._grad_out = v[1]._grad_in, v[1]._grad_out
    bwd_values = tuple(v[0] if type(v) is tuple else v for v in values)
    extra = {k: v for k, v in options.items() if k != "_result"}
    if type(out) is Tensor:
        extra["_result"] = out

    def run_backward(entry: Any) -> None:
        backward_call(fn, bwd_values, dict(extra))

    tape.record(fn.label, reads, writes, run_backward)


class _Backward:
    """Builds the native arguments of one ``.bwds`` call and the work to do after it."""

    def __init__(self, fn: Any, scope: BackwardScope):
        self.fn = fn
        self.scope = scope
        self.label = fn.label
        self.after: list[tuple[Tensor, Tensor]] = []  # (temp gradient, destination) copies
        self.no_grad: list[str] = []  # vectorised parameters bound without a gradient
        self.device = fn.module.device
        self.shape: tuple[int, ...] | None = None  # the call's shape, when pydiff can tell
        self.separate: set[int] = set()  # grad buffers several parameters add into
        self.reductions: list[tuple[spy.Tensor, Tensor]] = []  # (full-shape grad, parameter)
        self.fixed: list[tuple[FixedPointAccumulator, spy.Tensor]] = []  # (words, add into)
        self.untracked: list[str] = []  # deterministic mode: gradients left to float atomics

    def _scratch(self, t: Tensor, role: str) -> spy.Tensor:
        """Gradient buffers for a tensor whose gradient nobody asked for."""
        return scratch(self.device, t, role)

    def _desc(self, p: ParamInfo) -> str:
        return f"{self.label}: parameter '{p.name}'"

    def _accumulating(self, t: Tensor, p: ParamInfo) -> None:
        grad = t._grad_out
        if grad._shape != t._shape:
            raise ValueError(f"{self._desc(p)}: gradient shape {grad.shape} != primal {t.shape}")
        self.scope.before_accumulate(t, grad, self._desc(p))

    def _needs_upstream(self, t: Tensor, p: ParamInfo, what: str) -> None:
        if not t.requires_grad:
            raise ValueError(
                f"{self._desc(p)} is {what} by the call, so its backward reads the upstream "
                f"gradient from the tensor's grad buffer, but the tensor has none; pass "
                f"t.with_grads(...) holding dL/d{p.name} (or ones: .with_grads(ones=True))"
            )

    def _separate(self, t: Tensor, p: ParamInfo) -> spy.Tensor:
        """Bind a read-and-written tensor with distinct grad_in and grad_out buffers."""
        if not t.requires_grad:
            return t._native.with_grads(
                grad_in=self._scratch(t, "zeros"), grad_out=self._scratch(t, "sink"), zero=False
            )
        if t.grad_in is not t.grad_out:
            self._accumulating(t, p)
            return t._as_native(True)
        # One shared buffer: it holds the upstream gradient now and must hold the gradient
        # w.r.t. the value before the call afterwards.
        upstream = t.grad_in
        result = t._new_grad_buffer()
        self.after.append((result, upstream))
        return t._native.with_grads(grad_in=upstream._native, grad_out=result._native, zero=False)

    def tensor_arg(self, p: ParamInfo, t: Tensor) -> spy.Tensor:
        _check_device(self.fn, t, f"parameter '{p.name}'")
        if p.tensor_kind == "plain" or (p.tensor_kind is None and not p.differentiable):
            return t._native
        if p.tensor_kind == "diff" and not t.requires_grad:
            raise ValueError(
                f"{self._desc(p)} is a concrete {p.type_name}: it needs a tensor with gradient "
                f"buffers (requires_grad=True / .with_grads()); SlangPy would bind a null "
                f"descriptor. For data that needs no gradient use I{p.type_name}"
            )
        if p.io == "out" or p.access == "write":
            self._needs_upstream(t, p, "written")
            return t._as_native(True)
        if p.access == "read_write":
            return self._separate(t, p)
        if not t.requires_grad:
            if p.tensor_kind is None:
                # A vectorised value with no gradient wanted: bind the primal alone, and
                # make that part of the kernel's identity (SlangPy's call cache is blind to
                # gradients and would reuse the wrong kernel for a later call).
                self.no_grad.append(p.name)
                return t._native
            # Interface diff tensors need a gradient buffer on Vulkan/D3D12: a throwaway one.
            sink = self._scratch(t, "sink")
            return t._native.with_grads(grad_in=sink, grad_out=sink, zero=False)
        self._accumulating(t, p)
        if p.tensor_kind is None and p.differentiable:
            return self._vectorised_grad(p, t)
        return t._as_native(True)

    def _vectorised_grad(self, p: ParamInfo, t: Tensor) -> spy.Tensor:
        """Bind a vectorised input's gradient: a full-shape buffer summed after the call when
        the value is broadcast (or, in deterministic mode, shared with another parameter)."""
        broadcast = broadcast_grad.is_broadcast(t, self.shape)
        shared = t._grad_out._storage_key() in self.separate
        if not (broadcast or shared):
            return t._as_native(True)
        if t._grad_out.dtype not in broadcast_grad.EXPANDABLE:
            self.untracked.append(
                f"the gradient of parameter '{p.name}' ({t.dtype}, broadcast or shared) is added "
                f"with float atomics: pydiff sums only {'/'.join(broadcast_grad.EXPANDABLE)} "
                "gradients itself; pass a full-shape tensor and sum it with pydiff.ops.sum"
            )
            return t._as_native(True)
        native = broadcast_grad.expand(
            self.scope, self.device, t, self.shape if broadcast else t.shape, len(self.reductions))
        self.reductions.append((native.grad_out, t))
        return native

    def fwd_arg(self, p: ParamInfo, t: Tensor) -> dict:
        """pydiff's FwdDiffTensor: gradients go to a fixed-point accumulator, added into the
        gradient buffer SlangPy would have used after the call."""
        bound = self.tensor_arg(p, t)
        acc = FixedPointAccumulator(
            self.scope, self.device, t.numel, self._desc(p), len(self.fixed), t.requires_grad)
        if t.requires_grad:
            self.fixed.append((acc, bound.grad_out))
        return fwd_tensor_struct(self.fn, p, t, None, bound.grad_in, acc.fields())

    def after_call(self) -> None:
        """Sum the full-shape and fixed-point gradients into their buffers (in order)."""
        for acc, grad in self.fixed:
            acc.add_into(grad)
        for full, t in self.reductions:
            broadcast_grad.reduce_into(self.scope, self.device, full, t)

    def inout_args(self, p: ParamInfo, value: Any) -> dict[str, Any]:
        """The two wrapper arguments (value before, value after) for an ``inout`` parameter."""
        if not isinstance(value, Tensor):
            return {f"{p.name}__in": _deep_native(value), f"{p.name}__out": _deep_native(value)}
        _check_device(self.fn, value, f"parameter '{p.name}'")
        both = self._separate(value, p)
        return {
            f"{p.name}__in": value._native.with_grads(
                grad_in=both.grad_out, grad_out=both.grad_out, zero=False
            ),
            f"{p.name}__out": value._native.with_grads(
                grad_in=both.grad_in, grad_out=both.grad_in, zero=False
            ),
        }

    def result_arg(self, result: Any) -> Any:
        ret_name = self.fn._ret_name
        if type(result) is Tensor and result._grad_in is not None:
            if result._device is not self.device:
                _check_device(self.fn, result, "_result")
            return result._as_native(True)
        if result is _MISSING:
            if ret_name == "void":
                return _MISSING
            raise ValueError(
                f"{self.label}.bwds needs _result=: the upstream gradient of its {ret_name} "
                "result, as the result tensor with gradients (y.with_grads(ones=True)) or a number"
            )
        if isinstance(result, Tensor):
            _check_device(self.fn, result, "_result")
            if not result.requires_grad:
                raise ValueError(
                    f"{self.label}.bwds: _result has no gradient buffer to read the upstream "
                    "gradient from; pass y.with_grads(...) holding dL/dy (or .with_grads(ones=True))"
                )
            return result._as_native(True)
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            if ret_name not in _SCALAR_RESULTS:
                raise TypeError(
                    f"{self.label}.bwds: a number as _result seeds a scalar result, but the "
                    f"result is {ret_name}; pass a tensor with gradients"
                )
            # SlangPy reads a plain float as the primal and seeds a zero gradient.
            return spy.diffPair(p=0.0, d=float(result))
        if isinstance(result, spy.DiffPair):
            return result
        # NumPy arrays and raw SlangPy tensors are silently read as zero gradients by SlangPy.
        raise TypeError(
            f"{self.label}.bwds: _result must be a pydiff.Tensor with gradients, a number or a "
            f"slangpy.diffPair, not {type(result).__name__}; e.g. "
            "pydiff.tensor(upstream).with_grads() and copy the upstream into its .grad"
        )

    def finish(self) -> None:
        for temp, dest in self.after:
            self.scope.flush()
            copy_tensor(dest, temp)
            self.scope.mark_result(dest)


def _fast_backward(fn: Any, bound: list, options: dict, result: Any) -> bool:
    """The common case without the general machinery: gradients simply added under the
    ACCUMULATE policy, outside any larger backward. Returns False to take the general path."""
    if _active_scope.get() is not None or get_zero_policy() is not ZeroPolicy.ACCUMULATE:
        return False
    if is_deterministic():
        return False
    dev = fn._module._device
    native_args = []
    written = []
    shape = result._shape if type(result) is Tensor else None
    for p, value in bound:
        if type(value) is Tensor:
            if value._device is not dev:
                return False
            if p.tensor_kind is None:
                if shape is None:
                    shape = value._shape
                elif value._shape != shape:
                    return False  # maybe broadcast: its gradient is summed apart
            if p.differentiable and p.io == "in" and p.tensor_kind is None:
                grad = value._grad_out
                if grad is None or value._zero_policy is not None:
                    return False
                written.append(grad)
                native_args.append(value._as_native(True))
            elif p.tensor_kind == "plain" or (p.tensor_kind is None and not p.differentiable):
                native_args.append(value._native)
            else:
                return False
        elif type(value) in _PLAIN:
            native_args.append(value)
        else:
            return False
    if type(result) is Tensor and result._grad_in is not None and result._device is dev:
        options["_result"] = result._as_native(True)
    elif not (result is _MISSING and fn._ret_name == "void"):
        return False
    try:
        fn._native_bwds(*native_args, **options)
    except Exception as exc:
        raise _resolve_error(fn, exc) from None
    for grad in written:
        grad._state.holds_result_of = fn._bwds_label
    return True


def backward_call(fn: Any, args: tuple, kwargs: dict) -> None:
    label = fn.label
    if not fn._differentiable:
        raise TypeError(
            f"{label} is not differentiable: mark it [Differentiable] in "
            f"{fn.module.file} to call .bwds"
        )
    if fn._module._traps:
        fn._trap_check()
    bound, options = _bind(fn, args, kwargs)
    result = options.pop("_result", _MISSING)
    if not fn._has_diff_inout and _fast_backward(fn, bound, options, result):
        return
    deterministic = is_deterministic()
    if deterministic:
        warn_nondeterministic(fn)
    with backward_scope(fn._bwds_label) as scope:
        b = _Backward(fn, scope)
        b.shape = broadcast_grad.call_shape(fn, bound, result)
        if deterministic:
            b.separate = _shared_grads(bound)
            if b.shape is None:
                b.untracked += _maybe_broadcast(bound, result)
        use_wrapper = fn._has_diff_inout
        native_kwargs: dict[str, Any] = {}
        for p, value in bound:
            if use_wrapper and p.io == "inout":
                native_kwargs.update(b.inout_args(p, value))
            elif p.tensor_kind == "fwd" and isinstance(value, Tensor):
                native_kwargs[p.name] = b.fwd_arg(p, value)
            elif isinstance(value, Tensor):
                native_kwargs[p.name] = b.tensor_arg(p, value)
            elif type(value) in _PLAIN:
                native_kwargs[p.name] = value
            elif isinstance(value, spy.Tensor):
                raise TypeError(
                    f"{label}.bwds: parameter '{p.name}' is a raw slangpy.Tensor; pass a "
                    "pydiff.Tensor (pydiff.tensor(...)) so pydiff can bind its gradient buffers"
                )
            else:
                native_kwargs[p.name] = _deep_native(value)
        native_args = list(native_kwargs.values())
        native_result = b.result_arg(result)
        if native_result is not _MISSING:
            options["_result"] = native_result
        try:
            if use_wrapper:
                node = fn._bwds_without(tuple(b.no_grad), wrapper=True)
                scope.dispatch(node, **native_kwargs, **options)
            else:
                node = fn._bwds_without(tuple(b.no_grad)) if b.no_grad else fn._native_bwds
                scope.dispatch(node, *native_args, **options)
        except Exception as exc:
            raise _resolve_error(fn, exc) from None
        b.after_call()
        if deterministic and b.untracked:
            warn_nondeterministic(fn, b.untracked)
        b.finish()


_GENERATED_ARGS = {"GridArg", "CallIdArg", "ThreadIdArg", "WangHashArg", "RandFloatArg"}


def _maybe_broadcast(bound: list, result: Any) -> list[str]:
    """When pydiff cannot tell a call's shape, the vectorised inputs that may be broadcast
    (smaller than another argument, or beside a grid/call-id argument): their gradients may
    be added with float atomics, which deterministic mode must not keep quiet about."""
    tensors = [v for _, v in bound if type(v) is Tensor] + ([result] if type(result) is Tensor else [])
    largest = max([t.numel for t in tensors] + [v.size for _, v in bound if isinstance(v, np.ndarray)],
                  default=0)
    generated = any(type(v).__name__ in _GENERATED_ARGS for _, v in bound)
    found = []
    for p, v in bound:
        if (type(v) is Tensor and p.tensor_kind is None and p.differentiable and v.requires_grad
                and (generated or v.numel < largest)):
            found.append(
                f"pydiff cannot tell the shape of this call (a grid/call-id argument, or a tensor "
                f"whose element type differs from its parameter's), so parameter '{p.name}' may be "
                "broadcast and its gradient added with float atomics; pass tensors whose dtype "
                "matches each parameter (e.g. dtype='float3') to let pydiff sum it in order"
            )
    return found


def _shared_grads(bound: list) -> set[int]:
    """Gradient buffers that more than one parameter of this call adds into: their atomic
    adds to one element would meet in any order, so each gets a buffer of its own."""
    seen: set[int] = set()
    shared: set[int] = set()
    for p, value in bound:
        if type(value) is Tensor and value._grad_out is not None and p.writes_gradient:
            key = value._grad_out._storage_key()
            (shared if key in seen else seen).add(key)
    return shared
