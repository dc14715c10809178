"""Matching a call's arguments to a shader function's parameters and turning pydiff values
into what SlangPy binds: shared by the forward call, ``.bwds`` and ``.fwds``.

    bound, options = bind_arguments(fn, (2.0, x), {"_result": "tensor"})
    [(p.name, value) for p, value in bound]           # [('a', 2.0), ('x', x)]
"""

from __future__ import annotations

import difflib
import math
import re
import weakref
from typing import Any

import numpy as np
import slangpy as spy

from .buffer_pool import MAX_BUFFER_BYTES, MAX_ELEMENTS, allocation_failed, check_size
from .builtin_names import collision_error, is_builtin_name
from .errors import check_result_value, kernel_compile_error, known_call_error
from .fixed_point_grad import dummy_fields
from .fork_locks import renewed_lock
from .call_shape import (
    ElementAxesError,
    argument_shape,
    broadcast,
    check_tensor_type,
    check_written,
    result_type,
    short_name,
    value_elements,
)
from .grid_args import GRID
from .host_values import element_base
from .signature import FunctionTarget, ParamInfo
from .dtype_names import SCALAR_NUMPY, SCALAR_TYPES, scalar_of
from .storage import allocate
from .struct_values import convert_value
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
        why = "every parameter is passed: SlangPy drops Slang's default values"
        raise TypeError(f"{label}() is missing argument(s): {', '.join(missing)} ({why})")
    return [(p, values[p.name]) for p in params], options


def prepare_arguments(fn: FunctionTarget, bound: list, options: dict) -> None:
    """After ``bind_arguments``, for the forward call, ``.bwds`` and ``.fwds``: convert host
    values (NumPy arrays, lists, numbers) to their parameters' types in ``bound`` (in place;
    see host_values), then refuse a call too large for the device (``check_call_size``), a
    ``_result`` that would truncate values, and arguments whose axes cannot hold their
    parameters' elements or that the call writes without covering its shape (call_shape)."""
    for i, (p, value) in enumerate(bound):
        if type(value) is not Tensor:
            try:
                new = convert_value(fn.label, p, value, fn.module.device)
            except (TypeError, ValueError):
                if _overloads_differ(fn, i, exact=True):
                    continue  # another overload may take it: SlangPy picks from the value
                raise
            if new is not value and not _overloads_differ(fn, i):
                bound[i] = (p, new)
    result = options.get("_result", MISSING)
    if type(result) in (float, int):
        check_number_result(fn, bound, result)
    key = _shapes_key(bound, result)
    passed = _passed_checks(fn)
    if key is not None and key in passed:
        return  # the checks below read only these shapes and dtypes: they passed before
    for i, (p, value) in enumerate(bound):
        if type(value) is Tensor and not _overloads_differ(fn, i, exact=True):
            try:
                check_tensor_type(fn, p, value)
            except TypeError:  # a built-in of that name may take it: SlangPy picks, or hints
                if not is_builtin_name(fn.module.device, fn.name):
                    raise
    check_result(fn, bound, result)
    try:
        check_written(fn, bound, result)
    except ValueError:
        if not _overloads_differ(fn, None, exact=True):
            raise  # (with overloads, the shapes depend on the one SlangPy picks)
    check_call_size(fn, bound, options)
    if key is not None:
        with _passed_lock:
            if len(passed) >= PASSED_MAX:
                passed.pop(next(iter(passed)))
            passed[key] = True


# The shape checks of a call cost ~25 us in Python, a third of a small call: a function
# remembers the argument shapes and dtypes (after host conversion) that passed them, a few
# dozen at most (a loop over changing shapes drops the oldest).
PASSED_MAX = 64
_passed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_passed_lock = renewed_lock(globals(), "_passed_lock")  # (new in a forked child)


def _passed_checks(fn: FunctionTarget) -> dict:
    passed = _passed.get(fn)
    if passed is None:
        with _passed_lock:
            passed = _passed.setdefault(fn, {})
    return passed


def _shapes_key(bound: list, result: Any) -> tuple | None:
    """What the shape checks read of a call: each tensor's shape and element type, each
    number's type and a string ``_result``; None (not remembered) for anything else."""
    key: list = []
    for value in [v for _, v in bound] + [result]:
        kind = type(value)
        if kind is Tensor:
            key.append((value.shape, value.element_type))  # reflection objects are cached
        elif kind in (float, int, bool) or value is MISSING:
            key.append(kind)
        elif kind is str:
            key.append(value)
        else:
            return None  # arrays, structs, grids: checked every call
    return tuple(key)


_FLOATS = ("float", "half", "double")


