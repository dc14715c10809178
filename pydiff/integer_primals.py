"""Integer primals in the transforms of a Python function. Where you name a value to
differentiate (``grad``/``jacfwd``/``jacrev`` argnums, a ``jvp`` tangent, an ``hvp``
direction), host integers are numbers: converted to float32 and differentiated
(``grad(f)(2)`` is ``grad(f)(2.0)``). Where the transform picks for itself (``vjp``,
``hessian``), integers are held fixed, as labels and indices must be. Integer tensors are
data everywhere.

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
