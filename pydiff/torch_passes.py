"""The zeroing policy once per torch backward pass, however many pydiff calls it reaches.

torch runs the backward of each pydiff call in its graph (``torch_function``'s node) as a
node of its own, and each node runs its call's pydiff tape. Were each node a top-level
backward, RESET would zero a parameter shared by two calls before each (keeping the last
call's share) and STRICT would refuse the second call's share as stale. So the nodes of
one torch pass (one ``backward()`` or ``torch.autograd.grad``: torch's graph task) share
the set of gradient buffers the policy already acted on: the first node to reach a buffer
resets or checks it, later nodes of the pass add into it. A later pass starts afresh.

    with torch_pass():                  # inside the torch node's backward
        tape.backward(out, grad=g)

``accumulates_leaves`` says whether the running pass is one that writes every leaf's ``.grad``
(``backward()`` without ``inputs=``): ``torch.autograd.grad`` and ``backward(inputs=...)``
write none but the tensors they name, so pydiff's leaves (never named) keep theirs.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from .backward_scope import separate_backward, shared_pass
from .errors import warn_once
from .fork_locks import renewed_lock
from .forward_program import lent_grads
from .policy import ZeroPolicy, get_zero_policy

#: Passes whose end torch has not reported yet (graph task id -> buffers acted on). An
#: abandoned pass (one that raised) never reports its end: the oldest are dropped past this.
_MAX_OPEN = 64
_open: collections.OrderedDict[int, set[int]] = collections.OrderedDict()
_lock = renewed_lock(globals(), "_lock")  # (new in a forked child)
_NATIVE, _TASK_ID, _ENGINE = "_C", "_current_graph_task_id", "_execution_engine"
_WILL_EXECUTE = "_will_engine_execute_node"


def running_pass() -> int | None:
    """The torch backward pass running now (its graph task id), or None: a pydiff call made
    inside one (a reentrant ``torch.utils.checkpoint`` recomputing its forward in the outer
    pass's backward, then running a nested pass of its own) belongs to that outer pass, so
    its node's backward joins it (``torch_pass(within=...)``): a nested pass of its own
    would apply RESET again, zeroing the outer pass's share of a shared parameter."""
    import torch

    current = getattr(getattr(torch, _NATIVE), _TASK_ID, None)
    engine = getattr(torch.autograd.Variable, _ENGINE, None)
    task = current() if current is not None and engine is not None else -1
    if task < 0:
        return None
    _seen_for(task, engine)  # (its end reported to _close: we are inside it)
    return task


def _seen_for(task: int, engine: Any) -> set[int]:
    with _lock:
        seen = _open.get(task)
        if seen is None:
            seen = _open[task] = set()
            engine.queue_callback(lambda: _close(task))
            while len(_open) > _MAX_OPEN:
                _open.popitem(last=False)
    return seen


def torch_pass(within: int | None = None) -> Any:
    """A context for one torch node's pydiff backward: joined to the other pydiff nodes of
    the running torch backward pass, if torch names one (else on its own), or to the pass
    ``within`` that made the node (``running_pass``) while that one still runs.

    >>> with torch_pass(ctx.within):
    ...     ctx.tape.backward(out, grad=g)
    """
    import torch

    # torch names its passes only privately: its graph task id (-1 outside a backward), and
    # the engine's callback at a pass's end (what DistributedDataParallel uses). Looked up
    # by name, so that a torch without them is refused below rather than breaking imports.
    current = getattr(getattr(torch, _NATIVE), _TASK_ID, None)
    engine = getattr(torch.autograd.Variable, _ENGINE, None)
    if current is None or engine is None:
        if get_zero_policy() is not ZeroPolicy.ACCUMULATE:
            raise RuntimeError(
                f"pydiff: the {get_zero_policy().value!r} zeroing policy inside torch autograd "
                f"needs torch to name its backward passes (torch {torch.__version__} does not: "
                "torch 2.1 or newer does), else a parameter used by several pydiff calls would "
                "keep one call's gradient only. Upgrade torch, or use "
                "pydiff.zero_policy('accumulate') and zero gradients yourself"
            )
        return shared_pass(set())
    task = current()
    if task < 0:  # not inside a torch backward (a node's backward called by hand)
        return shared_pass(set())
    if within is not None and within != task:
        with _lock:
            outer = _open.get(within)
        if outer is not None:  # a nested pass of the pass that made the node, which runs
            return shared_pass(outer)
    return shared_pass(_seen_for(task, engine))


def _close(task: int) -> None:
    with _lock:
        _open.pop(task, None)


def accumulates_leaves(anchor_node: Any) -> bool:
    """Whether the running torch pass runs ``anchor_node`` (the gradient accumulator of a
    leaf that every pydiff node in a torch graph takes as an input, and that no user names):
    True in ``backward()`` without ``inputs=``, False in ``torch.autograd.grad`` and
    ``backward(inputs=...)``, which write no ``.grad`` but their named tensors'. A torch
    without the means to ask (private, torch 2.0 and newer have it) gets True, with a warning.

    >>> if accumulates_leaves(ctx.next_functions[0][0]): ...   # add into the pydiff leaves
    """
    import torch

    will_execute = getattr(getattr(torch, _NATIVE), _WILL_EXECUTE, None)
    if will_execute is None:
        warn_once(
            f"pydiff: torch {torch.__version__} cannot say which leaves a backward pass "
            "writes (torch 2.0 or newer can): torch.autograd.grad and backward(inputs=...) "
            "through pydiff calls add into pydiff tensors' .grad as backward() does"
        )
        return True
    try:
        return bool(will_execute(anchor_node))
    except RuntimeError:  # not inside a torch pass (a node's backward called by hand)
        return True


class pass_without_leaves:
    """A torch node's pydiff backward in a pass that writes no pydiff leaf's ``.grad``: the
    tensors ``tape`` read other than ``leaves`` (the torch arguments' pydiff copies) hold
    fresh gradient buffers meanwhile. A backward of its own: the policy of the pass's other
    nodes acts on none of its buffers.

    >>> with pass_without_leaves(ctx.tape, torch_made):
    ...     ctx.tape.backward(out, grad=g)       # w.grad unchanged, torch_made[0].grad set
    """

    __slots__ = ("_lend", "_own")

    def __init__(self, tape: Any, leaves: Sequence[Any]) -> None:
        self._lend, self._own = lent_grads(tape, leaves), separate_backward()

    def __enter__(self) -> None:
        self._lend.__enter__()
        self._own.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._own.__exit__(*exc)
        self._lend.__exit__(*exc)
