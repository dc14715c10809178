"""Where a copy of a tensor's values would lose a derivative silently: NumPy's conversion
(``Tensor.__array__``, ``numpy_functions``) and the DLPack export refuse such copies.

    why = losing_derivative(x)     # None, or why a copy of x's values loses its derivative
"""

from __future__ import annotations

from . import forward_trace
from .backward_scope import active_scope
from .tape import active_tape
from .tensor import Tensor


def losing_derivative(t: Tensor) -> str | None:
    """Why a NumPy copy of ``t``'s values would lose a derivative here, or None: it requires
    a gradient while a tape records, or has a tangent while ``pydiff.jvp`` traces. (Inside a
    backward, a ``Function.backward`` run by ``tape.backward`` within the tape's ``with``,
    values are read for the gradient itself: pydiff records no backward, so none is lost.)

    >>> losing_derivative(x)      # 'requires a gradient and a pydiff.Tape is recording'
    """
    if t.requires_grad and active_tape() is not None and active_scope() is None:
        return "requires a gradient and a pydiff.Tape is recording"
    trace = forward_trace.active()
    if trace is not None and trace.tangent(t) is not None:
        return "has a tangent while pydiff.jvp traces the function"
    return None


def refuse_lost_copy(t: Tensor, where: str) -> None:
    """Refuse a new tensor made from ``t``'s values (``where``, e.g. "pydiff.tensor: data",
    names the API) where the copy would lose a derivative (``losing_derivative``), as NumPy's
    conversion of ``t`` is: the copy is a new leaf, so no gradient reaches ``t``.

    >>> refuse_lost_copy(x, "pydiff.from_dlpack")   # on a tape, x requiring grad: TypeError
    """
    why = losing_derivative(t)
    if why is not None:
        raise TypeError(
            f"{where}: a pydiff.Tensor of shape {t.shape} that {why}: the copy is a new "
            "tensor with no derivative link to it, so the gradient through it would be lost. "
            "Use the tensor itself (or pydiff ops on it) to keep the gradient; to copy the "
            "values on purpose, pass x.detach()"
        )
