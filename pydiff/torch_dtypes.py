"""Which dtypes cross between pydiff and torch / DLPack producers, shared by ``from_torch``,
``to_torch`` and ``from_dlpack``: the exact ones (``FROM_TORCH``), the ones of a width pydiff
has, taken when ``dtype=`` asks for it (int64 as ``int64_t``, int8 as ``int8_t``, ...), the
narrowing ones (int64 as ``int``, float64 as ``float``), and ``to_torch``'s host copy of the
wider and narrower integers and ``double`` (where the installed torch has the dtype).

    target, arr = converted("int8", "int8_t", lambda: a, "from_dlpack", "")   # exact
    t = host_torch(x, torch)     # an int8_t tensor: torch.int8 (a CPU copy)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .host_values import to_float32

#: torch dtype name -> pydiff dtype, for the dtypes that convert exactly.
FROM_TORCH = {"float32": "float", "float16": "half", "int32": "int", "uint32": "uint"}
#: torch dtypes taken as they are when ``dtype=`` asks for the Slang type of their width.
SAME_WIDTH = {"int64": "int64_t", "uint64": "uint64_t", "float64": "double"}
SAME_WIDTH |= {f"{u}int{b}": f"{u}int{b}_t" for u in ("", "u") for b in (8, 16)}
#: torch dtypes converted only when asked for by ``dtype=`` (a narrowing copy).
ON_REQUEST = {"float64": ("float", np.float32), "int64": ("int", np.int32)}
#: pydiff scalar types ``to_torch`` hands over as a host copy only (no zero-copy view).
HOST_ONLY = {v: k for k, v in SAME_WIDTH.items()}


def converted(
    name: str, dtype: str | None, values: Callable[[], np.ndarray], where: str, prefix: str
) -> tuple[str, np.ndarray]:
    """The pydiff dtype and host values for values of dtype ``name`` (not in ``FROM_TORCH``
    as they are) asked for as ``dtype`` (a pydiff name or None), ``values()`` giving a
    contiguous array (or torch tensor: ``.numpy()`` taken); ``TypeError`` naming
    ``dtype=`` where none is asked for or the one asked cannot be had. ``prefix``: ``"torch."``
    for torch's dtype names in messages."""
    if dtype is not None and dtype == SAME_WIDTH.get(name):  # asked for: exact values
        return dtype, np.asarray(_host(values()))
    if name in ON_REQUEST and dtype == ON_REQUEST[name][0]:
        target, np_type = ON_REQUEST[name]
        arr = _host(values())
        if np_type is np.int32 and arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
            raise ValueError(
                f"{where}: int64 values from {arr.min()} to {arr.max()} do not fit dtype 'int'"
            )
        return target, (to_float32(arr, where) if np_type is np.float32 else arr.astype(np_type))
    accepted = ", ".join(f"{prefix}{n}" for n in FROM_TORCH)
    asked = f" as dtype={dtype!r}" if dtype is not None else ""
    hint = ""
    if dtype is None and name in SAME_WIDTH:
        hint = f"; pass dtype={SAME_WIDTH[name]!r} for the values as they are"
        if name in ON_REQUEST:
            hint += f', or dtype="{ON_REQUEST[name][0]}" for a narrowing copy'
    raise TypeError(
        f"{where}: a tensor of dtype {prefix}{name} cannot be converted{asked} (accepted: "
        f"{accepted}; others with the dtype= of their width){hint}"
    )


def _host(values: Any) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else values.numpy()


def host_torch(x: Any, torch: Any) -> Any:
    """A CPU torch tensor with the values of ``x`` (a pydiff tensor of a ``HOST_ONLY`` scalar
    type, or TypeError naming the dtype where ``torch`` has none for it)."""
    name = HOST_ONLY.get(x.scalar_type)
    if name is None or getattr(torch, name, None) is None:
        have = ", ".join(["float", "half", "int", "uint"] + list(HOST_ONLY))
        why = f"torch {torch.__version__} has no torch.{name}" if name else "no torch dtype"
        raise TypeError(
            f"to_torch: a tensor of dtype {x.dtype!r}: {why} (scalar types handed over: {have}"
            "; convert first, x.astype('float'))"
        )
    values = x.numpy().view(name)  # (uint64_t's NumPy type, ulonglong, is not torch's)
    return torch.from_numpy(values if values.flags.c_contiguous else values.copy(order="C"))
