"""The shape a call vectorises over, and the arguments it writes checked against it.

SlangPy runs one thread per element of the broadcast (NumPy's right-aligned rule) of its
vectorised arguments. One element of a vector or matrix parameter is a whole ``float3`` or
``float2x2``: a float tensor or array passed to it takes it from its trailing axes, which
must then be exactly ``(3,)`` or ``(2, 2)`` (SlangPy reads any other width silently with
the wrong stride). A tensor the call writes (an ``out``/``inout`` parameter, ``_result``)
must cover the whole call shape, or several threads write one element: a race.

    own_shape("vector<float,3>", "float", (4, 3))      # (4,): four float3 elements
    own_shape("vector<float,3>", "float", (4,))        # ElementAxesError: last axis must be 3
    check_written(fn, bound, result)                  # ValueError naming 'y', both shapes
    check_tensor_type(fn, p, int_tensor)              # TypeError: a float parameter, int tensor
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import slangpy as spy

from .grid_args import SCALAR_INDEX, is_grid
from .signature import FunctionTarget, ParamInfo
from .dtype_names import SCALAR_NUMPY
from .tensor import Tensor

_VECTOR = re.compile(r"^vector<(\w+),(\d+)>$")
_MATRIX = re.compile(r"^matrix<(\w+),(\d+),(\d+)>$")
_ARRAYS = (Tensor, np.ndarray)
_SCALARS = frozenset(SCALAR_NUMPY)


class ElementAxesError(ValueError):
    """A tensor or array whose trailing axes cannot hold one element of its parameter."""


def type_elements(type_name: str) -> tuple[str, tuple[int, ...]] | None:
    """(scalar, element axes) of a scalar, vector or matrix type name: ('float', ()) for
    'float', ('float', (3,)) for 'vector<float,3>', ('half', (2, 2)) for
    'matrix<half,2,2>'; None for any other type (structs, arrays, generics)."""
    name = type_name.replace(" ", "")
    if name in SCALAR_NUMPY:
        return name, ()
    m = _VECTOR.match(name)
    if m and m.group(1) in SCALAR_NUMPY:
        return m.group(1), (int(m.group(2)),)
    m = _MATRIX.match(name)
    if m and m.group(1) in SCALAR_NUMPY:
        return m.group(1), (int(m.group(2)), int(m.group(3)))
    return None


_ARRAY = re.compile(r"^(.+)\[(\d+)\]$")


def value_elements(type_name: str) -> tuple[str, tuple[int, ...], bool] | None:
    """(scalar, element axes, is an array) of a scalar, vector, matrix or fixed-size array
    of those: ('float', (3,), True) for 'float[3]', ('float', (3, 2), True) for
    'vector<float,2>[3]', call_shape.type_elements' answer for the others; None for any
    other type (structs, generics, unsized arrays)."""
    found = type_elements(type_name)
    if found is not None:
        return found[0], found[1], False
    m = _ARRAY.match(type_name.replace(" ", ""))
    inner = type_elements(m.group(1)) if m else None
    if m is None or inner is None:
        return None
    return inner[0], (int(m.group(2)), *inner[1]), True


def display_name(type_name: str) -> str:
    """How Slang code spells a type: 'float2[3]' for 'vector<float,2>[3]'; see short_name."""
    m = _ARRAY.match(type_name.replace(" ", ""))
    return f"{short_name(m.group(1))}[{m.group(2)}]" if m else short_name(type_name)


def short_name(type_name: str) -> str:
    """How Slang code spells a type: 'float3' for 'vector<float,3>', 'float2x2' for
    'matrix<float,2,2>'; other names unchanged."""
    found = type_elements(type_name)
    if found is None or not found[1]:
        return type_name
    return found[0] + "x".join(str(d) for d in found[1])


def own_shape(
    type_name: str, dtype: str, shape: tuple[int, ...], noun: str = "tensor"
) -> tuple[int, ...] | None:
    """The part of the call shape that a tensor or array of element type ``dtype`` and
    ``shape`` covers when passed where a ``type_name`` is expected: its shape when ``dtype``
    is that type, its shape without the element's axes when ``dtype`` is the element's
    scalar; None when pydiff cannot tell (structs, generics, other conversions). Raises
    ElementAxesError when the trailing axes are not the element's, or ``dtype`` is a vector
    or matrix of the same scalar with other dimensions."""
    if dtype.replace(" ", "") == type_name.replace(" ", ""):
        return tuple(shape)
    want, got = type_elements(type_name), type_elements(dtype)
    if want is None or got is None or not want[1] or want[0] != got[0]:
        return None
    base, axes = want
    name = short_name(type_name)
    if got[1]:
        raise ElementAxesError(
            f"holds {short_name(dtype)} elements where a {name} is expected; pass a {name} "
            f"tensor, or a {base} one whose last axes are {axes}"
        )
    k = len(axes)
    if len(shape) < k or tuple(shape[len(shape) - k :]) != axes:
        raise ElementAxesError(
            f"is a {base} {noun} of shape {tuple(shape)} where a {name} is expected: "
            f"its last axes must hold one {name} each, shape (..., {', '.join(map(str, axes))}) "
            f"(or pass a {name} tensor)"
        )
    return tuple(shape[: len(shape) - k])


def dtype_of(value: Any) -> str | None:
    """The Slang element type of a pydiff tensor or a NumPy array of numbers; else None."""
    if type(value) is Tensor:
        return value.element_type.full_name
    if type(value) is np.ndarray:
        for name, kind in SCALAR_NUMPY.items():
            if value.dtype == kind:
                return name
    return None


def argument_shape(type_name: str, value: Any) -> tuple[int, ...] | None:
    """The part of the call shape ``value`` covers at a parameter of type ``type_name``
    (None: none, or pydiff cannot tell). Numbers and SlangPy's generated values (call ids,
    random numbers) cover nothing; a ``spy.grid`` its shape."""
    dtype = dtype_of(value)
    if dtype is not None:
        noun = "tensor" if type(value) is Tensor else "NumPy array"
        return own_shape(type_name, dtype, tuple(int(d) for d in value.shape), noun)
    if is_grid(value) and all(int(d) > 0 for d in value.shape):
        return tuple(int(d) for d in value.shape)
    return None


def broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """NumPy's broadcast of ``shapes`` (None when they do not broadcast); () for none."""
    out: list[int] = []
    for shape in shapes:
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for k, d in enumerate(shape, len(out) - len(shape)):
            if d != out[k]:
                if out[k] != 1 and d != 1:
                    return None
                out[k] = max(out[k], d) if d != 0 and out[k] != 0 else 0
    return tuple(out)


