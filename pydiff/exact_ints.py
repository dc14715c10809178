"""Integers that a float type cannot hold exactly, refused loudly: a float holds every integer
only up to 2^24 (half: 2^11, double: 2^53), and NumPy's casts round past that without a word
(a silently wrong count or id), as does its conversion of a Python list mixing ints with
floats, or holding ints past int64, to float64 (``[2**63 + 1, 0]`` became 2**63).

    refuse_rounded_ints(np.array([2**24 + 1]), np.float32, "pydiff.tensor")   # ValueError
    refuse_rounded_list([2**53 + 1, 0.5], np.asarray(...), np.float32, "pydiff.tensor: data")
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any

import numpy as np


def refuse_rounded_ints(values: np.ndarray, dtype: Any, where: str, out: Any = None) -> None:
    """ValueError naming ``where``, the first integer of ``values`` (an integer array) that
    float ``dtype`` cannot hold exactly and what it would become (16777217 -> 16777216.0 in
    float32: a silently wrong count or id); nothing for exact ones (2^25, 3, -7). ``out``:
    ``values`` cast to ``dtype`` already. An object array's Python ints (past 64 bits:
    ``[2**64 + 1]``) are checked one by one, and one past the float range is refused too."""
    if values.dtype.kind == "O":
        _refuse_rounded_objects(values, dtype, where)
        return
    if values.dtype.kind not in "iu" or not values.size:
        return
    limit = 2 ** (np.finfo(dtype).nmant + 1)  # every integer up to here is exact
    big = values > limit if values.dtype.kind == "u" else (values > limit) | (values < -limit)
    if not big.any():
        return
    wide = values[big]
    with np.errstate(over="ignore"):
        back = (values.astype(dtype) if out is None else out)[big].astype(np.float64)
    info = np.iinfo(values.dtype)  # (floats in its range convert back exactly)
    kept = (back >= float(info.min)) & (back < float(info.max) + 1.0)
    same = np.zeros(wide.shape, bool)
    same[kept] = back[kept].astype(values.dtype) == wide[kept]
    if same.all():
        return
    _refuse(wide[~same].flat[0].item(), back[~same].flat[0].item(), dtype, where, limit)


def _refuse_rounded_objects(values: np.ndarray, dtype: Any, where: str) -> None:
    """``refuse_rounded_ints`` of an object array: its ints, however large (NumPy makes an
    object array of ``[2**64 + 1]``, whose cast to float rounds silently); for an integer
    ``dtype``, those it cannot hold (NumPy's cast would raise a bare OverflowError)."""
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        for v in values.flat:
            if isinstance(v, int) and not info.min <= v <= info.max:
                raise ValueError(
                    f"{where}: {v} does not fit {np.dtype(dtype)} ({info.min} to {info.max})"
                )
        return
    if np.dtype(dtype).kind != "f":
        return
    limit = 2 ** (np.finfo(dtype).nmant + 1)
    for v in values.flat:
        if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            v = int(v)
            if -limit <= v <= limit:
                continue
            with np.errstate(over="ignore"):
                f = np.array([v], dtype=object).astype(dtype)[0].item()
            if not math.isfinite(f):
                raise ValueError(
                    f"{where}: the integer {v} is beyond the largest {np.dtype(dtype)} "
                    f"({float(np.finfo(dtype).max):.6g}); it would become inf"
                )
            if int(f) != v:
                _refuse(v, f, dtype, where, limit)


def _refuse(v: int, f: float, dtype: Any, where: str, limit: int) -> None:
    name = {2: "half", 4: "float", 8: "double"}[np.dtype(dtype).itemsize]
    wider = ", or dtype='double' (exact up to 2**53)" if name != "double" else ""
    kept = "'int'" if -(2**31) <= v < 2**31 else "'int64_t'" if -(2**63) <= v < 2**63 else ""
    raise ValueError(
        f"{where}: the integer {v} has no exact {name} value (it would become {f!r}; {name} "
        f"holds every integer only up to {limit} in magnitude): "
        + (f"keep it an integer (dtype={kept}){wider}, or " if kept else "")
        + "convert the values to floats yourself (np.asarray(x, float)) to accept the rounding"
    )


def refuse_rounded_list(data: Any, arr: np.ndarray, dtype: Any, where: str) -> None:
    """``refuse_rounded_ints`` for the Python ints of a (nested) list or tuple ``data`` that
    NumPy made the float or object array ``arr``: each must be exact in ``arr`` (ints mixed
    with floats, ``[2**53 + 1, 0.5]``, or past int64, ``[2**63 + 1, 0]``, became float64,
    rounded without a word) and in ``dtype``, the values' target (``[2**24 + 1, 0.5]`` for a
    float). Integer arrays are checked where they are cast (``refuse_rounded_ints``)."""
    if type(data) not in (list, tuple) or arr.dtype.kind not in "fO":
        return
    big: list = []
    _big_ints(data, big)
    if big:
        ints = np.array(big, dtype=object)
        if arr.dtype.kind == "f":
            refuse_rounded_ints(ints, arr.dtype, f"{where} (a list NumPy made {arr.dtype})")
        refuse_rounded_ints(ints, dtype, where)


def _big_ints(data: Any, out: list) -> None:
    """Append to ``out`` the ints past 2**11 (every float type holds those up to it) in the
    nested lists/tuples ``data``; rows of floats only are passed over at C speed."""
    while (kinds := set(map(type, data))) <= {list, tuple} and kinds:
        data = list(chain.from_iterable(data))  # (one level of nesting at a time)
    if kinds <= _FLOAT_TYPES:
        return
    for v in data:
        t = type(v)
        if t is list or t is tuple:
            _big_ints(v, out)
        elif (t is int or isinstance(v, np.integer)) and abs(int(v)) > 2048:
            out.append(int(v))


_FLOAT_TYPES = {float, np.float64, np.float32, np.float16}
