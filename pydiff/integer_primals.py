"""Integer primals in the transforms: host integers (a Python or NumPy int, an integer
array or list) are numbers, converted to float32 and differentiated by every transform
alike (``grad(f)(2)`` as ``grad(f)(2.0)``; ``hvp``'s H v is ``hessian`` @ v); an integer
*tensor* is data, never differentiated.

    holds_integers(np.array([1, 2]))                  # True
    holds_integers(2.0)                               # False
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