def result_type(fn: FunctionTarget, bound: list) -> str:
    """The function's return type, with a generic one (``T f<T : ...>(T x)``) specialised
    as SlangPy specialises it: to the element type of the argument of a parameter of that
    type ('float' for a float tensor or a Python float)."""
    ret = fn.signature.return_type
    if type_elements(ret) is not None or ret == "void":
        return ret
    for p, value in bound:
        if p.generic and p.type_name == ret and p.tensor_kind is None:
            found = dtype_of(value) or ("float" if type(value) is float else None)
            if found is not None:
                return found
    return ret


def param_type(p: ParamInfo, value: Any) -> str:
    """The type a parameter takes in this call: a generic one's is its argument's."""
    return (dtype_of(value) or p.type_name) if p.generic else p.type_name


def _refuse_unsized_grid(fn: FunctionTarget, p: ParamInfo, grid: Any, bound: list, result: Any):
    """A grid's -1 sizes come from the call's shape, which only vectorised arguments (arrays
    at parameters that are not whole tensors) or a sized grid give: with none, SlangPy runs
    a single thread, silently."""
    for q, value in bound:
        if type(value) in _ARRAYS and q.tensor_kind is None and len(value.shape) > 0:
            return
        if is_grid(value) and -1 not in value.shape.as_tuple():
            return
    if type(result) in _ARRAYS and len(result.shape) > 0:
        return
    raise ValueError(
        f"{fn.label}: parameter '{p.name}' is given spy.grid({grid.shape.as_tuple()}): a -1 "
        "size takes the call's shape from the other arguments, but none has one here (a tensor "
        "at an interface tensor parameter is passed whole), so SlangPy would run one thread. "
        "Give the grid its sizes (spy.grid(y.shape))"
    )


