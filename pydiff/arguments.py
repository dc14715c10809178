"""Matching a call's arguments to a shader function's parameters and turning pydiff values
into what SlangPy binds: shared by the forward call, ``.bwds`` and ``.fwds``.

    bound, options = bind_arguments(fn, (2.0, x), {"_result": "tensor"})
    [(p.name, value) for p, value in bound]           # [('a', 2.0), ('x', x)]
"""

from __future__ import annotations

import difflib
from typing import Any

import slangpy as spy

from .fixed_point_grad import dummy_fields
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
