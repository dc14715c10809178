"""Shader objects bound for recent dispatches of pydiff's kernels, kept for reuse: binding by
keyword builds a new root object at every dispatch (about half of a dispatch's 30-45 us on the
CPU), while a kept object binds the same buffers again and sets only the uniforms that changed.
A dispatch site may hold its own object (``held``), whatever its buffers' sizes. Each device's
``KernelCache`` owns one ``BoundObjects`` and calls it under its lock.

    root = device.kernels.bound_objects.bound(kernel, [("x", buf)], [("scale", 2.0)], None)
    # None: not kept (a large buffer): the caller dispatches binding by keyword
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from math import copysign
from operator import is_, itemgetter
from typing import Any

import slangpy as spy

# Root shader objects with the buffers of recent dispatches bound, for reuse: binding by
# keyword builds a new object each time (about half of a dispatch's 30-45 us on the CPU). An
# object keeps its buffers' device memory alive, so a key of buffer handles cannot match a
# different, newer buffer; only small buffers are kept this way. Both caches are LRU and
# bounded: a buffer that died (a temporary of one step) never matches again, so without a
# bound its objects would pile up (about 11 KB each on lavapipe, plus the buffers they pin).
# A training step's working set is far below these counts; a miss costs one object (~15 us).
OBJECTS_MAX = 512
OBJECTS_MAX_BYTES = 64 << 20
OBJECT_MAX_BUFFER = 4 << 20
# A caller that dispatches the same buffers again and again (an optimizer: parameters,
# gradients, state) may keep the object of a dispatch site itself (``dispatch(held=[])``),
# for buffers of any size, replaced when the buffers change: without it, a 10M-parameter
# AdamW step rebuilt its 28-buffer object every step (about 150 us of host time on CUDA).


class BoundObjects:
    """The root shader objects a device's ``KernelCache`` keeps bound, LRU and bounded (callers
    hold the cache's lock): ``entries`` maps ``(kernel, buffer handles...)`` to
    ``[root, cursor, bytes, last scalars, field cursors]``; ``bytes`` is their buffers' total."""

    def __init__(self, native_device: spy.Device):
        self.native = native_device
        self.entries: OrderedDict = OrderedDict()
        self.bytes = 0
        self._held_sites: weakref.WeakSet = weakref.WeakSet()  # (new_held's)

    def bound(
        self, kernel: Any, buffers: list, scalars: list, held: Any, held_max: int | None = None
    ) -> Any:
        """The root object binding ``buffers`` (``(name, spy.Buffer)`` pairs) with ``scalars``
        (``(name, value)``) set, kept in ``held`` (a dispatch site's list) or the shared cache;
        None where it may not be kept (the caller binds by keyword)."""
        if held and held[0][0] is kernel and same_objects(held[2], buffers):
            entry = held[1]  # the very buffer objects of its last dispatch: no handles to read
        else:
            entry = self.new_or_cached(kernel, buffers, held, held_max)
            if entry is None:
                return None
        root, cursor, _, last, fields = entry
        # Uniforms are copied when the dispatch is recorded; setting one costs 1.3-1.7 us, so
        # only those that changed since this object's last dispatch are set (an optimizer
        # step changes 2 of its 16). The object holds exactly ``last``'s values. A changed
        # one is written through its field's cursor, found once (``cursor[name] = value``
        # looks the name up in Slang's reflection each time: 1.8 against 0.5 us).
        if last is None or len(last) != len(scalars):
            for name, value in scalars:
                cursor[name] = value
        else:
            for item, old in zip(scalars, last):
                if item is old:
                    continue  # (the very pair: the same name, value, type and sign)
                value, was = item[1], old[1]
                # Unchanged: an equal pair (one C comparison; NaN never equal), one type (1, 1.0,
                # True bind apart), a float zero's sign (0.0 == -0.0). Inline: 3.5 -> 1.7 us/22.
                if (
                    item == old
                    and type(value) is type(was)
                    and (
                        value
                        or type(value) is not float
                        or copysign(1.0, value) == copysign(1.0, was)
                    )
                ):
                    continue
                field = fields.get(item[0])
                if field is None:
                    field = fields[item[0]] = cursor[item[0]]
                field.write(value)
        entry[3] = scalars
        return root

    def new_or_cached(self, kernel: Any, buffers: list, held: Any, held_max: int | None) -> Any:
        """The object entry ``[root, cursor, bytes, last scalars, field cursors]`` binding
        ``buffers``: the held one or the cache's if it binds the same handles, else a new one
        (kept in ``held`` or the cache); a buffer past ``held_max`` makes it the cache's; None
        where it may not be kept (a buffer past ``OBJECT_MAX_BUFFER``, outside ``held``)."""
        if held is not None and held_max is not None:
            if any(b.size > held_max for _, b in buffers):
                held.clear()  # (its object would pin the buffers it binds)
                held = None  # too large for the site to keep: the shared cache's rules
        if held is not None and held and held[0][0] is kernel and len(held[2]) == len(buffers):
            # The site's object, its changed buffers bound again (a new result per call):
            # bindings are copied when a dispatch is recorded, as its uniforms are, and this
            # costs a fraction of a new object. (No key: a site's is its kernel alone.)
            entry = held[1]
            cursor = entry[1]
            for (name, buffer), old in zip(buffers, held[2]):
                if buffer is not old and buffer.native_handle.value != old.native_handle.value:
                    cursor[name] = buffer
            held[2] = [b for _, b in buffers]
            return entry
        # The kernel itself is in the key (not its id): an evicted kernel's id may be reused.
        key = (kernel, *[b.native_handle.value for _, b in buffers])  # (a list: no generator)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry
        if held is None and any(b.size > OBJECT_MAX_BUFFER for _, b in buffers):
            return None
        size = sum({id(b): b.size for _, b in buffers}.values())
        root = self.native.create_root_shader_object(kernel.program)
        cursor = spy.ShaderCursor(root).find_entry_point(0)
        for name, buffer in buffers:
            cursor[name] = buffer
        entry = [root, cursor, size, None, {}]
        if held is not None:
            # (the object of replaced buffers goes at once; the buffers themselves are kept
            # to recognise them: the object holds them anyway)
            held[:] = [key, entry, [b for _, b in buffers]]
        else:
            self.entries[key] = entry
            self.bytes += size
            while self.bytes > OBJECTS_MAX_BYTES or len(self.entries) > OBJECTS_MAX:
                self.bytes -= self.entries.popitem(last=False)[1][2]
        return entry

    def forget(self, kernel: Any) -> None:
        """Drop the objects of an evicted ``kernel`` (they keep it alive)."""
        for name in [k for k in self.entries if k[0] is kernel]:
            self.bytes -= self.entries.pop(name)[2]

    def new_held(self) -> HeldObject:
        """A list for ``dispatch(held=)`` that ``release`` empties."""
        held = HeldObject()
        self._held_sites.add(held)
        return held

    def release(self) -> None:
        """Drop the cached objects and those of ``new_held``'s lists (and the device memory
        they keep alive)."""
        for held in list(self._held_sites):
            held.clear()
        self.entries.clear()
        self.bytes = 0


class HeldObject(list):
    """A dispatch site's bound object, as ``dispatch(held=)`` keeps it (an empty list until the
    first dispatch); ``BoundObjects.release`` (``KernelCache.release_objects``) empties those
    it handed out."""

    __slots__ = ("__weakref__",)
    __eq__ = object.__eq__  # (kept in a WeakSet: by identity, as two empty lists are equal)
    __hash__ = object.__hash__


def same_objects(kept: list, buffers: list) -> bool:
    """``buffers`` binds exactly the buffer objects ``kept``, in order."""
    # (C loops: the optimizer's site binds 28 buffers)
    return len(kept) == len(buffers) and all(map(is_, kept, map(itemgetter(1), buffers)))