def check_written(fn: FunctionTarget, bound: list, result: Any) -> None:
    """Refuse, naming the parameter or ``_result`` and the shapes, any argument whose
    trailing axes cannot hold its parameter's elements, and a tensor or array the call
    writes (an ``out``/``inout`` parameter, ``_result``) that does not cover the call shape
    the other arguments broadcast to (several threads would write one of its elements);
    and a strided or offset ``spy.grid`` at a scalar index, which SlangPy ignores there, or a
    grid of -1 sizes where no argument gives the call a shape (SlangPy runs one thread)."""
    for p, value in bound:
        if is_grid(value) and -1 in value.shape.as_tuple():
            _refuse_unsized_grid(fn, p, value, bound, result)
        if is_grid(value) and SCALAR_INDEX.fullmatch(p.type_name.strip()):
            if any(int(d) != 1 for d in value.stride) or any(int(d) != 0 for d in value.offset):
                raise ValueError(
                    f"{fn.label}: parameter '{p.name}' ({p.type_name.strip()}) is given "
                    f"spy.grid(stride={tuple(value.stride)}, offset={tuple(value.offset)}), but "
                    f"SlangPy's grid gives a scalar index the thread's id, ignoring stride and "
                    f"offset. Declare it int1 (idx.x: offset + id * stride), or pass a plain "
                    f"spy.grid(shape)"
                )
    written = type(result) in _ARRAYS or any(
        type(bound[i][1]) in _ARRAYS and bound[i][0].tensor_kind is None
        for i in fn.signature.written
    )
    if not written:  # (the common call) only element axes of vectors and matrices to check
        for p, value in bound:
            if type(value) in _ARRAYS and p.tensor_kind is None and p.type_name not in _SCALARS:
                _add(fn, [], f"parameter '{p.name}'", param_type(p, value), value, False)
        return
    parts: list[tuple[str, str, Any, tuple[int, ...]]] = []  # (what, type, written, own)
    for p, value in bound:
        if p.tensor_kind is None and type(value) not in (float, int, bool):
            _add(fn, parts, f"parameter '{p.name}'", param_type(p, value), value, p.writes_value)
    if type(result) in _ARRAYS:
        _add(fn, parts, "_result", result_type(fn, bound), result, True)
    for what, type_name, value, own in parts:
        if value is None:
            continue  # not written
        args = broadcast([s for w, _, _, s in parts if w != what])
        whole = broadcast([args, own]) if args is not None else None
        if whole is None and args is not None:
            raise ValueError(
                f"{fn.label}: {what} has shape {tuple(value.shape)}, which the call writes, but "
                f"the {'arguments' if what == '_result' else 'other arguments'} broadcast to "
                f"shape {args}, which it does not broadcast with. Pass one of shape "
                f"{args + tuple(value.shape)[len(own) :]}"
            )
        if whole is None:
            return  # the other arguments do not broadcast: SlangPy names them
        if whole == own:
            continue
        kind = "has shape" if type(value) is Tensor else "is a NumPy array of shape"
        shape = tuple(value.shape)
        elem = "" if own == shape else f" (one {short_name(type_name)} per last axes: {own})"
        fix = ", or _result='tensor'" if what == "_result" else ""
        others = "arguments" if what == "_result" else "other arguments"
        raise ValueError(
            f"{fn.label}: {what} {kind} {shape}{elem}, which the call writes, but the "
            f"{others} broadcast to shape {args}: the call would run over {whole}, and several "
            f"of its elements would write the same element of {what} (a race). Pass one of "
            f"shape {args + shape[len(own) :]}{fix}"
        )


def _add(fn: FunctionTarget, parts: list, what: str, type_name: str, value: Any, writes: bool):
    """Append (what, type, value if written else None, shape covered) for one argument."""
    try:
        own = argument_shape(type_name, value)
    except ElementAxesError as exc:
        raise ValueError(f"{fn.label}: {what} ({short_name(type_name)}) {exc}") from None
    if own is not None:
        writes = writes and type(value) in (Tensor, np.ndarray)
        parts.append((what, type_name, value if writes else None, own))


