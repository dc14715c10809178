"""Which pydiff storage a raw SlangPy tensor's buffer belongs to, for the buffers whose handle
``Tensor.native`` gave out: a SlangPy tensor made from such a handle (``x.native``,
``x.native.view(...)``) holds ``x``'s values, and a write through it that pydiff does not
count (``m.f(z, _result=x.native)``, or a ``Tensor(view, device)`` with a storage of its own)
left ``x``'s version unchanged: a tape's backward differentiated at the new values
(``tape.backward`` of ``y = x * x`` gave 18 everywhere where 2x is right; s42).

A ``Tensor(view, device)`` of such a handle shares ``x``'s values, not its gradient buffers:
``.bwds`` through it gives ``x`` no gradient, so it is noted (``grad_handle_of``) and warned of.

    native = handed_out(x.storage, x_native, x)  # in Tensor.native
    owner(view.storage, t) is x.storage          # a view of the handle: x's storage
    grad_handle_of(t)                            # x, if x requires a gradient
    handle_note(t)                               # '_Take' for Tensor(x[2:5].native, dev)
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

#: Storages whose buffer ``Tensor.native`` handed out (id(buffer) -> weak reference), so that a
#: SlangPy tensor made from that handle (``x.native``, ``x.native.view(...)``) is known to hold
#: their values: ``Tensor(view, device)`` shares the storage (its writes count on ``x``'s
#: version), and a forward call refuses it as ``_result`` (a write no version would count).
_HANDED: dict[int, weakref.ref] = {}
#: The handles each buffer was handed out as, by id(buffer): {id(handle): (handle, {id(tensor):
#: weak reference to a tensor that handed it out})}. The handle is held (SlangPy's tensors take no
#: weak references) until only this table holds it (pruned when a handle is added), so that a
#: ``Tensor(handle, dev)`` made after the tensor that gave it out died (``x.detach().native``) is
#: still known to be that handle and not a view of another (s48: it was warned of as ``x``'s).
_HANDERS: dict[int, dict[int, tuple[Any, dict[int, weakref.ref]]]] = {}
#: Tensors made from a handed-out handle (``Tensor(x.native.view(...), dev)``), by id: the
#: buffer's key, and the handle's entry in ``_HANDERS`` when made from a handle itself (None: a
#: view, which may come from any of the buffer's handles). By id: tensors refuse ``==``.
_WRAPS: dict[int, tuple[weakref.ref, int, Any]] = {}


#: Handles handed out by a tensor noted by the ``describe_with`` hook (a slice made off a tape,
#: ``x[2:5].native``), by id(handle): (handle, its storage, the note, the storage's version
#: then). The storage is held with the handle, so a ``Tensor(handle, dev)`` made after the
#: tensor died (at once, for a temporary) shares it and its note (s48); dropped once only
#: these tables hold the handle (checked at each ``handed_out`` and ``owner`` while any).
_NOTED: dict[int, tuple[Any, Any, str, int]] = {}
_DESCRIBE: list = []  # (the hook: tensor -> note or None; unrecorded's made_off_tape)


def describe_with(describe: Any) -> None:
    """Note, with each handle a tensor hands out, ``describe(tensor)`` (a str, or None):
    ``handle_note`` gives it for a tensor made from the handle, after that tensor died too."""
    _DESCRIBE[:] = [describe]


def handle_note(t: Any) -> str | None:
    """The note (``describe_with``) of the handle ``t`` was made from, or of any handle of its
    buffer for a view of one, while its storage holds the values it held then; else None."""
    wrap = _WRAPS.get(id(t)) if _WRAPS and _NOTED else None
    if wrap is None or wrap[0]() is not t:
        return None
    for handle, storage, note, version in list(_NOTED.values()):
        if id(storage.buffer) == wrap[1] and (wrap[2] is None or wrap[2][0] is handle):
            if storage.version == version:
                return note
    return None


def _sweep() -> None:
    for k in [k for k, kept in _NOTED.items() if sys.getrefcount(kept[0]) <= 4]:
        del _NOTED[k]  # (only _NOTED and _HANDERS hold the handle: nothing can wrap it)


def handed_out(storage: Any, native: Any, by: Any = None) -> Any:
    """Note that ``storage``'s buffer was handed out as ``native`` (``Tensor.native`` of
    tensor ``by``); returns ``native``."""
    key = id(storage.buffer)
    ref = _HANDED.get(key)
    if ref is None or ref() is not storage:
        _HANDED[key] = weakref.ref(storage, lambda r, k=key: _drop(k, r))
        _HANDERS.pop(key, None)  # (a dead storage's buffer id reused)
    if by is None:
        return native
    entry = (_HANDERS.get(key) or {}).get(id(native))
    if entry is not None and entry[0] is native and id(by) in entry[1]:
        return native  # (the common case: handed out by this tensor before)
    if _NOTED:
        _sweep()
    handles = _HANDERS.setdefault(key, {})
    if entry is None or entry[0] is not native:
        for k in [k for k, (h, hs) in handles.items() if not hs and sys.getrefcount(h) <= 3]:
            del handles[k]  # (held here only: nothing can wrap it any more)
        entry = handles[id(native)] = (native, {})
    handers = entry[1]
    handers[id(by)] = weakref.ref(by, lambda r, k=id(by), h=handers: h.pop(k, None))
    if _DESCRIBE and (note := _DESCRIBE[0](by)) is not None:
        _NOTED[id(native)] = (native, storage, note, storage.version)
    return native


def _drop(key: int, ref: weakref.ref) -> None:
    if _HANDED.get(key) is ref:  # (not a newer storage's entry)
        del _HANDED[key]
        _HANDERS.pop(key, None)


def owner(buffer: Any, made: Any = None, native: Any = None) -> Any:
    """The live storage whose ``buffer`` this is and whose buffer ``Tensor.native`` handed out,
    or None (never handed out: a buffer SlangPy or the user made). ``made``: the tensor being
    made from it, from SlangPy tensor ``native`` (noted for ``grad_handle_of``)."""
    if _NOTED:
        _sweep()
    ref = _HANDED.get(id(buffer)) if _HANDED else None
    found = ref() if ref is not None else None
    if found is None or found.buffer is not buffer:
        return None
    if made is not None:
        entry = _HANDERS.get(id(buffer), {}).get(id(native))
        _WRAPS[id(made)] = (
            weakref.ref(made, lambda r, k=id(made): _WRAPS.pop(k, None)),
            id(buffer),
            entry if entry is not None and entry[0] is native else None,
        )
    return found


def grad_handle_of(t: Any) -> Any:
    """A tensor requiring a gradient whose handle ``t`` was made from (``Tensor(x.native.view(
    ...), dev)``: ``t`` shares ``x``'s values, not its gradient buffers), or None. Made from a
    handle itself (not a view), only the tensors that handed that handle out count: not ``x``
    for ``Tensor(x.detach().native, dev)``."""
    return next((h for h in handers_of(t) if h.requires_grad), None)


def handers_of(t: Any) -> list:
    """The live tensors whose handle ``t`` was made from (``Tensor(s.native, dev)``: ``[s]``;
    for a view of a handle, every tensor that handed out the buffer), ``t`` itself left out;
    [] for a tensor made otherwise."""
    wrap = _WRAPS.get(id(t)) if _WRAPS else None
    if wrap is None or wrap[0]() is not t:
        return []
    entries = [wrap[2]] if wrap[2] is not None else _HANDERS.get(wrap[1], {}).values()
    found = (ref() for _, handers in list(entries) for ref in list(handers.values()))
    return [h for h in found if h is not None and h is not t]
