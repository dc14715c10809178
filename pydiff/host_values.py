"""Host values (NumPy arrays, lists, NumPy and Python numbers) passed to a shader function's
scalar, vector or matrix parameter: converted to the parameter's element type, as NumPy would,
or refused with an error naming the parameter when the conversion would change a value.

SlangPy matches a NumPy array only of the parameter's exact dtype and C-contiguous layout; it
reports anything else as an overload failure or "numpy array is not contiguous". pydiff
converts before SlangPy sees the value, for the forward call, ``.bwds`` and ``.fwds`` alike:

    m.f(np.array([0.5, 1.0]))             # float64 -> float32 for a float parameter
    m.f(a[::2]); m.f(a[::-1]); m.f(a.T)   # strided, reversed, Fortran views: copied
    m.f(np.array(2.0)); m.f(2)            # 0-d arrays and ints for a float parameter
    m.g(np.array([1.5]))                  # ValueError: int parameter 'i', values 1.5 truncated
    m.h(np.array([[1.0, 2.0, 3.0]]))      # float64 -> float32 for a float[3] parameter too
"""

from __future__ import annotations

import decimal
import math
import numbers
from typing import Any

import numpy as np
import slangpy as spy

from .creation import from_host, tensor
from .exact_ints import refuse_rounded_ints, refuse_rounded_list
from .foreign import as_array
from .handles import owner
from .call_shape import short_name, value_elements, display_name
from .signature import ParamInfo
from .dtype_names import SCALAR_NUMPY, SMALL_INTS
from .storage import has_c_strides

_FLOATS = ("float", "half", "double")
_INTS = ("int", "uint", "int64_t", "uint64_t")
_FLOAT_MAX = float(np.finfo(np.float32).max)


def to_float32(values: Any, what: str) -> np.ndarray:
    """``values`` (an array, list or number) as a float32 array; ValueError naming ``what``
    when finite values overflow float32 (NumPy would make them inf with a warning only).

    >>> to_float32(np.array([1e300]), "from_torch")   # ValueError: from_torch: values up to
    """
    with np.errstate(over="ignore"):
        out = np.asarray(values, dtype=np.float32)
    if out.size and not np.isfinite(out).all():
        wide = np.asarray(values, dtype=np.float64)
        bad = np.isfinite(wide) & ~np.isfinite(out)
        if bad.any():
            raise ValueError(
                f"{what}: float64 values up to {np.abs(wide[bad]).max():.3g} overflow dtype "
                "'float' (largest 3.4e38)"
            )
    return out


def differentiated_values(value: Any, what: str) -> np.ndarray:
    """``value`` (a number, array or list given to be differentiated: ``grad``'s argnums, a
    primal given a direction) as float64, or a TypeError naming ``what`` for booleans,
    complex numbers, text, None and other non-numbers (a complex array lost its imaginary
    part, a None became NaN, both without a word) and ragged lists; a ValueError for a
    Python int beyond float64."""
    try:
        arr = as_array(value, what)
    except ValueError as exc:  # (ragged: as_array's message names what)
        raise TypeError(str(exc)) from None
    kind = arr.dtype.kind
    refuse_rounded_list(value, arr, np.float32, what)  # (the values become float32: ints
    if kind in "iu":  # past 2**24 not held exactly refused, as a call's float argument's)
        refuse_rounded_ints(arr, np.float32, what)
    if kind == "b":
        raise TypeError(
            f"{what} holds booleans; differentiate float values (np.asarray(v, dtype=float) "
            "to mean 0 and 1)"
        )
    if kind == "c":
        raise TypeError(
            f"{what} holds complex numbers; pydiff differentiates real values: pass v.real "
            "and v.imag as arrays of their own"
        )
    if kind == "O":
        for v in arr.flat:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
                raise TypeError(f"{what} holds {v!r:.40} ({type(v).__name__}); it needs numbers")
    elif kind not in "iuf":
        raise TypeError(f"{what} is not an array of numbers (dtype {arr.dtype})")
    try:
        return np.asarray(arr, dtype=np.float64)
    except OverflowError:
        raise ValueError(f"{what} holds an integer beyond the range of float") from None