def check_tensor_type(fn: FunctionTarget, p: ParamInfo, t: Tensor) -> None:
    """Refuse a tensor whose elements a scalar, vector, matrix or array parameter cannot
    take: SlangPy converts no tensor (int to float, float to int, half to float, a float3
    for a float) and reports only "Argument 0 could not be resolved"."""
    found = None if p.tensor_kind is not None or p.generic else value_elements(p.type_name)
    dtype = t.element_type.full_name
    got = _scalar_of(dtype)
    if found is None or got is None or dtype.replace(" ", "") == p.type_name.replace(" ", ""):
        return
    base, axes, array = found
    name = display_name(p.type_name)
    if got == base and array and dtype == base:
        shape = tuple(t.shape)
        if len(shape) <= len(axes) or shape[len(shape) - len(axes) :] != axes:
            raise ValueError(
                f"{fn.label}: parameter '{p.name}' ({name}) got a {base} tensor of shape "
                f"{shape}; one {name} takes its last axes, which must be {axes} after at least "
                f"one call axis: pass shape (n, {', '.join(map(str, axes))}) (for one array, "
                f"x.reshape((1, {', '.join(map(str, axes))})))"
            )
        return
    if got == base and (dtype == base or axes):
        return  # its scalar: the element axes are checked with the shapes (own_shape)
    art = "an" if base[0] in "aeio" else "a"  # (a uint)
    takes = f"{art} {base} tensor" + (
        f" whose last axes are {axes}" + ("" if array else f", or a {name} tensor") if axes else ""
    )
    fix = ""
    if got != base and {got, base} == {"float", "half"}:  # a copy would lose the gradient
        fix = (
            f". Convert it first with x.astype('{base}'), which the tape differentiates (a "
            f"torch tensor: t.{base}() before the call)"
        )
    elif got != base and base in SCALAR_NUMPY:  # (not NumPy's astype: pydiff.tensor makes
        # float64 data float, int64 int: the advice gave the same error again before break48)
        fix = f". Convert it first, e.g. pydiff.tensor(x.numpy(), dtype='{base}')"
    raise TypeError(
        f"{fn.label}: parameter '{p.name}' ({name}) got a tensor of dtype {t.dtype}, which "
        f"SlangPy does not convert to {name}; it takes {takes}, or host values (NumPy "
        f"arrays, lists{'' if array else ', numbers'}: converted){fix}"
    )


def _scalar_of(type_name: str) -> str | None:
    found = type_elements(type_name)
    return found[0] if found is not None else None


def zero_d_call(bound: list) -> bool:
    """The call shape is () and a tensor made it so: every tensor argument covers no call
    axis (a 0-d tensor, or a float tensor of shape (3,) at a float3 parameter: one whole
    element) and no array gives the call a dimension. Its result is 0-d, as in NumPy,
    whatever made the shape (): SlangPy returns (1,) for the (1,) views of 0-d tensors
    (``as_zero_d``), a number for whole elements (``tensor_result`` asks for a tensor).

    >>> if zero_d_call(bound): out = out.reshape(())
    """
    seen = False
    for p, value in bound:
        if type(value) is Tensor:
            if value.shape and _covers(p, value) != ():
                return False
            seen = True
        elif type(value) is np.ndarray:
            if argument_shape(p.type_name, value) != ():
                return False
        elif not (type(value) in (float, int, bool) or value is None or type(value) is list):
            return False  # structs and SlangPy's values: left as SlangPy shapes them
    return seen


def _covers(p: ParamInfo, value: Tensor) -> tuple[int, ...] | None:
    try:
        return argument_shape(param_type(p, value), value)
    except ElementAxesError:
        return None  # (refused by check_written before the call)


def tensor_result(fn: FunctionTarget, bound: list, options: dict) -> None:
    """For a call of shape () made by tensors (``zero_d_call``) that returns a scalar,
    vector or matrix and was given no ``_result``: ask SlangPy for a tensor result, which
    it returns as a number when no 0-d tensor gives the call its (1,) shape (a whole float3
    tensor at a float3 parameter), so that the result stays a tensor on a tape."""
    if "_result" in options or not zero_d_call(bound):
        return
    if type_elements(result_type(fn, bound)) is not None:
        options["_result"] = "tensor"


def as_zero_d(out: Any) -> Any:
    """A (1,) result of a call whose tensors are all 0-d (``zero_d_call``), as a 0-d tensor."""
    if type(out) is Tensor and out.shape == (1,) and out.base is None and not out.requires_grad:
        return Tensor(out.native.view(()), out.device, storage=out.storage)
    if type(out) is np.ndarray and out.shape[:1] == (1,):  # _result='numpy': (1,) + element
        return out.reshape(out.shape[1:])
    return out


def refuse_struct_grads(label: str, p: ParamInfo, t: Tensor) -> None:
    """Refuse a tensor of structs with gradient buffers (a struct result made on a tape, or
    ``.with_grads()``): SlangPy 0.43 has no differentiable tensor of structs and failed
    binding it with its raw "Type 'RWDiffTensor<P, 1>' not found" and the tensor's bytes.

    >>> refuse_struct_grads("m.f", p, struct_tensor_with_grads)   # TypeError naming 'p'
    """
    if t.grad_in is None and t.grad_out is None:
        return
    if isinstance(t.element_type, spy.reflection.StructType):
        raise TypeError(
            f"{label}: parameter '{p.name}' got a tensor of struct {t.dtype} with gradient "
            "buffers: SlangPy 0.43 has no differentiable tensors of structs, so no gradient "
            "can flow through it. Pass it .detach() (no gradient through these values), or "
            "return the struct's fields as separate results (one float tensor each)"
        )
