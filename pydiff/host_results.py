"""``_result`` given as NumPy for a result SlangPy cannot write into NumPy: a ``bool`` or an
8/16-bit integer result (``int8_t``, ``uint16_t``, ...) with ``_result='numpy'`` or a NumPy
array of the result's own dtype (``np.zeros(n, bool)``). SlangPy's NumPy path copied them
with its tensor layout (Slang's 4-byte bool; 8/16-bit storage padded to 4 bytes): "numpy
array size does not match the tensor storage" or no marshall for ``dtype('bool')``. Such a
call writes a pydiff tensor instead and hands back its values as NumPy's dtype.

    if "_result" in kwargs and (run := through_tensor(fn, kwargs)) is not None:
        return run(forward_call, args)      # m.positive(a, _result=np.zeros(3, bool))
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .dtype_names import SMALL_INTS, scalar_of

#: Result scalar types SlangPy's NumPy result cannot hold, and NumPy's type for each.
_HELD = {"bool": np.bool_, **SMALL_INTS}


def through_tensor(fn: Any, kwargs: dict) -> Callable[[Callable, tuple], Any] | None:
    """A runner of ``fn``'s call through a ``_result='tensor'`` when ``kwargs["_result"]`` is
    ``'numpy'`` or a NumPy array of NumPy's type of the result's scalar (bool, int8, ...) and
    the result is one SlangPy's NumPy path cannot write; None otherwise."""
    given = kwargs["_result"]
    numpy = isinstance(given, str) and given == "numpy"
    if not numpy and type(given) is not np.ndarray:
        return None
    base = scalar_of(fn.signature.return_type)
    if base not in _HELD or (not numpy and given.dtype != np.dtype(_HELD[base])):
        return None

    def run(call: Callable, args: tuple) -> Any:
        if any(type(v).__module__.startswith("torch") for v in (*args, *kwargs.values())):
            return call(fn, args, kwargs)  # (torch tensors in: the torch path says what it takes)
        out = call(fn, args, {**kwargs, "_result": "tensor"})
        values = out.numpy()
        if numpy:
            return values
        if values.shape != given.shape:
            raise ValueError(
                f"{fn.label}: _result is a NumPy array of shape {given.shape}, but the call "
                f"writes {values.shape} {fn.signature.return_type} values; pass an array of "
                f"shape {values.shape} or _result='numpy'"
            )
        if not given.flags.writeable:
            raise ValueError(f"{fn.label}: _result is a read-only NumPy array")
        given[...] = values
        return given

    return run
