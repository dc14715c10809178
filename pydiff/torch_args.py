"""Where the torch tensors given to a call go, and how its arguments are named in errors.

A torch tensor in a call of a shader function or an op is copied into a pydiff tensor on the
call's device: the device the function's module was loaded on, else that of the call's
first pydiff tensor argument, else the default device (before, always the default device,
so a module loaded on another device refused every call with torch tensors).

>>> torch_args.home_device(m2.f, (t, w), {})       # m2's device
"""

from __future__ import annotations

from typing import Any

from .device import Device
from .tensor import Tensor


def home_device(fn: Any, args: tuple, kwargs: dict) -> Device | None:
    """The device a call of ``fn`` with these arguments runs on, where it can be told."""
    owner = getattr(fn, "module", None) or getattr(
        next(iter(getattr(fn, "overloads", ()) or ()), None), "module", None
    )
    device = getattr(owner, "device", None)
    if isinstance(device, Device):
        return device
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value.device
    return None


def describe(fn: Any, k: int) -> str:
    """Argument ``k`` of ``fn`` as errors name it (with its parameter's name when known)."""
    params = getattr(getattr(fn, "signature", None), "params", None)
    if params is not None and k < len(params):
        return f"argument {k} (parameter {params[k].name!r})"
    return f"argument {k}"