def check_number_result(fn: FunctionTarget, bound: list, seed: float | int) -> None:
    """Refuse a number ``_result`` (the upstream gradient of every result element) that the
    result's type cannot hold: 70000.0 for a half result would become inf."""
    returns = result_type(fn, bound)
    base = element_base(returns)
    if base not in _FLOATS:
        return
    top = float(np.finfo(SCALAR_NUMPY[base]).max)
    if abs(seed) > top and (type(seed) is int or math.isfinite(seed)):
        raise ValueError(
            f"{fn.label}: _result={seed!r} seeds the gradient of a {returns} result, but it is "
            f"outside the range of {base}, [-{top:.6g}, {top:.6g}], and would become inf; "
            "scale the seed (and the loss) down"
        )


def check_result(fn: FunctionTarget, bound: list, result: Any) -> None:
    """Refuse an unknown ``_result`` name, an integer or bool ``_result`` tensor for a float
    result (SlangPy truncates every value), a ``_result`` tensor that does not hold every
    value of an integer or bool result (``int64_t`` into ``int``: wrapped); its shape:
    ``call_shape.check_written``."""
    if check_result_value(fn.label, result) == "numpy":
        returns = result_type(fn, bound)
        generic = any(p.generic for p, _ in bound)  # (an unresolved T: SlangPy decides)
        if returns != "void" and value_elements(returns) is None and not generic:
            raise TypeError(
                f"{fn.label}: _result='numpy', but the function returns {returns}, which has "
                "no NumPy array form (only scalar, vector, matrix and array results do); use "
                "_result='tensor' (the default for tensor arguments)"
            )
    if type(result) is np.ndarray:
        where = f"is a NumPy array of dtype {result.dtype}"
        _refuse_narrower(fn, result_type(fn, bound), where, result.dtype)
    if type(result) is not Tensor:
        return
    returns = result_type(fn, bound)
    want, got = element_base(returns), element_base(result.element_type.full_name)
    if want in _FLOATS and got is not None and got not in _FLOATS:
        raise TypeError(
            f"{fn.label}: _result has dtype {result.dtype} but the function returns "
            f"{returns}: every value would be truncated; pass a {want} tensor "
            f"(pydiff.zeros(shape, dtype={want!r})) or _result='tensor'"
        )
    if (into := scalar_of(result.element_type.full_name)) is not None:
        _refuse_narrower(fn, returns, f"has dtype {result.dtype}", SCALAR_TYPES[into])
    shapes = value_elements(returns), value_elements(result.element_type.full_name)
    if want is not None and None not in shapes and shapes[1][1] and not shapes[0][1]:
        # (a vector result's wrong element type: call_shape.check_written says it)
        raise ValueError(
            f"{fn.label}: _result has dtype {result.dtype}, elements of shape "
            f"{shapes[1][1]}, but the function returns one {returns} per call element; pass "
            f"a tensor of dtype {short_name(returns)!r} or _result='tensor'"
        )


def _refuse_narrower(fn: FunctionTarget, returns: str, what: str, into: Any) -> None:
    """A ``TypeError`` for a ``_result`` (``what``: its dtype, of NumPy type ``into``) that
    does not hold every value of an integer or bool result (NumPy's safe
    cast): ``int64_t`` into ``int`` wrapped 2**40 + 2 to 2, ``int`` into ``half`` rounded."""
    want = scalar_of(returns)
    if want is None or want in _FLOATS:
        return
    if not np.can_cast(SCALAR_TYPES[want], into, "safe"):
        raise TypeError(
            f"{fn.label}: _result {what} but the function returns {returns}: values "
            "outside its range (or not exact in it) would wrap or round without a word; pass "
            f"a tensor of a type that holds every {want} (pydiff.zeros(shape, dtype={want!r})) "
            "or _result='tensor', then convert with .astype(...), which checks the values"
        )


def scalar_numpy_result(fn: FunctionTarget, bound: list, options: dict) -> bool:
    """For a forward call with ``_result='numpy'`` whose arguments are all single values
    (call shape (): no tensor or array to vectorise over) and a scalar result: SlangPy cannot
    write its 0-d array. Puts a one-element array in ``options`` instead and returns True;
    the caller gives back ``out.reshape(())``, as ``_result='tensor'`` gives a tensor of
    shape ()."""
    result = options.get("_result")
    if not (isinstance(result, str) and result == "numpy"):
        return False
    ret = result_type(fn, bound)
    if ret not in SCALAR_NUMPY:
        return False
    for p, value in bound:
        if type(value) in PLAIN or type(value) is list:  # (lists left are one vector each)
            continue
        if type(value) in (np.ndarray, Tensor) and argument_shape(p.type_name, value) == ():
            continue  # one whole element (a (3,) array or tensor at a float3), or 0-d
        return False
    options["_result"] = np.zeros((1,), SCALAR_NUMPY[ret])
    return True


