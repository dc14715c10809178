"""``fixed_point``'s arguments checked: ``tol``, ``atol``, ``max_iter``, a host ``x0``
made a float32 tensor, and no torch tensor among ``params``, each refused by name where it
cannot be one.

    check_numbers(tol, atol, max_iter)
    refuse_foreign(params)                      # TypeError naming params[1] if a torch tensor
    x0 = host_start(np.zeros(3), device)        # a float32 tensor on device
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from . import foreign
from .creation import tensor as make_tensor

FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_numbers(tol: Any, atol: Any, max_iter: Any) -> None:
    """TypeError/ValueError naming ``tol`` (a positive finite number), ``atol`` (a finite
    number >= 0) or ``max_iter`` (an int >= 1) where it is not one."""
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real):
        raise TypeError(f"fixed_point: tol must be a positive number, not {tol!r}")
    if not (math.isfinite(tol) and tol > 0):
        raise ValueError(f"fixed_point: tol must be a positive finite number, got {tol!r}")
    if isinstance(atol, bool) or not isinstance(atol, numbers.Real):
        raise TypeError(f"fixed_point: atol must be a number >= 0, not {atol!r}")
    if not (math.isfinite(atol) and atol >= 0):
        raise ValueError(f"fixed_point: atol must be a finite number >= 0, got {atol!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral):
        raise TypeError(f"fixed_point: max_iter must be a positive int, not {max_iter!r}")
    if max_iter < 1:
        raise ValueError(f"fixed_point: max_iter must be at least 1, got {max_iter}")


def host_start(x0: Any, device: Any) -> Any:
    """Host data ``x0`` as a float32 tensor on ``device``: real numbers only (a bool, None,
    text or complex values is a TypeError), finite and within float32's range (else a
    ValueError; NumPy's cast would make them inf or NaN, reported as a diverging solve).

    >>> host_start([0.0, 1.0], None)
    """
    try:
        arr = np.asarray(x0)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"fixed_point: x0 is not an array of numbers: {exc}") from None
    if arr.dtype.kind == "b":
        raise TypeError(
            f"fixed_point: x0 is boolean ({x0!r}); the iterate is float32: pass numbers "
            "(0.0, 1.0, np.zeros(...))"
        )
    if arr.dtype.kind not in "iuf":
        raise TypeError(
            f"fixed_point: x0 is not an array of numbers: a {type(x0).__name__} of dtype "
            f"{arr.dtype}; it must be real numbers (a float32 tensor is made of it)"
        )
    wide = arr.astype(np.float64)
    if not np.all(np.isfinite(wide)):
        raise ValueError("fixed_point: x0 holds NaN or inf; start the iteration from finite values")
    if wide.size and np.abs(wide).max() > FLOAT32_MAX:
        raise ValueError(
            f"fixed_point: x0 holds {wide.flat[np.abs(wide).argmax()]:g}, beyond the largest "
            f"float32 ({FLOAT32_MAX:.8g}); it would become inf"
        )
    return make_tensor(wide.astype(np.float32), device=device)  # a number: 0-d, as np.asarray


def refuse_foreign(params: tuple) -> None:
    """A torch tensor among ``params`` (in dicts, lists and tuples too) is a TypeError naming
    it: the solve iterates pydiff calls, and ``f`` called with torch data returns torch
    tensors (before: "f returned a Tensor; it must return a pydiff Tensor", naming neither
    the parameter nor the way out)."""

    def refuse(value: Any, label: str, name: str) -> None:
        raise TypeError(
            f"fixed_point: {label} is a {name} tensor; the solve runs on pydiff tensors. "
            f"For {name} gradients wrap the solve in pydiff.torch_function "
            "(pydiff.torch_function(lambda a, b: pydiff.fixed_point(f, x0, a, b))(a, b)); "
            f"for its values only, pass pydiff.from_torch(t)"
        )

    for i, value in enumerate(params):
        foreign.map_nested(value, f"params[{i}]", refuse)
