"""Matching a call's arguments to a shader function's parameters and turning pydiff values
into what SlangPy binds: shared by the forward call, ``.bwds`` and ``.fwds``.

    bound, options = bind_arguments(fn, (2.0, x), {"_result": "tensor"})
    [(p.name, value) for p, value in bound]           # [('a', 2.0), ('x', x)]
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import numpy as np
import slangpy as spy

from .buffer_pool import MAX_ELEMENTS, allocation_failed, check_size
from .fixed_point_grad import dummy_fields
from .host_values import convert, element_base
from .signature import FunctionTarget, ParamInfo
from .storage import allocate
from .tensor import Tensor

MISSING = object()  # an option (such as _result) that was not given
PLAIN = (float, int, bool)  # values SlangPy takes as they are


def bind_arguments(
    fn: FunctionTarget, args: tuple, kwargs: dict
) -> tuple[list[tuple[ParamInfo, Any]], dict]:
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


def prepare_arguments(fn: FunctionTarget, bound: list, options: dict) -> None:
    """After ``bind_arguments``, for the forward call, ``.bwds`` and ``.fwds``: convert host
    values (NumPy arrays, lists, numbers) to their parameters' types in ``bound`` (in place;
    see host_values), then refuse a call too large for the device (``check_call_size``)."""
    for i, (p, value) in enumerate(bound):
        if type(value) is not Tensor:
            new = convert(fn.label, p, value, fn.module.device)
            if new is not value and not _overloads_differ(fn, i):
                bound[i] = (p, new)
    check_call_size(fn, bound, options)
    check_result(fn, bound, options.get("_result", MISSING))


_FLOATS = ("float", "half", "double")


def check_result(fn: FunctionTarget, bound: list, result: Any) -> None:
    """Refuse a ``_result`` tensor that would lose values: an integer or bool tensor for a
    floating-point result (SlangPy truncates every value), or one smaller than the shape the
    arguments broadcast to (several threads would write one element: a race)."""
    if type(result) is not Tensor:
        return
    returns = fn.signature.return_type
    result_type = result.native.dtype.full_name
    want, got = element_base(returns), element_base(result_type)
    if want in _FLOATS and got is not None and got not in _FLOATS:
        raise TypeError(
            f"{fn.label}: _result has dtype {result.dtype} but the function returns "
            f"{returns}: every value would be truncated; pass a {want} tensor "
            f"(pydiff.zeros(shape, dtype={want!r})) or _result='tensor'"
        )
    if result_type != returns:
        return  # element dimensions may be vectorised over: SlangPy checks the shape
    shapes = [
        v.shape
        for p, v in bound
        if type(v) is Tensor and p.tensor_kind is None and v.native.dtype.full_name == p.type_name
    ]
    if not shapes:
        return
    try:
        args_shape = tuple(int(d) for d in np.broadcast_shapes(*shapes))
        whole = tuple(int(d) for d in np.broadcast_shapes(args_shape, result.shape))
    except ValueError:
        return  # SlangPy reports shapes that do not broadcast
    if whole != tuple(result.shape):
        raise ValueError(
            f"{fn.label}: _result has shape {tuple(result.shape)} but the arguments broadcast "
            f"to shape {args_shape}: several call elements would write the same result element "
            f"(a race). Pass a _result of shape {whole}, or _result='tensor'"
        )


def _overloads_differ(fn: FunctionTarget, i: int) -> bool:
    """Whether overloads of ``fn`` with as many parameters take different element types at
    position ``i`` (then SlangPy picks the overload from the value as given: pydiff does not
    convert it to one overload's type). Read only when a value needs converting."""
    try:
        reflected = fn.module.native.layout.find_function_by_name(fn.name)
        if reflected is None or not reflected.is_overloaded:
            return False
        n = len(fn.params)
        bases = {
            element_base(o.parameters[i].type.full_name)
            for o in reflected.overloads
            if len(o.parameters) == n
        }
    except Exception:  # no reflection to tell: convert as the selected overload says
        return False
    return len(bases) > 1


def check_call_size(fn: FunctionTarget, bound: list, options: dict) -> None:
    """Refuse, before SlangPy allocates anything, a call whose shape (the broadcast of its
    vectorised tensor arguments and result) is more than the device can index or hold: its
    result (``_result="tensor"``) and a broadcast parameter's gradient have that shape."""
    shapes, total, element_bytes = [], 1, 4
    result = options.get("_result", MISSING)
    for p, value in [*bound, (None, result)]:
        if type(value) is np.ndarray and p is not None and element_base(p.type_name) == p.type_name:
            shapes.append(value.shape)  # a host array for a scalar parameter vectorises too
            total *= max(value.size, 1)
            continue
        if type(value) is not Tensor:
            continue
        if p is not None and (p.tensor_kind is not None or value.dtype != p.type_name):
            continue  # whole tensors do not vectorise; other element types change the shape
        shapes.append(value.shape)
        total *= max(value.numel, 1)
        element_bytes = max(element_bytes, int(value.native.dtype.buffer_layout.stride))
    if total <= MAX_ELEMENTS or len(shapes) < 2:
        return  # the call shape has at most the product of the arguments' sizes
    try:
        shape = np.broadcast_shapes(*shapes)
    except ValueError:
        return  # SlangPy reports shapes that do not broadcast
    if result == "tensor" and math.prod(shape) > 0:
        try:
            ret = fn.module.device.dtype(fn.signature.return_type)
            element_bytes = max(element_bytes, int(ret.buffer_layout.stride))
        except TypeError:
            pass
    check_size(f"{fn.label}: the call", fn.module.device.type, shape, element_bytes)


def check_device(fn: FunctionTarget, t: Tensor, where: str) -> None:
    """Raise unless ``t`` is on the device ``fn``'s module was loaded on."""
    device = fn.module.device
    if t.device is not device and t.device != device:
        raise ValueError(
            f"{fn.module.name}.{fn.name}: {where} is on device {t.device!r} but the module was "
            f"loaded on {device!r}; create the tensor on the module's device"
        )


def deep_bind(value: Any) -> Any:
    """Replace pydiff tensors inside dicts/lists (struct arguments) by SlangPy tensors."""
    if isinstance(value, Tensor):
        return value.bind(True)
    if isinstance(value, dict):
        return {k: deep_bind(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (Tensor, dict, list)) for v in value):
        return type(value)(deep_bind(v) for v in value)
    return value


def nested_tensors(value: Any) -> list[Tensor]:
    """The pydiff tensors in ``value``: itself, or those inside dicts/lists (struct fields),
    in the order ``map_tensors`` visits them."""
    if type(value) is Tensor:
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in nested_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in nested_tensors(v)]
    return []


