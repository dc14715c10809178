"""The arithmetic, indexing and math methods of ``Tensor``: ``Tensor`` (a low layer) calls
them by name here, and ``tensor_api`` (beside the ops, above it) provides them.

    tensor_methods.provide("add", ops.add)          # tensor_api, on import
    tensor_methods.call("add", x, 2.0)              # x + 2.0
"""

from __future__ import annotations

from typing import Any, Callable

_provided: dict[str, Callable[..., Any]] = {}


def provide(name: str, implementation: Callable[..., Any]) -> None:
    """What ``Tensor`` runs for the method or operator ``name``."""
    _provided[name] = implementation


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """Run the method or operator ``name``."""
    implementation = _provided.get(name)
    if implementation is None:  # only if pydiff.tensor_api was never imported
        raise NotImplementedError(f"Tensor.{name} is provided by pydiff.tensor_api (import pydiff)")
    return implementation(*args, **kwargs)
