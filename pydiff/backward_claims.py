"""Fusing backwards on a tape: a recorded call's backward may take over the backward of the
call that produced one of its inputs, where that cannot change a gradient (``Claim``).

    claim = ctx.producer(0)          # in a Function's backward, under Tape.backward
    if claim is not None: ...; claim.take_over()
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

from .tensor import Tensor

#: The backward being run here (``Tape.backward`` sets it while it runs its entries).
running: contextvars.ContextVar["BackwardRun | None"] = contextvars.ContextVar(
    "pydiff_backward_run", default=None
)


def producer_claim(t: Tensor) -> "Claim | None":
    """In a recorded call's backward, run by ``Tape.backward``: the call that produced ``t``,
    if the backward may do that call's backward too (``Claim``), else None."""
    run = running.get()
    return run.claim(t) if run is not None else None


@dataclass
class Claim:
    """A backward's hold on the call that produced one of its inputs: ``function`` and
    ``ctx`` are that call's (a ``pydiff.Function`` and its FunctionCtx). After doing that
    call's backward as well, ``take_over()`` makes the tape skip it (one kernel for two).

    >>> claim = ctx.producer(0)                  # in a Function's backward
    >>> dw = claim.ctx.grad_target(1)            # the producer's input 1, added into here
    >>> claim.take_over()                        # its own backward is skipped
    """

    function: type
    ctx: Any
    entry: Any
    run: "BackwardRun"

    def take_over(self) -> None:
        self.run.skipped.add(id(self.entry))


class BackwardRun:
    """One ``Tape.backward`` walking its entries: which entry runs now and which are done."""

    def __init__(self, recorded: list[Any], needed: list[Any]) -> None:
        self.recorded = recorded
        self.pending = {id(e) for e in needed}
        self.skipped: set[int] = set()
        self.current: Any | None = None
        # Per storage: the entries that wrote it and those that read it (once per read);
        # indexed at the first claim (one pass over the tape, not one per claim).
        self._writers: dict[int, list[Any]] | None = None
        self._readers: dict[int, list[Any]] = {}

    def _index(self) -> dict[int, list[Any]]:
        if self._writers is None:
            self._writers = {}
            for e in self.recorded:
                ws = e.writes  # (one write, as most calls: no set to drop repeats)
                for w in (id(ws[0].storage),) if len(ws) == 1 else {id(w.storage) for w in ws}:
                    self._writers.setdefault(w, []).append(e)
                for _, r, _ in e.reads:
                    self._readers.setdefault(id(r.storage), []).append(e)
        return self._writers

    def claim(self, t: Tensor) -> Claim | None:
        """The call that wrote ``t``, if fusing its backward into the running one cannot
        change a gradient: it is a Function whose only output is ``t`` and whose backward is
        still to run; no other recorded call wrote ``t``'s storage or read it (views
        included), so ``t``'s gradient is the running call's alone; one buffer holds it."""
        current = self.current
        writers = self._index().get(id(t.storage), [])
        readers = self._readers.get(id(t.storage), [])
        if current is None or len(writers) != 1 or len(readers) != 1 or readers[0] is not current:
            return None
        entry = writers[0]
        if (
            id(entry) not in self.pending
            or id(entry) in self.skipped
            or entry.index >= current.index
            or len(entry.writes) != 1
            or entry.writes[0] is not t
            or "ctx" not in entry.payload
            or t.grad_in is not t.grad_out
        ):
            return None
        return Claim(entry.payload["function"], entry.payload["ctx"], entry, self)
