"""Module-level locks made anew in a forked child.

``fork()`` copies a lock as it is: one that another thread of the parent held at that moment
stays held in the child, where that thread does not exist, and the child's first call that
takes it waits forever. A module keeps such a lock through ``renewed_lock``, which makes it
now and registers it: in every forked child (``os.register_at_fork``) the module's name is
bound to a new lock before the child runs code of its own (``pydiff.forkguard``'s handler takes
none of these locks: the handlers' order does not matter). What a lock guarded stays as the
fork left it: the caches these locks guard change by single dict operations, so a change
another thread was making leaves at worst an entry missing or one too many (made again,
evicted later).

    _lock = renewed_lock(globals(), "_lock")        # threading.Lock()
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

# (module namespace, name, factory) of every lock registered
_registered: list[tuple[dict, str, Callable[[], Any]]] = []


def renewed_lock(namespace: dict, name: str, make: Callable[[], Any] = threading.Lock) -> Any:
    """A new lock (``make()``), to be bound to ``name`` in ``namespace`` (the calling module's
    ``globals()``), which every forked child binds to a new one."""
    _registered.append((namespace, name, make))
    return make()


def registered() -> dict[str, Any]:
    """The locks in force, by ``module.name`` (for diagnostics and tests)."""
    return {f"{ns.get('__name__')}.{name}": ns.get(name) for ns, name, _ in _registered}


def _renew_in_child() -> None:
    for namespace, name, make in _registered:
        namespace[name] = make()


os.register_at_fork(after_in_child=_renew_in_child)
