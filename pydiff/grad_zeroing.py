"""torch's ``zero_grad(set_to_none=...)`` for a list of parameters: the optimizers' and the
``nn`` layers' (one rule, so ``layer.zero_grad()`` and ``opt.zero_grad()`` are the same).

    zero_grads(layer.parameters(), set_to_none=False, owner="Linear")

pydiff's gradients are buffers, never None: both values zero them; ``set_to_none`` says what
the next optimizer step does with a parameter no backward or write fills before it (see
``Storage.written_since_zeroed``, which the optimizers read).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

#: The writer of a gradient zeroed by zero_grad(set_to_none=False): a write, not ZEROED.
ZERO_GRADIENT = "zero_grad(set_to_none=False)"


def zero_grads(params: Iterable[Any], set_to_none: Any, owner: str) -> None:
    """Zero every parameter's gradient (submitted with the work that follows). With
    ``set_to_none`` True (torch's default) a zeroed gradient is no gradient: the next step
    skips the parameter unless something writes one first, as torch skips a ``.grad`` of
    None. With False a parameter that had a gradient (written since it was last zeroed:
    torch's ``.grad`` not None) keeps a zero one, which the next step applies (momentum,
    weight decay, Adam's moments, its step count), as torch does; one that had none stays
    without. ``owner`` names the caller in the TypeError for a ``set_to_none`` that is not
    a bool.

    >>> zero_grads(opt.params, set_to_none=True, owner="AdamW")
    """
    if not isinstance(set_to_none, (bool, np.bool_)):
        raise TypeError(f"{owner}.zero_grad: set_to_none={set_to_none!r}; expected True or False")
    for p in params:
        # torch zeroes a .grad not None, leaves None as None: a written gradient stays one
        kept = not set_to_none and (g := p.grad) is not None and g.storage.written_since_zeroed()
        p.zero_grad()
        if kept:
            p.grad.storage.wrote(ZERO_GRADIENT, everything=True)
