"""Which pydiff storage a raw SlangPy tensor's buffer belongs to, for the buffers whose handle
``Tensor.native`` gave out: a SlangPy tensor made from such a handle (``x.native``,
``x.native.view(...)``) holds ``x``'s values, and a write through it that pydiff does not
count (``m.f(z, _result=x.native)``, or a ``Tensor(view, device)`` with a storage of its own)
left ``x``'s version unchanged: a tape's backward differentiated at the new values
(``tape.backward`` of ``y = x * x`` gave 18 everywhere where 2x is right; s42).

    native = handed_out(x.storage, x_native)  # in Tensor.native
    owner(view.storage) is x.storage          # a view of the handle: x's storage
"""

from __future__ import annotations

import weakref
from typing import Any

#: Storages whose buffer ``Tensor.native`` handed out (id(buffer) -> weak reference), so that a
#: SlangPy tensor made from that handle (``x.native``, ``x.native.view(...)``) is known to hold
#: their values: ``Tensor(view, device)`` shares the storage (its writes count on ``x``'s
#: version), and a forward call refuses it as ``_result`` (a write no version would count).
_HANDED: dict[int, weakref.ref] = {}


def handed_out(storage: Any, native: Any) -> Any:
    """Note that ``storage``'s buffer was handed out as ``native`` (``Tensor.native``);
    returns ``native``."""
    key = id(storage.buffer)
    ref = _HANDED.get(key)
    if ref is None or ref() is not storage:
        _HANDED[key] = weakref.ref(storage, lambda r, k=key: _drop(k, r))
    return native


def _drop(key: int, ref: weakref.ref) -> None:
    if _HANDED.get(key) is ref:  # (not a newer storage's entry)
        del _HANDED[key]


def owner(buffer: Any) -> Any:
    """The live storage whose ``buffer`` this is and whose buffer ``Tensor.native`` handed out,
    or None (never handed out: a buffer SlangPy or the user made)."""
    ref = _HANDED.get(id(buffer)) if _HANDED else None
    found = ref() if ref is not None else None
    return found if found is not None and found.buffer is buffer else None
