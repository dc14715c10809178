"""Forward mode through whole programs: while ``pydiff.jvp`` runs a Python function, the
tangent of every tensor it computes, kept here by identity (a context variable, per thread).

    with forward_trace.tracing(trace):          # pydiff.jvp
        y = f(x)                                # each op stores trace.set(out, tangent)
    dy = trace.tangent(y)

``Function.apply`` runs a class's ``jvp`` rule, shader calls run ``fwd_diff`` (the handler
the transforms layer provides), ``Tensor.reshape`` views the tangent. Rules run with the
trace suspended (their own ops carry no tangent of a tangent).
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Sequence

_active: contextvars.ContextVar["Trace | None"] = contextvars.ContextVar(
    "pydiff_forward_trace", default=None
)
_shader_call: list[Callable[..., Any]] = []


class Trace:
    """Tangents by tensor identity (the tensor is kept, so its id stays its own), and the
    views made under it (to give them their source's tangent again after an in-place write)."""

    def __init__(self) -> None:
        self._tangents: dict[int, tuple[Any, Any]] = {}
        self._on_storage: dict[int, list[Any]] = {}  # id(storage): tensors given a tangent
        self._views: dict[int, list[tuple[Any, Any, Callable[[Any], Any]]]] = {}

    def tangent(self, x: Any) -> Any:
        """The tangent of ``x`` (None: none, i.e. zero)."""
        item = self._tangents.get(id(x))
        return item[1] if item is not None and item[0] is x else None

    def set(self, x: Any, tangent: Any) -> None:
        if tangent is None:
            self._tangents.pop(id(x), None)
        else:
            self._tangents[id(x)] = (x, tangent)
            self._on_storage.setdefault(id(x.storage), []).append(x)

    def viewed(self, source: Any, view: Any, fn: Callable[[Any], Any]) -> None:
        """Note that ``view`` shows ``source``'s values (its tangent is ``fn(source's)``)."""
        self._views.setdefault(id(view.storage), []).append((view, source, fn))

    def replaced(self, x: Any, tangent: Any) -> None:
        """All the values of ``x``'s storage were written in place: every tensor on it loses
        its tangent, ``x`` takes ``tangent`` and the views made of it here follow."""
        for y in self._on_storage.pop(id(x.storage), []):
            if self.tangent(y) is not None:
                del self._tangents[id(y)]
        self.set(x, tangent)
        for view, source, fn in self._views.get(id(x.storage), []):
            if self.tangent(source) is not None:
                self.set(view, fn(self.tangent(source)))


#: ``active()``: the trace of the ``pydiff.jvp`` running here, if any (the context
#: variable's ``get``: no Python frame on every call's path).
active: Callable[[], Trace | None] = _active.get


class tracing:
    """Run a block with ``trace`` active (None: suspended)."""

    def __init__(self, trace: Trace | None) -> None:
        self._trace = trace

    def __enter__(self) -> Trace | None:
        self._token = _active.set(self._trace)
        return self._trace

    def __exit__(self, *exc: Any) -> None:
        _active.reset(self._token)


def suspended() -> tracing:
    """A block whose calls carry no tangents (a Function's forward, a jvp rule)."""
    return tracing(None)


def tangents_of(values: Sequence[Any]) -> tuple:
    """The tangent of each value under the active trace (all None without one)."""
    trace = _active.get()
    return tuple(None if trace is None else trace.tangent(v) for v in values)


def with_rule(primal: Callable[[], Any], rule: Callable[..., Any], args: Sequence[Any]) -> Any:
    """``primal()``, and under a trace, its tangent ``rule(tangents, result)`` stored (one
    tangent per argument, None where there is none); the rule is not run when none has one."""
    trace = _active.get()
    tangents = tangents_of(args)
    with suspended():
        result = primal()
        if trace is not None and any(t is not None for t in tangents):
            trace.set(result, rule(tangents, result))
    return result


def derived(source: Any, result: Any, view: Callable[[Any], Any]) -> Any:
    """``result`` (a view of ``source``), with ``view(tangent of source)`` as its tangent."""
    trace = _active.get()
    if trace is not None:
        if result.storage is source.storage:
            trace.viewed(source, result, view)
        tangent = trace.tangent(source)
        if tangent is not None:
            with suspended():
                trace.set(result, view(tangent))
    return result


def view_of(source: Any, result: Any, view: Callable[[Any], Any]) -> Any:
    """``derived`` for ``reshape`` and ``clone``, which also keep a tangent attached by hand
    (``x.with_tangent(u)`` read by ``.fwds``) outside ``pydiff.jvp``: ``view`` of it."""
    if _active.get() is None and source.tangent is not None:
        return result.with_tangent(view(source.tangent))
    return derived(source, result, view)


def replaced(x: Any, source: Any = None) -> Any:
    """``x`` after all of its values were written in place: by the host (``fill``,
    ``copy_from_numpy``, zeroing; no tangent) or copied from ``source`` (``copy_``: its
    tangent). Under a trace, the tangents of the tensors on x's storage follow. Returns x."""
    trace = _active.get()
    if trace is not None:
        tangent = None if source is None else trace.tangent(source)
        with suspended():
            trace.replaced(x, tangent)
    return x


def tangent_through(f: Callable[..., Any], args: Sequence[Any], tangents: Sequence[Any]) -> Any:
    """The tangent of ``f(*args)`` along ``tangents`` (one per argument, None: zero), under a
    trace of its own: a jvp rule that is a composition of other ops with rules."""
    trace = Trace()
    for a, t in zip(args, tangents):
        trace.set(a, t)
    with tracing(trace):
        out = f(*args)
    return trace.tangent(out)


def provide_shader_call(handler: Callable[..., Any]) -> None:
    """What a shader call runs under a trace (the transforms layer provides it)."""
    _shader_call[:] = [handler]


def shader_call(fn: Any, args: tuple, kwargs: dict) -> Any:
    """A shader function's call under a trace: its result and the result's tangent."""
    if not _shader_call:  # only if pydiff.forward_program was never imported
        raise NotImplementedError("forward mode of shader calls is provided by pydiff (import it)")
    return _shader_call[0](fn, args, kwargs)
