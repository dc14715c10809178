"""Making tensors like NumPy and PyTorch do: ranges, constants, ``*_like``, random values.

Random values come from NumPy's Philox, a counter-based generator, on the host: a seed gives
the same values on every backend and machine (then one upload).

    t = pydiff.arange(0, 1, 0.25)                 # [0, 0.25, 0.5, 0.75]
    w = pydiff.randn(64, 32, seed=0, requires_grad=True)
    m = pydiff.zeros_like(w)
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np

from .creation import from_host, ones, zeros
from .device import Device
from .dtype_names import dtype_name
from .tensor import Tensor


def _shape(shape: tuple, what: str) -> tuple[int, ...]:
    """``rand(2, 3)`` and ``rand((2, 3))`` alike; every size a non-negative int; ``rand(())``
    is 0-d (one element), ``rand()`` refused."""
    given = len(shape) == 1 and isinstance(shape[0], (tuple, list))
    if given:
        shape = tuple(shape[0])
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(
                f"{what}: sizes must be positive ints (a pydiff tensor has one element at "
                f"least), got {shape}"
            )
    if not shape and not given:
        raise ValueError(f"{what}: give a shape, e.g. {what}(3), {what}(2, 3) or {what}(())")
    return tuple(int(n) for n in shape)


def arange(
    start: float,
    stop: float | None = None,
    step: float = 1,
    *,
    dtype: Any = None,
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """Values from ``start`` up to (not including) ``stop`` by ``step``, as ``np.arange``;
    int when every bound is an int, else float.

    >>> pydiff.arange(4)            # [0, 1, 2, 3] (int)
    >>> pydiff.arange(0, 1, 0.25)   # [0, 0.25, 0.5, 0.75] (float)
    """
    for name, v in {"start": start, "stop": stop, "step": step}.items():
        if isinstance(v, numbers.Real) and not math.isfinite(v):
            raise ValueError(f"arange: {name}={v} is not finite; the values must be countable")
    if step == 0:
        raise ValueError("arange: step must not be 0")
    try:
        values = np.arange(start, stop, step) if stop is not None else np.arange(start)
    except (ValueError, MemoryError) as exc:  # too many values to hold
        raise ValueError(
            f"arange: start={start}, stop={stop}, step={step} give too many values ({exc})"
        ) from None
    if values.size == 0:
        raise ValueError(f"arange: no values from start={start}, stop={stop}, step={step}")
    if dtype is None:
        dtype = "int" if values.dtype.kind in "iu" else "float"
    dtype = dtype_name(dtype)  # (np.dtype(np.int64) == "int" too: it is int64_t)
    if dtype == "int" and (values.min() < -(2**31) or values.max() >= 2**31):
        raise ValueError(
            f"arange: values from {values.min()} to {values.max()} do not fit dtype 'int' "
            "(32 bits); pass dtype='float' for floats"
        )
    return from_host(values, dtype, device, requires_grad, "pydiff.arange")


def linspace(
    start: float,
    stop: float,
    num: int = 50,
    *,
    endpoint: bool = True,
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """``num`` evenly spaced values from ``start`` to ``stop``, inclusive unless
    ``endpoint=False`` (``np.linspace``, computed in float64, then rounded once).

    >>> pydiff.linspace(0.0, 1.0, 5)   # [0, 0.25, 0.5, 0.75, 1]
    >>> pydiff.linspace(0.0, 1.0, 4, endpoint=False)   # [0, 0.25, 0.5, 0.75]
    """
    if isinstance(num, bool) or not isinstance(num, numbers.Integral) or num < 1:
        raise ValueError(f"linspace: num must be an int >= 1, got {num!r}")
    if not isinstance(endpoint, (bool, np.bool_)):
        raise TypeError(f"linspace: endpoint must be True or False, got {endpoint!r}")
    values = np.linspace(start, stop, int(num), endpoint=bool(endpoint))
    return from_host(values, dtype, device, requires_grad, "pydiff.linspace")


def full(
    shape: int | Sequence[int],
    fill_value: float,
    *,
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor of ``shape`` filled with ``fill_value``.

    >>> pydiff.full((2, 3), 0.5)
    """
    shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    # float64 holds every float and int value exactly enough to check; complex stays complex
    # (refused then, not its imaginary part dropped)
    wide = np.complex128 if np.iscomplexobj(fill_value) else np.float64
    if isinstance(fill_value, numbers.Integral) and not isinstance(fill_value, (bool, np.bool_)):
        # (2**24 + 1 kept exact; past 64 bits a Python int, checked as pydiff.tensor's are)
        wide = np.int64 if -(2**63) <= fill_value < 2**63 else object
    values = np.full(_shape((shape,), "full"), fill_value, dtype=wide)
    return from_host(values, dtype, device, requires_grad, "pydiff.full: fill_value")


def _like(x: Tensor, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{what}: x must be a pydiff.Tensor, not {type(x).__name__}")
    return x


def zeros_like(x: Tensor, *, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    """Zeros of ``x``'s shape, dtype (unless given) and device.

    >>> m = pydiff.zeros_like(w)
    """
    x = _like(x, "zeros_like")
    return zeros(x.shape, dtype or x.dtype, device=x.device, requires_grad=requires_grad)


def ones_like(x: Tensor, *, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    """Ones of ``x``'s shape, dtype (unless given) and device.

    >>> up = pydiff.ones_like(y)
    """
    x = _like(x, "ones_like")
    return ones(x.shape, dtype or x.dtype, device=x.device, requires_grad=requires_grad)


def _generator(seed: int | None, what: str) -> np.random.Generator:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"{what}: seed must be an int or None, got {seed!r}")
    if seed is not None and seed < 0:
        raise ValueError(f"{what}: seed must be >= 0, got {seed}")
    return np.random.Generator(np.random.Philox(seed))


def rand(
    *shape: int,
    seed: int | None = None,
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """Uniform values in [0, 1) from a counter-based generator (the same ``seed``: the same
    values on every backend; no seed: fresh ones).

    >>> pydiff.rand(2, 3, seed=0)
    """
    values = _generator(seed, "rand").random(_shape(shape, "rand"), dtype=np.float32)
    return from_host(values, _float_dtype(dtype, "rand"), device, requires_grad, "pydiff.rand")


def randn(
    *shape: int,
    seed: int | None = None,
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """Standard normal values from a counter-based generator (see ``rand``).

    >>> w = pydiff.randn(64, 32, seed=0, requires_grad=True)
    """
    gen = _generator(seed, "randn")
    values = gen.standard_normal(_shape(shape, "randn"), dtype=np.float32)
    return from_host(values, _float_dtype(dtype, "randn"), device, requires_grad, "pydiff.randn")


def _float_dtype(dtype: Any, what: str) -> Any:
    """Random values are floats: an integer dtype (vectors too) would only truncate them."""
    try:
        name = dtype_name(dtype)
    except (TypeError, KeyError):
        return dtype  # pydiff.tensor names what is wrong with it
    if name.startswith(("int", "uint", "bool")):
        raise TypeError(
            f"pydiff.{what}: dtype={dtype!r}, but random values are floats: pass dtype='float' "
            f"or 'half' (pydiff.{what}(...).astype(...) converts afterwards)"
        )
    return dtype
