"""Integer primals in the transforms: pydiff differentiates float values only. Where a
transform is told what to differentiate (``grad``'s and ``jacfwd``/``jacrev``'s argnums, a
``jvp`` tangent or an ``hvp`` direction), integers are refused; where it picks for itself
(``vjp``, ``hessian`` of a Python function), they are held fixed. So an integer is never a
variable for one transform and a constant for another (``hvp``'s H v is ``hessian`` @ v).

    holds_integers(np.array([1, 2]))                  # True
    refuse_integers(2, "grad(f): argument 0")         # TypeError: ... give floats (2.0)
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def holds_integers(value: Any) -> bool:
    """Whether a host value is integers: a Python or NumPy int, an int array, a list of ints
    (not bools: those are refused as numbers of no derivative everywhere)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (numbers.Integral, np.integer)):
        return True
    if isinstance(value, (np.ndarray, list, tuple)):
        try:
            return np.asarray(value).dtype.kind in "iu"
        except (TypeError, ValueError):  # ragged lists: refused where converted
            return False
    return False


def refuse_integers(value: Any, where: str, hold: str = "give None as its direction") -> None:
    """A TypeError for integer values asked to be differentiated (an argnum, a direction):
    pydiff differentiates float values only, whatever the transform, so that an integer is
    never a variable for one transform and a constant for another (hessian, vjp: held
    fixed)."""
    if holds_integers(value):
        dtype = np.asarray(value).dtype
        scalar = isinstance(value, (numbers.Integral, np.integer))
        fix = f"{float(value)!r}" if scalar else "np.asarray(a, dtype=float)"
        raise TypeError(
            f"{where} holds integers ({dtype}); pydiff differentiates float values only "
            "(hessian and vjp hold integers fixed): give floats to differentiate it "
            f"({fix}), or {hold} to hold it fixed"
        )
