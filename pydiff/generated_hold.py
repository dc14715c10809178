"""A generated forward call on a tape held back until the tape's backward from its result
fuses it with the backward (generated_fused: one kernel writes the result and adds the
gradients), or anything else uses the queue and it is recorded as issued (command_queue's
``hold``, as head_fusion holds a classifier head's product).

Held (here and by a call plan's launch, planned_kernels) only where nothing else could
tell: a new result (no ``_result``) of a float function
(not generated_vector's), on an active tape, outside a capture, a batch and deterministic
mode, with the deferred queue on (``PYDIFF_DEFER``), ``HOLD_FORWARD`` True. ``tape.backward``
seeds a one-call backward from that result with the command left held
(``seeds.fusable_forward``); the generated backward of the very call (same function, the
same tensors and numbers) claims it (``fused_backward``). A read of the result, another op,
a flush, a second backward, a capture or a plan's backward record the forward first: the
order and bits of today. ``stats()`` counts ``forward+backward fused`` for a fused call
(``forward`` where the held forward was recorded as issued).

    y = generated_hold.forward(m.polynomial, [2.0, 8.0, -1.0, x])   # held on a tape
    generated_hold.fused_backward(fn, args, y, grads, before)        # True: one dispatch
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from . import capturing, command_queue, generated, generated_fused
from .creation import empty
from .determinism import is_deterministic
from .signature import FunctionTarget
from .tape import active_tape
from .tensor import Tensor

#: True (the default): hold a forward back for a fused backward; False: two kernels, as
#: before (the same bits). (Parked 2026-11-29 for a memory test's collectable count: not a
#: cycle per step but earlier tests' modules leaving the bounded generated-kernel memo.)
HOLD_FORWARD = True


class HeldForward:
    """A held-back generated forward: called with an encoder, records it as issued."""

    __slots__ = ("fn", "kernel", "args", "out")
    fuses_backward = True  # (seeds.fusable_forward: tape.backward may leave it held)

    def __init__(self, fn: FunctionTarget, kernel: Any, args: list, out: Tensor) -> None:
        self.fn, self.kernel, self.args, self.out = fn, kernel, args, out

    def bindings(self) -> tuple[int, dict]:
        threads, fixed = generated.geometry(self.out.numel)
        bindings = {
            f"pydiff_a{i}": v.buffer if type(v) is Tensor else float(v)
            for i, v in enumerate(self.args)
        }
        bindings.update(fixed, pydiff_result=self.out.buffer)
        return threads, bindings

    def __call__(self, encoder: Any) -> None:
        threads, bindings = self.bindings()
        with capturing.paused():
            kernels = self.fn.module.device.kernels
            kernels.dispatch(self.kernel, threads, encoder=encoder, **bindings)
        generated.count("forward")

    def same_call(self, fn: FunctionTarget, args: list, out: Any) -> bool:
        """Whether ``fn`` over ``args`` into ``out`` is this call (its tensors, its numbers'
        bits), the one a backward may fuse with."""
        if fn is not self.fn or out is not self.out or len(args) != len(self.args):
            return False
        for a, b in zip(args, self.args):
            if type(a) is Tensor or type(b) is Tensor:
                if a is not b:
                    return False
            elif np.float32(a).tobytes() != np.float32(b).tobytes():
                return False
        return True


def forward(fn: FunctionTarget, args: list) -> Tensor | None:
    """``generated.forward(fn, args, None)``, its dispatch held back where a tape's backward
    may fuse it (module docstring)."""
    if not holding(fn):
        return generated.forward(fn, args, None)
    shape = generated.call_shape(args)
    kernel = generated.forward_kernel(fn, args, shape)
    if kernel is None:
        return None
    out = empty(shape, device=fn.module.device)
    hold(fn, kernel, args, out)
    return out


def holding(fn: FunctionTarget) -> bool:
    """Whether a forward call of ``fn`` into a new result may be held back now."""
    return (
        HOLD_FORWARD
        and command_queue.DEFER
        and not fn.module.device.queue.batching
        and active_tape() is not None
        and capturing.recording() is None
        and not is_deterministic()
    )


def hold(fn: FunctionTarget, kernel: Any, args: Any, out: Tensor) -> None:
    """Hold back the dispatch of ``kernel`` (``generated.forward_kernel``'s) writing ``out``
    (new) from ``args``: after ``holding(fn)`` (a call plan's launch holds it too)."""
    held = HeldForward(fn, kernel, list(args), out)
    buffers = [v.buffer for v in args if type(v) is Tensor] + [out.buffer]
    fn.module.device.queue.hold(held, buffers, out.storage, held)


def fused_backward(
    fn: FunctionTarget,
    args: list,
    result: Tensor,
    grads: dict,
    before: Callable[[], None] | None,
) -> bool:
    """The held-back forward that made ``result`` (``fn`` over ``args``), claimed and
    dispatched with the backward as one kernel adding into ``grads`` (as
    ``generated.backward``; ``before()`` after the claim, before the dispatch); False,
    nothing done, where no such forward is held or the fused kernel declines."""
    queue = fn.module.device.queue
    held = queue.held
    if held is None or held[2] is not result.storage or not isinstance(held[3], HeldForward):
        return False
    if not held[3].same_call(fn, args, result) or capturing.recording() is not None:
        return False
    if is_deterministic():  # (turned on after the forward: the two kernels, as today)
        return False
    # Between the claim and the dispatch below the forward is neither held nor recorded: a
    # read of ``result`` from another thread then would see stale values. With another Python
    # thread alive, the two kernels (a notebook's kernel threads included: a follow-up could
    # claim and dispatch under the queue's lock).
    if threading.active_count() > 1:
        return False
    upstream = result.grad_in
    # Built before the claim (a compile flushes the queue: the forward left held there).
    found = queue.keeping_held(
        lambda: generated_fused.fused_kernel(fn, args, upstream, grads), None
    )
    if found is None:
        return False
    partials = generated_fused.partials(fn, upstream, found[2])
    if partials is None:
        return False
    claimed = queue.take_held(result.storage, lambda p: p is held[3])
    if claimed is None:
        return False
    try:
        if before is not None:
            before()
    except BaseException:  # (claimed, not recorded: the forward as issued, then the error)
        claimed(None)
        raise
    kernel, sums, _ = found
    generated_fused.dispatch(fn, kernel, args, upstream, grads, sums, partials, result)
    return True


def _ours(fn: FunctionTarget, result: Any) -> bool:
    """Whether the command held back is ``fn``'s forward that made ``result``."""
    held = fn.module.device.queue.held
    if held is None or type(result) is not Tensor or held[2] is not result.storage:
        return False
    return isinstance(held[3], HeldForward) and held[3].fn is fn


def flush_deferred(fn: FunctionTarget, result: Any) -> None:
    """``backward_call``'s submission of the deferred kernels before a ``.bwds``, with
    ``fn``'s held-back forward of ``result`` left held (its generated backward may claim
    it; ``release`` records it first where that backward declines)."""
    queue = fn.module.device.queue
    if _ours(fn, result):
        queue.keeping_held(queue.flush_deferred, None)
    else:
        queue.flush_deferred()


def release(fn: FunctionTarget, result: Any) -> None:
    """Where the generated backward declined: ``fn``'s held-back forward of ``result``
    recorded and submitted, as ``flush_deferred`` would have before (SlangPy's path)."""
    if _ours(fn, result):
        fn.module.device.queue.flush_deferred()
