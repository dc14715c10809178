"""A tensor you can compute with: operators, NumPy indexing, transpose, astype and math
methods of ``Tensor``, all differentiable and recorded on the active tape.

Operators and math methods are the ops (``x + y`` is ``ops.add(x, y)``, NumPy broadcasting,
numbers and arrays as operands). Indexing, ``transpose`` and ``astype`` are
``pydiff.Function``s computed on the host (one read and one upload, like NumPy on the
values): their backward puts the gradient back where the values came from, so a gradient
reaches only the elements a slice selected.

    y = (x[1:, ::2] * 2.0 - 1.0).sum()
    z = (w.T @ x).tanh().mean()
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from . import capturing, numpy_functions, ops, tensor_methods, tensor_pickle  # noqa: F401
from . import tensor_setitem  # noqa: F401  (provides x[key] = value)
from .creation import empty, ones, tensor as make_tensor
from .device import Device, resolve_device
from .function import Function
from .lost_derivative import refuse_lost_copy
from .dtype_names import SUPPORTED, UPLOAD_NUMPY, dtype_name
from .storage import COPY_FROM_GRAPH, element_shape
from .tape import active_tape
from .tensor import Tensor
from .temporary_copies import key_text, mark
from .unrecorded import copied_from

_FLOATS = ("float", "half")
#: Integer dtypes, which the operators promote to float (as NumPy promotes with a float).
_INTS = ("int", "uint", "int64_t", "uint64_t", "int8_t", "uint8_t", "int16_t", "uint16_t")
_OPS = (
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "exp",
    "log",
    "tanh",
    "sqrt",
    "sin",
    "cos",
    "sigmoid",
    "relu",
)


def _index_kinds_ok(key: Any) -> None:
    for item in key if isinstance(key, tuple) else (key,):
        if item is Ellipsis or isinstance(item, slice):
            continue
        if isinstance(item, (numbers.Integral, np.integer)) and not isinstance(item, bool):
            continue
        raise TypeError(
            f"Tensor[...]: an index of type {type(item).__name__} ({item!r}) is not supported; "
            "use ints (negative too), slices (with steps), ... and tuples of them"
        )


class _Take(Function):
    """Elements at flat positions ``where`` (an int array of the result's shape)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, where: np.ndarray) -> Tensor:
        elem = x.expected_numpy_shape()[len(x.shape) :]
        values = x.numpy().reshape((x.numel,) + elem)[where.reshape(-1)]
        ctx.where, ctx.numel, ctx.elem, ctx.shape = where, x.numel, elem, x.shape
        return make_tensor(values.reshape(where.shape + elem), dtype=x.dtype, device=x.device)

    @staticmethod
    def jvp(ctx: Any, t: Tensor, _: Any) -> Tensor:
        return _Take.apply(t, ctx.where)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        g = np.asarray(grad.numpy(), np.float64).reshape((-1,) + ctx.elem)
        full = np.zeros((ctx.numel,) + ctx.elem)
        np.add.at(full, ctx.where.reshape(-1), g)
        return full.reshape(ctx.shape + ctx.elem)


def getitem(x: Tensor, key: Any) -> Tensor:
    """``x[key]``: NumPy's basic indexing (an int per axis gives a 0-d tensor, as NumPy)."""
    _index_kinds_ok(key)
    where = np.arange(x.numel).reshape(x.shape)[key]  # NumPy's rules and IndexErrors
    where = np.asarray(where)
    if where.size == 0:
        raise IndexError(f"Tensor[{key!r}] of a tensor of shape {x.shape} selects no elements")
    t = _Take.apply(x, where)
    mark(t, f"x[{key_text(key)}]")  # (a copy: x[1:3].fill(0) would write nothing of x's)
    return t


class _Transpose(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, axes: tuple) -> Tensor:
        n = len(x.shape)
        extra = tuple(range(n, len(x.expected_numpy_shape())))
        ctx.inverse = tuple(np.argsort(axes)) + extra
        values = np.transpose(x.numpy(), tuple(axes) + extra)
        values = np.require(values, requirements="C")  # (ascontiguousarray: 0-d -> 1-D)
        return make_tensor(values, dtype=x.dtype, device=x.device)

    @staticmethod
    def jvp(ctx: Any, t: Tensor, _: Any) -> Tensor:
        return _Transpose.apply(t, ctx.args[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return np.transpose(np.asarray(grad.numpy(), np.float64), ctx.inverse)


def transpose(x: Tensor, axes: tuple) -> Tensor:
    """``x.transpose(*axes)`` / ``x.T``: axes reversed, or permuted as given."""
    n = len(x.shape)
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    axes = tuple(range(n))[::-1] if not axes else tuple(axes)
    if sorted(a % n if isinstance(a, int) and -n <= a < n else -1 for a in axes) != list(range(n)):
        raise ValueError(f"transpose: axes {axes} are not a permutation of {n} axes")
    t = _Transpose.apply(x, tuple(a % n for a in axes))
    mark(t, "x.T")
    return t


class _AsType(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, name: str) -> Tensor:
        ctx.source = x.dtype
        return make_tensor(x.numpy(), dtype=name, device=x.device)

    @staticmethod
    def jvp(ctx: Any, t: Tensor, _: Any) -> Tensor:
        return _AsType.apply(t, ctx.args[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return grad.numpy().astype(np.float64)


def astype(x: Tensor, dtype: Any) -> Tensor:
    """A copy converted to ``dtype`` (every dtype ``pydiff.tensor`` takes: ``double`` and
    ``np.float64`` too); between float and half the gradient converts back."""
    try:
        name = dtype_name(dtype)
        native = x.device.dtype(name)
    except TypeError as exc:
        more = "" if "supported:" in str(exc) else f"; supported: {SUPPORTED}"
        raise TypeError(f"astype: {exc}{more}") from None
    if element_shape(native) != x.expected_numpy_shape()[len(x.shape) :]:
        raise TypeError(f"astype: cannot convert elements of dtype {x.dtype!r} to {name!r}")
    if x.dtype in _FLOATS and name in _FLOATS:  # the same dtype too: a copy on the tape
        return _AsType.apply(x, name)
    out = empty(x.shape, dtype=name, device=x.device)  # no gradient: ints, double
    if out.scalar_type == "double" and x.requires_grad and active_tape() is not None:
        raise TypeError(
            f"astype({name!r}): x requires a gradient on this tape and a double tensor cannot "
            "carry one (Slang has no double atomics); astype('float') keeps the gradient, "
            f"x.detach().astype({name!r}) takes the values only"
        )
    values = x.detach().numpy()
    if values.dtype.kind == "f" and out.scalar_type not in (*_FLOATS, "double", "bool"):
        values = np.trunc(values)  # NumPy's and C's conversion to an integer: toward zero
    return out.copy_from_numpy(values, caller="Tensor.astype")


class _Ones(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.shape = x.expected_numpy_shape()
        return ones(x.shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def jvp(ctx: Any, t: Tensor) -> None:
        return None  # constant

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return np.zeros(ctx.shape)


def power(x: Tensor, exponent: Any) -> Tensor:
    """``x ** exponent`` for an integer exponent (products: exact everywhere, negative x
    included) or 0.5 (``sqrt``)."""
    if isinstance(exponent, bool) or not isinstance(exponent, numbers.Real):
        raise TypeError(
            f"x ** {type(exponent).__name__}: the exponent must be a number (an int or 0.5)"
        )
    x = _as_float(x)
    if exponent == 0.5:
        return ops.sqrt(x)
    whole = isinstance(exponent, numbers.Integral) or (  # (int(inf): OverflowError)
        np.isfinite(exponent) and exponent == int(exponent)
    )
    if not whole:
        raise NotImplementedError(
            f"x ** {exponent}: pydiff has integer exponents and 0.5; for x > 0 write "
            f"(x.log() * {exponent}).exp() (its derivative at 0 is not the limit)"
        )
    n = int(exponent)
    if n < 0:  # (1/x)^n, not 1/x^n: d(1/u)/du at u = x^n = 0 times d(x^n) = 0 was NaN at 0
        return power(ops.div(1.0, x), -n)
    if n == 0:  # 1 everywhere (inf and NaN included, as NumPy), gradient 0: on the tape
        return _Ones.apply(x)
    if n == 1:
        return ops.mul(x, 1.0)  # a new tensor on the tape, the same values
    result, base = None, x
    while n:  # by squaring: ~log2(n) products
        if n & 1:
            result = base if result is None else ops.mul(result, base)
        n >>= 1
        if n:
            base = ops.mul(base, base)
    return result


def matmul(a: Any, b: Any) -> Tensor:
    """``a @ b`` as NumPy: 2-D by 2-D, or a 1-D vector on either side."""
    for name, v in (("a", a), ("b", b)):
        if isinstance(v, (numbers.Number, np.generic)):
            raise TypeError(f"a @ b: {name} is a number; @ multiplies arrays (use * to scale)")
    a, b = _as_float(a), _as_float(b)
    a = a if isinstance(a, Tensor) else make_tensor(np.asarray(a, np.float32))
    b = b if isinstance(b, Tensor) else make_tensor(np.asarray(b, np.float32), device=a.device)
    if not (1 <= len(a.shape) <= 2 and 1 <= len(b.shape) <= 2):
        raise ValueError(f"a @ b: shapes {a.shape} and {b.shape}; pydiff multiplies 1-D and 2-D")
    a2 = a.reshape(1, a.shape[0]) if len(a.shape) == 1 else a
    b2 = b.reshape(b.shape[0], 1) if len(b.shape) == 1 else b
    out = ops.matmul(a2, b2)
    if len(a.shape) == 1 and len(b.shape) == 1:
        return out.reshape(())  # a dot product: 0-d, as NumPy
    if len(a.shape) == 1 or len(b.shape) == 1:
        return out.reshape(out.numel)
    return out


def _as_float(v: Any, name: str = "") -> Any:
    """An int or half tensor operand as float (the ops compute in float32; NumPy would
    promote an int too); other operands as they are. An integer float32 has no exact value
    for: ValueError naming the operator (``name``) and what keeps integers exact."""
    if isinstance(v, Tensor) and (v.dtype in _INTS or v.dtype == "half"):
        try:
            return astype(v, "float")
        except ValueError as exc:  # (astype's advice, dtype='int', is no way out here)
            why = str(exc).partition(": the integer ")[2].partition("): ")[0]
            if v.dtype == "half" or not why:
                raise
            raise ValueError(
                f"{name or 'an operator'}: the {v.dtype} tensor's integer {why}): pydiff's "
                "operators and ops compute integer tensors in float32 (as NumPy promotes an "
                "int with a float). Keep the integers exact on the host (pydiff.tensor("
                f"x.numpy() + 1, dtype=x.numpy().dtype)) or in a Slang function of {v.dtype}"
            ) from None
    return v


def _promoting(op: Any) -> Any:
    def run(*operands: Any) -> Tensor:
        return op(*[_as_float(v, op.__name__) for v in operands])

    run.__name__ = op.__name__
    return run


def _reduction(op: Any) -> Any:
    def run(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
        if isinstance(x, Tensor) and x.dtype in _INTS:
            _refuse_rounded_sum(op.__name__, x)
            capturing.on_replay(lambda: _refuse_rounded_sum(op.__name__, x))
        return op(_as_float(x), axis, keepdims)

    run.__name__ = op.__name__
    return run


def _refuse_rounded_sum(name: str, x: Tensor) -> None:
    """An int tensor's sum is computed in float32, exact only while every partial sum is at
    most 2**24 in magnitude (NumPy and torch sum ints exactly): past that, refused."""
    total = float(np.abs(x.numpy().astype(np.float64)).sum()) if x.numel else 0.0
    if total > 2.0**24:
        raise ValueError(
            f"x.{name}(): the {x.dtype} tensor of shape {x.shape} has magnitudes summing to "
            f"{total:.0f}, past 2**24, where float32 (the device's sum) no longer holds every "
            f"integer; sum exactly on the host: x.numpy().astype(np.int64).{name}()"
        )


class _Clone(Function):
    """``x.clone()`` on a tape: a copy whose gradient is the copy's (identity)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.copy_values()

    @staticmethod
    def jvp(ctx: Any, t: Tensor) -> Tensor:
        return t

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def clone(x: Tensor) -> Tensor:
    """``x.clone()``: recorded where a tape records and ``x`` requires grad."""
    if active_tape() is not None:
        if x.requires_grad:
            return _Clone.apply(x)
        if x.storage.last_writer == COPY_FROM_GRAPH or copied_from(x) is not None:
            # values copy_ took from a gradient path (before, the copy was a constant: a silent 0)
            return empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)  # still marked
    return x.copy_values()


class _ToDevice(Function):
    """``x.to(device)`` of a float tensor on a tape: a copy through the host onto ``device``
    whose gradient goes back to ``x`` on its own device (as ``torch.Tensor.to``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, device: Any) -> Tensor:
        return make_tensor(x.detach().numpy(), dtype=x.dtype, device=device)

    @staticmethod
    def jvp(ctx: Any, t: Tensor, _: Any) -> Tensor:
        return _ToDevice.apply(t, ctx.args[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return grad.numpy()  # added into x's gradient on x's device


def to_device(x: Tensor, device: Any) -> Tensor:
    """``x.to(device)``: ``x`` itself on its own device, else a copy on ``device`` (through the
    host) that a tape differentiates for float tensors; ints and other dtypes: the values."""
    if not isinstance(device, (Device, str)):
        raise TypeError(
            f"Tensor.to: device={device!r}; expected a pydiff.Device or a device type name"
        )
    dev = resolve_device(device)
    if dev is x.device:
        return x
    if x.dtype in _FLOATS:
        return _ToDevice.apply(x, dev)
    return make_tensor(x.detach().numpy(), dtype=x.dtype, device=dev)


def _struct_dtype(layout: Any) -> np.dtype | None:
    """The NumPy structured dtype of a Slang struct's buffer layout (scalar and struct
    fields); None when a field has no NumPy scalar (vectors, arrays)."""
    names, formats, offsets = [], [], []
    for f in layout.fields:
        t = f.type_layout
        fmt = UPLOAD_NUMPY.get(t.type.full_name) or (_struct_dtype(t) if t.fields else None)
        if fmt is None:
            return None
        names.append(f.name)
        formats.append(fmt)
        offsets.append(f.offset)
    itemsize = max(int(layout.stride), int(layout.size))
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})


def _struct_values(raw: np.ndarray, layout: Any, name: str) -> np.ndarray | str:
    """A struct tensor's values (SlangPy reads them as bytes) as a NumPy record array, or,
    where the struct has fields NumPy cannot name, what they are."""
    dtype = _struct_dtype(layout)
    if dtype is None or raw.shape[-1:] != (dtype.itemsize,):
        return f"<{name} values: {raw.shape[-1] if raw.ndim else 0} bytes each>"
    return np.ascontiguousarray(raw).view(dtype).reshape(raw.shape[:-1])


def values_text(x: Tensor) -> str:
    """The values for ``repr`` (NumPy's summary of large arrays)."""
    if capturing.recording() is not None:
        return "<values: inside a capture>"
    try:
        values = x.numpy()
        layout = x.native.dtype.buffer_layout.reflection if values.dtype == np.uint8 else None
        if layout is not None and layout.fields and x.scalar_type != "uint8_t":
            values = _struct_values(values, layout, x.dtype)  # (SlangPy gives raw bytes)
            if type(values) is str:
                return values
    except Exception as exc:  # a repr must not raise
        return f"<values unavailable: {type(exc).__name__}>"
    return np.array2string(
        values, threshold=64, edgeitems=3, precision=6, separator=", ", prefix="pydiff.Tensor("
    )


for _name, _implementation in {
    "getitem": getitem,
    "clone": clone,
    "transpose": transpose,
    "astype": astype,
    "to": to_device,
    "pow": power,
    "matmul": matmul,
    "values_text": values_text,
    "array_function": numpy_functions.array_function,
    "refuse_lost_conversion": numpy_functions.refuse_lost_conversion,
    "refuse_lost_copy": refuse_lost_copy,
    **{name: _promoting(getattr(ops, name)) for name in _OPS},
    "sum": _reduction(ops.sum),
    "mean": _reduction(ops.mean),
}.items():
    tensor_methods.provide(_name, _implementation)