def element_base(type_name: str) -> str | None:
    """The scalar type of a scalar, vector or matrix parameter ('vector<float,3>' -> 'float');
    None for other types (structs, arrays, tensors, generics)."""
    name = type_name.strip()
    for prefix in ("vector<", "matrix<"):
        if name.startswith(prefix):
            name = name[len(prefix) :].split(",")[0].strip()
    return name if name in SCALAR_NUMPY else None


def convert(label: str, p: ParamInfo, value: Any, device: Any) -> Any:
    """``value`` for parameter ``p`` of the function ``label``: unchanged when SlangPy takes
    it as it is (or it is not a host number or array), else converted; ValueError/TypeError
    naming the parameter when converting would change a value (truncated floats, ints out of
    range, finite values that overflow) or the dtype has no meaning for it. SlangPy takes no
    NumPy bool arrays: those become bool tensors on ``device``."""
    kind = type(value)
    if kind is float and p.type_name == "float" and abs(value) <= _FLOAT_MAX:
        return value  # the common case, first
    if p.tensor_kind is not None:
        return value
    found = value_elements(p.type_name)
    if found is None:
        if p.type_name in SMALL_INTS:
            return _small_int(label, p, value, device)
        return value
    if value is None:  # (SlangPy's own error lists every overload it tried, not the cause)
        raise TypeError(f"{_where(label, p)}: got None; pass a value of its type")
    base, axes, array = found
    if isinstance(value, np.generic):
        value = value.item()  # (a longdouble stays one)
        kind = type(value)
    if kind not in (bool, int, float, list) and not isinstance(value, np.ndarray):
        value = _other_number(label, p, value)
        kind = type(value)
    if kind in (bool, int, float):
        if array:
            raise TypeError(
                f"{_where(label, p)}: got the number {value!r}; an array parameter takes "
                f"{axes[0]} elements: a list, or a NumPy array of shape "
                f"(..., {', '.join(map(str, axes))})"
            )
        if len(axes) == 2:
            raise TypeError(
                f"{_where(label, p)}: got the number {value!r}; a {short_name(p.type_name)} "
                f"parameter takes a whole matrix: a nested list, or a NumPy array of shape "
                f"(..., {axes[0]}, {axes[1]}) (np.full({axes}, {value!r}) for every entry)"
            )
        return _number(label, p, base, value)  # for a vector: every component, as Slang does
    if kind is list:  # (a tuple is .fwds's (value, tangent) pair)
        arr = as_array(value, _where(label, p))
        refuse_rounded_list(value, arr, SCALAR_NUMPY[base], _where(label, p))  # (NumPy's)
        if arr.dtype == object and arr.size and all(type(v) in (int, float) for v in arr.flat):
            arr = arr.astype(SCALAR_NUMPY[base])  # ([2**64, 0]: exact, checked above)
        if arr.dtype == object or arr.dtype.kind in "USV":
            return value  # not numbers: SlangPy reports it
        if axes and arr.shape[len(arr.shape) - len(axes) :] != axes:
            raise ValueError(
                f"{_where(label, p)}: a list of shape {arr.shape}, but one "
                f"{display_name(p.type_name)} takes {'x'.join(map(str, axes))} numbers: pass "
                f"lists of shape (..., {', '.join(map(str, axes))})"
            )
        if (len(axes) == 1 or array) and arr.shape == axes and not p.writes_value:
            return _array(label, p, base, arr).tolist()  # one vector, as SlangPy takes it
        value = arr
    if isinstance(value, np.ndarray):
        if value.size == 0:  # (SlangPy's raw "Assertion failed: m_desc.size > 0", or a (3, 0))
            raise ValueError(
                f"{_where(label, p)}: got an array of shape {value.shape}, with no elements; "
                "pydiff has no zero-size tensors: skip the call when there is nothing to compute"
            )
        if value.ndim == 0 and not p.writes_value:
            return convert(label, p, value[()], device)
        if axes and value.shape[max(value.ndim - len(axes), 0) :] != axes:
            raise ValueError(
                f"{_where(label, p)}: a NumPy array of shape {value.shape}, but one "
                f"{display_name(p.type_name)} takes its last axes, which must be {axes}: pass an "
                f"array of shape (..., {', '.join(map(str, axes))})"
            )
        if value.dtype.kind == "b" and base == "bool" and not p.writes_value:
            return tensor(value, dtype="bool", device=device)
        if array and value.shape == axes and not p.writes_value:
            return _array(label, p, base, value).tolist()  # one array: SlangPy takes a list
        return _array(label, p, base, value)
    return value


