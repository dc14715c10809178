"""``copy.deepcopy`` and ``pickle`` of pydiff tensors (and so of layers, optimizers and dicts
holding them): a deep copy is a new tensor on the same device with the values copied there;
a pickle holds the values (NumPy), the dtype and ``requires_grad``, and loads onto the
default device.

    ema = copy.deepcopy(layer)                 # independent weights, same device
    blob = pickle.dumps({"w": w})              # pickle.loads(blob)["w"]: values, dtype kept
"""

from __future__ import annotations

import numpy as np

from . import tensor_methods
from .creation import tensor as make_tensor
from .lost_derivative import refuse_lost_copy
from .tensor import Tensor

#: scalar types whose values NumPy holds as such, also in vectors, matrices and arrays, so a
#: pickle can carry them (struct elements come back as raw bytes of a module's layout).
_SCALARS = frozenset(
    ("float", "half", "double", "int", "uint", "bool")
    + tuple(f"{k}{n}_t" for k in ("int", "uint") for n in (8, 16, 32, 64))
    + ("float16_t", "float32_t", "float64_t")
)


def deepcopy(x: Tensor, memo: dict) -> Tensor:
    """``copy.deepcopy(x)``: new storage on x's device with x's values, its dtype and shape,
    ``requires_grad`` as x's with a fresh gradient buffer (no gradient yet: an optimizer
    skips it until a backward writes one); no tangent. A view is copied as a tensor of its
    own. Refused where the copy would lose a derivative (x requires a gradient while a tape
    records), as ``pydiff.tensor(x)`` is: torch deep-copies only graph leaves too."""
    refuse_lost_copy(x, "copy.deepcopy")
    copy = x.detach().copy_values()
    if x.requires_grad:
        copy.requires_grad_(True)
    memo[id(x)] = copy
    return copy


def reduce(x: Tensor) -> tuple:
    """``pickle``'s recipe: ``rebuild(values, dtype, requires_grad)``."""
    if x.scalar_type not in _SCALARS:
        raise TypeError(
            f"pickle: a pydiff.Tensor of dtype {x.dtype!r} cannot be pickled (its elements "
            "are a Slang struct, whose values come back as bytes of a module's layout); "
            "pickle x.numpy() and rebuild it with pydiff.tensor(values, dtype=...)"
        )
    return (rebuild, (np.array(x.detach().numpy(), order="C"), x.dtype, x.requires_grad))


def rebuild(values: np.ndarray, dtype: str, requires_grad: bool) -> Tensor:
    """A pickled tensor on the default device (``pydiff.set_default_device`` chooses it)."""
    return make_tensor(values, dtype=dtype, requires_grad=requires_grad)


tensor_methods.provide("deepcopy", deepcopy)
tensor_methods.provide("reduce", reduce)