def _overloads_differ(fn: FunctionTarget, i: int | None, exact: bool = False) -> bool:
    """Whether overloads of ``fn`` with as many parameters take different element types
    (``exact``: different types, float3 or float4) at position ``i`` (None: any position).
    Then SlangPy picks the overload from the value as given: pydiff neither converts it to
    one overload's type nor refuses it by that type. Read only when a value needs converting
    or would be refused."""
    try:
        reflected = fn.module.native.layout.find_function_by_name(fn.name)
        if reflected is None or not reflected.is_overloaded:
            return False
        n = len(fn.params)
        same = [o for o in reflected.overloads if len(o.parameters) == n]
        name = (lambda t: t.full_name) if exact else (lambda t: element_base(t.full_name))
        return any(
            len({name(o.parameters[j].type) for o in same}) > 1
            for j in (range(n) if i is None else (i,))
        )
    except Exception:  # no reflection to tell: as the selected overload says
        return False


def check_call_size(fn: FunctionTarget, bound: list, options: dict) -> None:
    """Refuse, before SlangPy allocates anything, a call whose shape (the broadcast of its
    vectorised arguments and result) is more than the device can index, or whose result
    (``_result="tensor"``/``"numpy"``) or broadcast gradient would outgrow a buffer."""
    result = options.get("_result", MISSING)
    total = 1  # at least the call's size: the product of its arguments' sizes
    for p, value in [*bound, (None, result)]:
        kind = type(value)
        if kind is Tensor:
            total *= max(value.numel, 1) if p is None or p.tensor_kind is None else 1
        elif kind is np.ndarray:
            total *= max(value.size, 1)
        elif kind is GRID:
            total *= max(math.prod(int(d) for d in value.shape), 1)
    limit = MAX_BUFFER_BYTES.get(fn.module.device.type)
    if total <= MAX_ELEMENTS and (limit is None or total * _LARGEST_ELEMENT <= limit):
        return  # however the arguments broadcast, the call fits
    returns = result_type(fn, bound)
    shapes, element_bytes = [], 4
    for type_name, kind, value in [
        *((p.type_name, p.tensor_kind, v) for p, v in bound),
        (returns, None, result),
    ]:
        if kind is not None or type(value) in PLAIN or type(value) is str:
            continue  # whole tensors do not vectorise
        try:
            own = argument_shape(type_name, value)
        except ElementAxesError:
            own = None  # (refused by check_written unless overloads differ)
        if own is None:
            continue
        shapes.append(own)
        if type(value) is Tensor:
            element_bytes = max(element_bytes, int(value.element_type.buffer_layout.stride))
    shape = broadcast(shapes)
    if shape is None:
        return  # SlangPy reports shapes that do not broadcast
    if isinstance(result, str) and result in ("tensor", "numpy") and math.prod(shape) > 0:
        try:
            ret = fn.module.device.dtype(returns)
            element_bytes = max(element_bytes, int(ret.buffer_layout.stride))
        except TypeError:
            pass
    check_size(f"{fn.label}: the call", fn.module.device.type, shape, element_bytes)


_LARGEST_ELEMENT = 64  # bytes of a float4x4: below this many elements, any result fits


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
    key = (t.shape, t.element_type.full_name, role)
    pool = device.scratch
    if key not in pool:
        pool[key] = allocate(device, t.bind(False, False).shape, t.grad_dtype, zero=role == "zeros")
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
        "primal": t.bind(False, False),
        "tangent": tangent if tangent is not None else scratch(dev, t, "zeros"),
        "grad_in": grad_in if grad_in is not None else scratch(dev, t, "zeros"),
        "grad_out": grad_out if grad_out is not None else dummy_fields(dev),
    }


def resolve_error(fn: FunctionTarget, exc: Exception) -> Exception:
    """SlangPy's overload-resolution report lists every candidate (hundreds of lines for a
    name shared with a Slang builtin); keep its head and say what to do."""
    if "createBuffer" in str(exc):  # SlangPy allocating a result or a temporary failed
        return allocation_failed(None, exc, f"{fn.label}: ")
    text = str(exc)
    if "RHI messages" in text and re.search(r"\b(?:internal )?error\[E\d+\]", text):
        return kernel_compile_error(fn.label, fn.module.file, text)
    if (known := known_call_error(fn.label, fn.signature.params, text)) is not None:
        return known
    if type(exc).__name__ != "ResolveException":
        return exc
    lines = str(exc).splitlines()
    head = "\n".join(lines[:12])
    more = f"\n... ({len(lines) - 12} more lines of SlangPy's report)" if len(lines) > 12 else ""
    if (collision := collision_error(fn, head + more)) is not None:
        return collision  # (a name of Slang's built-ins: its overloads SlangPy could not pick)
    return TypeError(
        f"{fn.label}: SlangPy could not match the arguments to the function:\n{head}{more}"
    )