def map_tensors(value: Any, f: Any) -> Any:
    """``value`` with each pydiff tensor ``t`` in it (itself, or in dicts/lists) as ``f(t)``."""
    if type(value) is Tensor:
        return f(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, f) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and nested_tensors(value):
        return type(value)(map_tensors(v, f) for v in value)
    return value


def scratch(device: Any, t: Tensor, role: str) -> spy.Tensor:
    """Device-wide scratch tensors shaped like ``t``: 'zeros' (read, never written) or 'sink'
    (written, never read). Shared per shape and dtype."""
    key = (t.shape, t.native.dtype.full_name, role)
    pool = device.scratch
    if key not in pool:
        pool[key] = allocate(device, t.native.shape, t.grad_dtype, zero=role == "zeros")
    return pool[key]


def fwd_tensor_struct(
    fn: FunctionTarget,
    p: ParamInfo,
    t: Tensor,
    tangent: Any = None,
    grad_in: Any = None,
    grad_out: dict | None = None,
) -> dict:
    """The fields of pydiff's FwdDiffTensor<N> / RWFwdDiffTensor<N> for a pydiff tensor;
    ``grad_out`` is a FixedPointGrad's fields (FixedPointAccumulator.fields())."""
    if t.dtype != "float" or len(t.shape) != p.fwd_dims:
        raise ValueError(
            f"{fn.label}: parameter '{p.name}' is a {p.type_name}, which takes a float tensor "
            f"with exactly {p.fwd_dims} dimension(s); got dtype {t.dtype} and shape {t.shape} "
            "(SlangPy cannot vectorise over this struct: index the extra dimensions inside the "
            "function)"
        )
    dev = fn.module.device
    return {
        "primal": t.native,
        "tangent": tangent if tangent is not None else scratch(dev, t, "zeros"),
        "grad_in": grad_in if grad_in is not None else scratch(dev, t, "zeros"),
        "grad_out": grad_out if grad_out is not None else dummy_fields(dev),
    }


def resolve_error(fn: FunctionTarget, exc: Exception) -> Exception:
    """SlangPy's overload-resolution report lists every candidate (hundreds of lines for a
    name shared with a Slang builtin); keep its head and say what to do."""
    if "createBuffer" in str(exc):  # SlangPy allocating a result or a temporary failed
        return allocation_failed(None, exc, f"{fn.label}: ")
    if type(exc).__name__ != "ResolveException":
        return exc
    lines = str(exc).splitlines()
    head = "\n".join(lines[:12])
    more = f"\n... ({len(lines) - 12} more lines of SlangPy's report)" if len(lines) > 12 else ""
    hint = ""
    if is_builtin_name(fn.module.device, fn.name):
        hint = (
            f"\nHint: '{fn.name}' is also the name of Slang built-in functions, which SlangPy "
            "cannot tell apart from yours; rename your function."
        )
    return TypeError(
        f"{fn.label}: SlangPy could not match the arguments to the function:\n{head}{more}{hint}"
    )


def is_builtin_name(device: Any, name: str) -> bool:
    """Whether Slang's core module defines a function ``name`` (found by reflection in an
    empty module compiled once per device); False when that cannot be told."""
    try:
        probe = device.cached(
            "pydiff-builtin-probe",
            lambda: device.native.load_module_from_source("pydiff_builtin_probe", ""),
        )
        return probe.layout.find_function_by_name(name) is not None
    except Exception:  # a device without source loading: no hint rather than a wrong one
        return False
