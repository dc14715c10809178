"""Argument checks and views shared by pydiff's ops (not public API).

need_float("exp", x=x)                 # OpDtypeError naming op, argument and dtypes otherwise
need_2d("matmul", a=a, b=b)            # ValueError naming the argument otherwise
x2 = rows_view("softmax", x)           # x as (rows, last dimension)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .device import Device
from .errors import OpDtypeError
from .tensor import Tensor


def need_float(name: str, **values: Any) -> None:
    """OpDtypeError naming the op, the argument, its dtype and the accepted one for any
    tensor among ``values`` that is not float (float32): pydiff's op kernels read and write
    float32 only, and a half, int or bool buffer read as float32 would be garbage.

    >>> need_float("softmax", logits=z)
    """
    for arg, v in values.items():
        if isinstance(v, Tensor) and v.dtype != "float":
            raise OpDtypeError(
                f"{name}: {arg} has dtype {v.dtype}; {name} accepts float (float32) tensors "
                f"only (convert with pydiff.tensor(t.numpy().astype(np.float32)))",
                name,
                arg,
                v.dtype,
            )


def same_device(name: str, **values: Any) -> Device:
    """The device of the tensors among ``values`` (named by argument); ValueError naming the
    two arguments and their devices when they are on different devices (an op's kernels read
    every buffer on one device: another device's buffer would be garbage or a crash).

    >>> same_device("matmul", a=a, b=b)
    """
    first: tuple[str, Any] | None = None
    for arg, v in values.items():
        if not isinstance(v, Tensor):
            continue
        if first is None:
            first = (arg, v.device)
        elif v.device is not first[1] and v.device != first[1]:
            raise ValueError(
                f"{name}: {first[0]} is on {first[1]!r} but {arg} is on {v.device!r}; "
                "tensors of one op must be on one device: create them there, or move one with "
                "t.to(device), a copy the tape differentiates (pydiff.tensor(t.numpy(), "
                "device=...) copies the values only: no gradient flows back through it)"
            )
    if first is None:
        raise TypeError(f"{name}: expected at least one pydiff.Tensor argument")
    return first[1]


def check_broadcast(name: str, *values: Any) -> None:
    """ValueError naming the op and the shapes when the tensors and arrays (NumPy arrays,
    lists) among ``values`` do not broadcast together by NumPy's rules.

    >>> check_broadcast("add", x, np.ones(3))    # x (3, 4): "add: shapes (3, 4) and (3,) ..."
    """
    shapes = [shape for shape in map(_operand_shape, values) if shape is not None]
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        raise ValueError(
            f"{name}: shapes {' and '.join(map(str, shapes))} do not broadcast"
        ) from None


def _operand_shape(v: Any) -> tuple[int, ...] | None:
    """The shape of a tensor, array or list operand; None for a number or what has none (a
    ragged list: its conversion refuses it)."""
    if isinstance(v, Tensor):
        return v.shape
    if isinstance(v, (np.ndarray, np.generic, list, tuple)):
        try:
            return np.shape(v)
        except ValueError:
            return None
    return None


#: The largest float32 and the smallest positive one: the ops' kernels compute in float32.
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_SMALLEST = float(np.finfo(np.float32).smallest_subnormal)


def finite_number(name: str, param: str, value: Any, *, positive: bool = False) -> float:
    """``value`` as a float: TypeError naming the op and the parameter for what is not a
    number, ValueError for NaN, an infinity or a value beyond float32 (inf in the kernels)
    and, with ``positive``, a value that is not positive in float32 (<= 0, or so small it
    rounds to 0), which would make every output NaN (or 0) without an error.

    >>> eps = finite_number("layer_norm", "eps", eps, positive=True)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: {param} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name}: {param}={value} must be a finite number")
    if abs(number) > FLOAT32_MAX:
        raise ValueError(
            f"{name}: {param}={value} is beyond the largest float32 ({FLOAT32_MAX:.8g}); "
            f"{name} computes in float32, where it would be inf: give a smaller value"
        )
    if positive and number <= 0:
        raise ValueError(f"{name}: {param}={value} must be positive")
    if positive and np.float32(number) == 0:
        raise ValueError(
            f"{name}: {param}={value} is 0 in float32, where {name} computes, so it is not "
            f"positive there: use at least {FLOAT32_SMALLEST:.8g} (the smallest positive "
            "float32)"
        )
    return number


def need_2d(name: str, **tensors: Tensor) -> None:
    need_float(name, **tensors)
    for arg, t in tensors.items():
        if not isinstance(t, Tensor) or len(t.shape) != 2:
            got = t.shape if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: {arg} must be a 2-D float tensor, got {got}")


def need_vector(name: str, arg: str, t: Any, n: int) -> None:
    """TypeError naming the op and ``arg`` when ``t`` (a weight or bias) is not a pydiff
    tensor, ValueError when it is not of shape (n,): ops read its buffer, which a NumPy
    array or list has not.

    >>> need_vector("linear", "bias", b, w.shape[0])   # TypeError: linear: bias must be ...
    """
    if not isinstance(t, Tensor):
        raise TypeError(
            f"{name}: {arg} must be a pydiff.Tensor of shape ({n},), got {type(t).__name__}: "
            f"wrap it, pydiff.tensor({arg}) (made once, outside a training loop)"
        )
    if t.shape != (n,):
        raise ValueError(f"{name}: {arg} must have shape ({n},), got {t.shape}")


def rows_view(name: str, x: Tensor, arg: str = "x") -> Tensor:
    """``x`` as a 2-D (rows, last dim) view, for the ops that work along the last dimension."""
    need_float(name, **{arg: x})
    if not isinstance(x, Tensor) or len(x.shape) < 1:
        got = x.shape if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a float tensor with at least 1 dimension, got {got}")
    if x.numel == 0:
        raise ValueError(f"{name}: the tensor {x.shape} is empty")
    return x.detach().reshape((x.numel // x.shape[-1], x.shape[-1]))


def check_axis(name: str, axis: int, x: Tensor) -> int:
    """``axis`` of ``x`` as a non-negative int; ValueError naming the op, the axis and the shape
    when it is out of range, TypeError when it is not an int."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name}: axis must be an int, got {type(axis).__name__}")
    ndim = len(x.shape)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: axis={axis} is out of range for a tensor of shape {x.shape}")
    return int(axis) % ndim