def _small_int(label: str, p: ParamInfo, value: Any, device: Any) -> Any:
    """A host value for an 8- or 16-bit integer parameter (SlangPy raised ``std::bad_cast``
    for a number out of its range or a float, a Slang compile error for a list, and took no
    NumPy array of another dtype, nor any of int8): a whole number in range as an int,
    arrays and lists read as a tensor of the parameter's type; else refused by name."""
    if isinstance(value, (bool, np.bool_)) or value is None or isinstance(value, str):
        raise TypeError(f"{_where(label, p)}: got {value!r}; pass an integer")
    if isinstance(value, (numbers.Real, np.generic)):
        info = np.iinfo(SMALL_INTS[p.type_name])
        v = value.item() if isinstance(value, np.generic) else value
        if not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
            raise ValueError(f"{_where(label, p)}: got {v!r}, not a whole number")
        if not info.min <= v <= info.max:
            raise ValueError(
                f"{_where(label, p)}: {v!r} is outside the range of {p.type_name} "
                f"[{info.min}, {info.max}]"
            )
        return int(v)
    if isinstance(value, (list, np.ndarray)) and not p.writes_value:
        return from_host(value, p.type_name, device, False, _where(label, p))
    return value


def _other_number(label: str, p: ParamInfo, v: Any) -> Any:
    """A scalar that is neither a Python nor a NumPy number SlangPy takes: a real number
    (``np.longdouble``, ``Decimal``, ``Fraction``) as the nearest Python float (then checked
    as one: a float32 or half parameter keeps far fewer digits than a double); complex
    numbers, strings and bytes refused. Anything else (SlangPy's grids and the like) as is."""
    if isinstance(v, (complex, str, bytes)):
        fix = (
            "complex values have no real type to go to; pass its .real and .imag to two parameters"
            if type(v) is complex
            else "not a number; pass a number (float(s) parses a string)"
        )
        raise TypeError(f"{_where(label, p)}: got {type(v).__name__} {v!r}: {fix}")
    if isinstance(v, (numbers.Real, decimal.Decimal)) and not isinstance(v, (bool, int, float)):
        try:
            f = float(v)
        except (OverflowError, ValueError):
            f = math.inf
        if math.isinf(f) and not (v != v or abs(v) == math.inf):
            raise ValueError(
                f"{_where(label, p)}: {v!r} is beyond the largest float and would become inf"
            )
        return int(v) if isinstance(v, numbers.Integral) else f
    return v


def _where(label: str, p: ParamInfo) -> str:
    param, dot, field = p.name.partition(".")  # 'p.a': field 'a' of a struct (struct_values)
    if dot:
        return f"{label}: parameter '{param}', field '{field}' ({p.type_name})"
    return f"{label}: parameter '{p.name}' ({p.type_name})"


