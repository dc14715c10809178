"""Arguments from other frameworks (torch tensors) in calls of shader functions and ops:
the call layer asks here, and the interop module above it registers how to run them.

    foreign.register(is_torch_tensor, call_with_torch)   # pydiff.torch_interop, on import
    handler = foreign.handler(args, kwargs)             # None: only pydiff's own values
    if handler: return handler(fn, args, kwargs)
"""

from __future__ import annotations

from typing import Any, Callable

_handlers: list[tuple[Callable[[Any], bool], Callable[[Any, tuple, dict], Any]]] = []


def register(recognises: Callable[[Any], bool], call: Callable[[Any, tuple, dict], Any]) -> None:
    """Run calls that have an argument ``recognises`` accepts through ``call(fn, args,
    kwargs)`` instead."""
    _handlers.append((recognises, call))


def handler(args: tuple, kwargs: dict) -> Callable[[Any, tuple, dict], Any] | None:
    """The ``call`` of the first registration recognising one of the arguments, or None."""
    for recognises, call in _handlers:
        if any(recognises(a) for a in args) or any(recognises(v) for v in kwargs.values()):
            return call
    return None
