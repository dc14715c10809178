"""What a tape's recording says of the tensors a call reads that it did not make: results of
another tape (a warning: its backward stops there), results of a recording a tape forgot
(``Forgotten``, their producer: a backward from them refused, a read of one warned), values
copied from a gradient path (refused: no gradient would reach their source).

    check_reads(tape, "m.f", [("m.f: parameter 'x'", x, x.storage.version)])
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from .errors import warn_once
from .tensor import Tensor
from .unrecorded import copied_from


class Forgotten:
    """The producer of tensors whose recording a tape forgot (``backward(...,
    retain_graph=False)``, ``reset()``): a backward from them is refused, and a tape that
    reads one of those results (or a view of one) warns that no gradient flows past it."""

    def __init__(self, why: str, results: Sequence[Tensor] = ()) -> None:
        self.why = why
        # The results themselves, weakly, by id checked by identity (tensors refuse ==): a
        # new leaf made from their values (``detach()`` shares the storage, and so this
        # producer) is a leaf on purpose.
        self._results = {id(t): weakref.ref(t) for t in results}

    def made(self, t: Tensor) -> bool:
        """Whether ``t`` is one of the forgotten results or a view of one."""
        for candidate in (t, t.base):
            held = self._results.get(id(candidate)) if candidate is not None else None
            if held is not None and held() is candidate:
                return True
        return False

    def refusal(self, where: str) -> RuntimeError:
        return RuntimeError(
            f"{where}: the tensor was made by calls whose recording was forgotten by "
            f"{self.why}; record the calls again on a tape (tape.backward's retain_graph=True, "
            "the default, keeps a recording for another backward)"
        )

    def backward(self, output: Tensor, grad: Any = None, *, retain_graph: bool = True) -> None:
        raise self.refusal("backward()")


def check_reads(tape: Any, label: str, reads: list) -> None:
    """What ``tape`` says of the tensors a call ``label`` records as read (``(description,
    tensor, version)``): a warning where one that requires a gradient was made by another
    tape (unless it ``reads_other_tapes``) or by a forgotten recording (its gradient stops
    there), a refusal where one holds values copied from a gradient path."""
    for desc, t, _ in reads:
        producer = t.storage.producer  # (Tensor.producer's, without its call)
        if producer is None or producer is tape:
            pass
        elif type(producer) is Forgotten and t.requires_grad and producer.made(t):
            warn_once(
                f"{desc} was made by calls whose recording was forgotten by "
                f"{producer.why}: the gradient stops at it (it gets one; what it was "
                "made from gets none). Record those calls on this tape, or pass "
                "t.detach() to mean a constant"
            )
        elif (
            type(producer) is type(tape)  # (another Tape)
            and not tape.reads_other_tapes
            and t.requires_grad
            and producer.made(t)
        ):
            warn_once(
                f"{desc} was made by a call recorded on another tape: this tape's backward "
                "gives it a gradient and stops there (what it was made from gets none). "
                "Record those calls on this tape, pass t.detach() to mean a constant, or "
                "chain the backwards yourself (other_tape.backward(t, grad=t.grad) after "
                "this one; Tape(reads_other_tapes=True) says so and does not warn)"
            )
        if (copied := copied_from(t)) is not None:  # (also through unrecorded calls)
            raise RuntimeError(
                f"{label}: {desc} holds {copied}, so no gradient would "
                "reach what they were copied from: use src.clone() (recorded) or copy from "
                "src.detach() to mean a constant"
            )
