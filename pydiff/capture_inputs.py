"""The inputs of a captured step (tensors it read that came from outside it), watched for a
replay: refused once one was dropped, as its name re-bound to a new tensor (``xb =
pydiff.tensor(batch)``) drops it, since the replay would read the old buffer, which nothing
writes any more, and train on the captured batch without a word.

Dropped: the storage gone, or a data input (one the step does not write: not a parameter,
whose replacement the optimizers and layers check themselves) or its storage held by fewer
references than when the step returned. The second covers an old tensor kept alive by what
the step keeps: a tape backward with ``retain_graph=True`` (the default) holds the tensors
its calls read, and the loss the step returns holds that tape.

    inputs = CapturedInputs()
    still_same = inputs.add([(desc, tensor), ...], written)   # a check for each replay
    inputs.settle(written)                                    # when the step has returned
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from typing import Callable


def _collect_all_garbage(patience_s: float = 5.0) -> None:
    """A full collection of reference cycles, run by this thread. ``gc.collect()`` does
    nothing while another thread's collection is under way (it lets the GIL go while running
    finalizers), and the cycles that collection is freeing still hold what they refer to
    (found under eight threads: a first step's tape, freed later, counted as a holder of the
    batch, so a replay was refused). So collect until this thread's own collection ran."""
    me, ran = threading.get_ident(), []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and info.get("generation") == 2 and threading.get_ident() == me:
            ran.append(True)

    deadline = time.monotonic() + patience_s
    gc.callbacks.append(seen)
    try:
        pause = 0.0005
        while True:
            gc.collect()
            if ran or time.monotonic() > deadline:  # (then counted anyway: a refusal is loud)
                return
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
    finally:
        gc.callbacks.remove(seen)


def _references(ref: weakref.ref) -> int:
    """How many references hold what ``ref`` refers to (0: gone)."""
    return 0 if (obj := ref()) is None else sys.getrefcount(obj)


class CapturedInputs:
    """The inputs one captured step read, with their reference counts when it returned."""

    def __init__(self) -> None:
        self._refs: list[tuple[weakref.ref, weakref.ref]] = []  # (tensor, its storage)
        self._held: dict[int, int] = {}  # id(weak reference) -> references at the return

    def add(self, read: list, written: dict) -> Callable[[], str | None] | None:
        """``read``: ``(description, tensor)`` a recorded call reads; those whose storage is
        not in ``written`` (by id: the step made or wrote it before) are inputs. Returns the
        check a replay runs (a reason it refuses, or None), or None when there is none."""
        outside = [
            (d, weakref.ref(t), weakref.ref(t.storage))
            for d, t in read
            if id(t.storage) not in written
        ]
        if not outside:
            return None
        self._refs += [(t, st) for _, t, st in outside]
        held = self._held

        def still_same() -> str | None:
            for desc, *refs in outside:
                if refs[1]() is None or any(_references(r) < held.get(id(r), 0) for r in refs):
                    return (
                        f"{desc}: the tensor it read was dropped (a name re-bound to a new "
                        "tensor?); the replay would read the old buffer, which nothing writes "
                        "any more"
                    )
            return None

        return still_same

    def settle(self, written: dict) -> None:
        """Count what holds each data input once the step returned (``written``: the storages
        it wrote, by id), after collecting garbage in reference cycles."""
        if not self._refs:
            return
        _collect_all_garbage()
        data = [(t, st) for t, st in self._refs if id(st()) not in written]
        self._held.update((id(r), _references(r)) for pair in data for r in pair)
