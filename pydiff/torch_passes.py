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
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from .backward_scope import shared_pass
from .policy import ZeroPolicy, get_zero_policy

#: Passes whose end torch has not reported yet (graph task id -> buffers acted on). An
#: abandoned pass (one that raised) never reports its end: the oldest are dropped past this.
_MAX_OPEN = 64
_open: collections.OrderedDict[int, set[int]] = collections.OrderedDict()
_lock = threading.Lock()
_NATIVE, _TASK_ID, _ENGINE = "_C", "_current_graph_task_id", "_execution_engine"


def torch_pass() -> Any:
    """A context for one torch node's pydiff backward: joined to the other pydiff nodes of
    the running torch backward pass, if torch names one (else on its own).

    >>> with torch_pass():
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
    with _lock:
        seen = _open.get(task)
        if seen is None:
            seen = _open[task] = set()
            engine.queue_callback(lambda: _close(task))
            while len(_open) > _MAX_OPEN:
                _open.popitem(last=False)
    return shared_pass(seen)


def _close(task: int) -> None:
    with _lock:
        _open.pop(task, None)
