"""Arguments from other frameworks (torch tensors) in calls of shader functions and ops:
the call layer asks here, and the interop module above it registers how to run them.

    foreign.register(torch_tensor_classes, call_with_torch, "torch", advice)  # torch_interop
    handler = foreign.handler(args, kwargs)                   # None: only pydiff's values
    if handler: return handler(fn, args, kwargs)
    foreign.framework(value)                                  # "torch", or None
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class _Registration(NamedTuple):
    classes: Callable[[], tuple]
    call: Callable[[Any, tuple, dict], Any]
    name: str
    advice: str


_handlers: list[_Registration] = []


def register(
    classes: Callable[[], tuple],
    call: Callable[[Any, tuple, dict], Any],
    name: str = "foreign",
    advice: str = "",
) -> None:
    """Run calls with an argument of one of ``classes()`` (the classes loaded now: () while
    their framework is not imported) through ``call(fn, args, kwargs)`` instead. ``name``
    (the framework, "torch") and ``advice`` (how to convert its values) go into the messages
    of the places that cannot take them."""
    _handlers.append(_Registration(classes, call, name, advice))


def _registration(value: Any) -> _Registration | None:
    for reg in _handlers:
        kinds = reg.classes()
        if kinds and isinstance(value, kinds):
            return reg
    return None


def handler(args: tuple, kwargs: dict) -> Callable[[Any, tuple, dict], Any] | None:
    """The ``call`` of the first registration with an argument of its classes, or None."""
    for classes, call, _, _ in _handlers:
        kinds = classes()
        if kinds:
            for a in args:
                if isinstance(a, kinds):
                    return call
            for v in kwargs.values():
                if isinstance(v, kinds):
                    return call
    return None


def framework(value: Any) -> str | None:
    """The name of the framework ``value`` is a tensor of ("torch"), or None."""
    reg = _registration(value)
    return reg.name if reg is not None else None


def advice(value: Any) -> str:
    """How to convert ``value``, a foreign tensor, for pydiff ("" when not one)."""
    reg = _registration(value)
    return reg.advice if reg is not None else ""