def _number(label: str, p: ParamInfo, base: str, v: bool | int | float) -> bool | int | float:
    if (base == "bool") != (type(v) is bool):
        fix = "True or False (bool(x))" if base == "bool" else f"a number ({base}(b) in Python)"
        raise TypeError(
            f"{_where(label, p)}: got {v!r}; a {'number' if base == 'bool' else 'bool'} for a "
            f"{base} parameter is most likely a mistake; pass {fix}"
        )
    if base in _FLOATS:
        dtype = SCALAR_NUMPY[base]
        top = float(np.finfo(dtype).max)
        # IEEE round-to-nearest gives inf only from half an ulp past the largest value on
        # (float: 2^128 (1 - 2^-25), half: 65520); below that the largest value itself, as
        # NumPy's conversion of the same number in an array.
        if base == "double":
            too_big = abs(v) > top  # (a Python float is a double already)
        else:
            info = np.finfo(dtype)
            too_big = abs(v) >= 2.0**info.maxexp * (1 - 2.0 ** -(info.nmant + 2))
        if too_big and (isinstance(v, int) or math.isfinite(v)):
            raise ValueError(
                f"{_where(label, p)}: {v!r} is beyond the largest {base} ({top:.8g}) and would "
                "become inf"
            )
        if abs(v) > top and math.isfinite(v):
            return top if v > 0 else -top  # rounds to the largest value (not a tie to inf)
        if type(v) is int and abs(v) > 2048:  # (2**24 + 1 for a float: 2**24, refused;
            # 2**64 + 1 too; up to 2**11 every float type holds it: no array made per call)
            big = abs(v) >= 2**63
            refuse_rounded_ints(np.array([v], object if big else None), dtype, _where(label, p))
        return float(v)
    if base in _INTS:
        info = np.iinfo(SCALAR_NUMPY[base])
        if isinstance(v, float) and not v.is_integer():
            raise ValueError(
                f"{_where(label, p)}: got the float {v!r}, which an integer parameter would "
                "truncate; pass an int (e.g. round(x))"
            )
        if not info.min <= v <= info.max:
            raise ValueError(
                f"{_where(label, p)}: {v!r} is outside the range of {base} [{info.min}, {info.max}]"
            )
        return int(v)
    return v


def _array(label: str, p: ParamInfo, base: str, arr: np.ndarray) -> np.ndarray:
    target = np.dtype(SCALAR_NUMPY[base])
    if arr.dtype == target and has_c_strides(arr):
        return arr
    where = f"{_where(label, p)}: a NumPy array of dtype {arr.dtype}, strides {arr.strides}"
    if p.writes_value:
        raise TypeError(
            f"{where} is written by the call, and a converted copy would lose what it writes; "
            f"pass a pydiff.Tensor or a C-contiguous {target} array"
        )
    k = arr.dtype.kind
    if k == "b" and target.kind != "b":
        raise TypeError(
            f"{where}: booleans for a {base} parameter are most likely a mistake; convert "
            f"them yourself (mask.astype(np.{target}))"
        )
    if k not in "biuf" or (target.kind == "b" and k != "b"):
        raise TypeError(f"{where}: cannot be converted to {base}; pass {target} values")
    if base in _FLOATS:
        with np.errstate(over="ignore"):
            out = arr.astype(target)
        bad = np.isfinite(arr) & ~np.isfinite(out) if k == "f" else ~np.isfinite(out)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise ValueError(
                f"{where}: element {i} = {arr[i].item()!r} is beyond the largest {base} and would "
                "become inf"
            )
        refuse_rounded_ints(arr, target, where, out)
    elif base in _INTS:
        info = np.iinfo(target)
        bad = (arr != np.round(arr)) if k == "f" else np.zeros(arr.shape, bool)
        with np.errstate(invalid="ignore"):
            bad |= ~((arr >= info.min) & (arr <= info.max))
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise ValueError(
                f"{where}: element {i} = {arr[i].item()!r} is not an integer in the range of "
                f"{base}; round or clip it yourself"
            )
        out = arr.astype(target)
    else:
        out = arr.astype(target)
    return out if has_c_strides(out) else out.copy(order="C")


def refuse_handed_out(value: Any, what: str) -> None:
    """A ValueError for a raw SlangPy tensor on the buffer of a live pydiff tensor, which a
    call would write without counting the write (``m.f(z, _result=x.native)``)."""
    if isinstance(value, spy.Tensor) and (found := owner(value.storage)) is not None:
        raise ValueError(
            f"{what} is a raw SlangPy tensor on the buffer of a pydiff tensor (last written by "
            f"{found.last_writer}): pydiff would not count this write, so a tape's backward or "
            "a .bwds that read those values would differentiate at the new ones (a silently "
            "wrong gradient); pass the pydiff tensor itself, or wrap the handle first: "
            "pydiff.Tensor(handle, device) shares its storage"
        )
