"""Arguments from other frameworks (torch tensors) in calls of shader functions and ops:
the call layer asks here, and the interop module above it registers how to run them.

    foreign.register(torch_tensor_classes, call_with_torch)   # pydiff.torch_interop
    handler = foreign.handler(args, kwargs)                   # None: only pydiff's values
    if handler: return handler(fn, args, kwargs)
"""

from __future__ import annotations

from typing import Any, Callable

_handlers: list[tuple[Callable[[], tuple], Callable[[Any, tuple, dict], Any]]] = []


def register(classes: Callable[[], tuple], call: Callable[[Any, tuple, dict], Any]) -> None:
    """Run calls with an argument of one of ``classes()`` (the classes loaded now: () while
    their framework is not imported) through ``call(fn, args, kwargs)`` instead."""
    _handlers.append((classes, call))


def handler(args: tuple, kwargs: dict) -> Callable[[Any, tuple, dict], Any] | None:
    """The ``call`` of the first registration with an argument of its classes, or None."""
    for classes, call in _handlers:
        kinds = classes()
        if kinds:
            for a in args:
                if isinstance(a, kinds):
                    return call
            for v in kwargs.values():
                if isinstance(v, kinds):
                    return call
    return None
