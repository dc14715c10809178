"""Copies of the gradient buffers a counted ``.bwds`` adds into, put back if the counts refuse
the call.

The store counts (``written_mask``) are read after the backward kernel ran: by then the kernel
has added the refused call's gradients, and the zeroing policy (RESET) may have zeroed the
buffers before it. So where a call may be counted (``may_count``), every gradient buffer the
backward is about to add into is copied on the device first, in order with the pending work
(before the policy's zeroing and the kernel), with its storage's bookkeeping (version, last
writer, STRICT's mark) and whether the backward's scope had applied its policy to it; a
refusal puts all of that back before raising. The call already waits for the counts, so the
copies cost device bandwidth, not a host round trip; they come from the device's buffer pool.

    kept = GradSnapshot(scope, device) if may_count(bound, prior, stored_once) else None
    kept.keep(x.grad_out)            # before scope.before_accumulate(x, x.grad_out, ...)
    ... the kernel; the counts refuse: kept.restore(); raise

A tape's backward that runs such a call (an entry recorded with ``may_refuse``) keeps every
gradient buffer it writes the same way (``restoring``: the results' and the seed's first, then
each buffer the scope's policy acts on, ``scope.keeper``), and puts them all back if anything
in it raises: the calls run before the refused one added their gradients too.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import capturing
from .policy import ZeroPolicy, get_zero_policy
from .signature import ParamInfo
from .storage import Storage
from .tensor import Tensor

_FIELDS = tuple(f for f in Storage.__slots__ if f != "__weakref__")  # (its bookkeeping)


def may_count(bound: list, prior: frozenset, stored_once: frozenset) -> bool:
    """Whether ``.bwds`` may count the stores of a tensor (``written_mask.bind_written`` and
    ``bind_in_place`` give it a mask): some interface diff tensor the call writes, other than
    one stored once per thread (``stored_once``) whose value before the call no tape needs
    (``prior``: storage ids). Never False where a mask is made; True in a few cases where
    none is (a wrapper that cannot be made, a tensor without gradients)."""
    for p, v in bound:
        if type(v) is Tensor and p.tensor_kind == "idiff" and _writes(p):
            if p.name not in stored_once or id(v.storage) in prior:
                return True
    return False


def resets(scope: Any, owner: Tensor, grad: Tensor) -> bool:
    """Whether ``scope.before_accumulate(owner, grad, ...)`` would zero ``grad`` now (the
    RESET policy, not applied to it in this backward yet, the scope not holding zeroings
    back: ``scope.deferred``): a ``.bwds`` keeps such a buffer first, so that a refusal after
    the zeroing (a later argument, SlangPy's binding) puts it back."""
    if scope.deferred is not None or scope.applied(grad):
        return False
    return (owner.zero_policy or get_zero_policy()) is ZeroPolicy.RESET


def kept_fields(grad: Tensor) -> tuple:
    """The bookkeeping of ``grad``'s storage (version, last writer, STRICT's mark, ...)."""
    return tuple(getattr(grad.storage, f) for f in _FIELDS)


def restore_fields(grad: Tensor, fields: tuple) -> None:
    """Put back what ``kept_fields`` returned (a zeroing recorded but never submitted)."""
    for name, value in zip(_FIELDS, fields):
        setattr(grad.storage, name, value)


def _writes(p: ParamInfo) -> bool:
    return p.io == "out" or p.access in ("write", "read_write")


class GradSnapshot:
    """The gradient buffers one ``.bwds`` adds into, as they were before it."""

    def __init__(self, scope: Any, device: Any):
        self.scope = scope
        self.device = device
        # (grad, copy, bytes, the storage's fields, whether the scope had applied its policy)
        self.kept: list[tuple[Tensor, Any, int, tuple | None, bool]] = []
        self._bytes: dict[int, int] = {}  # id(storage): the bytes from its start kept
        self._spare: dict[int, list] = {}  # float4s: pooled buffers taken ahead (reserve)

    def reserve(self, tensors: Any) -> None:
        """Take pooled buffers now for the gradients of ``tensors`` (not touched: a pending
        zeroing would start the batch's commands): the pool hands out no buffer while a
        batch records (a new 4 MiB one costs lavapipe milliseconds), as a tape's does."""
        for t in tensors:
            try:
                stride = t.grad_dtype.buffer_layout.stride
            except TypeError:
                continue  # (no derivative type: kept, if ever, in a buffer of its own)
            float4s = max(1, -(-t.numel * stride // 16))
            self._spare.setdefault(float4s, []).append(self.device.pool.float4_buffer(float4s))

    def keep(self, grad: Tensor) -> None:
        """Copy ``grad``'s buffer (the bytes its values span; all of it for a view that is not
        dense) before anything of this call writes it: call it before ``before_accumulate``.
        A buffer kept already (as far) is not copied again: it holds what it held first."""
        storage = grad.storage
        src = grad.buffer
        nbytes = grad.numel * grad.element_type.buffer_layout.stride
        if not grad.dense:
            nbytes = src.size
        had = self._bytes.get(id(storage))
        if had is not None and had >= nbytes:
            return
        self._bytes[id(storage)] = nbytes
        # (the first copy of a storage: its bookkeeping as it was)
        fields = tuple(getattr(storage, f) for f in _FIELDS) if had is None else None
        float4s = max(1, -(-nbytes // 16))
        spare = self._spare.get(float4s)
        copy = spare.pop() if spare else self.device.pool.float4_buffer(float4s)
        _copy(self.device, copy, src, nbytes)
        self.kept.append((grad, copy, nbytes, fields, self.scope.applied(grad)))

    def restore(self) -> None:
        """Put every kept buffer back, newest first (so a storage kept twice, zeroed between,
        ends as it was first), in order with the call's work; then the bookkeeping."""
        for grad, copy, nbytes, fields, applied in reversed(self.kept):
            _copy(self.device, grad.buffer, copy, nbytes)
            if fields is not None:
                for name, value in zip(_FIELDS, fields):
                    setattr(grad.storage, name, value)
            if not applied:
                self.scope.forget(grad)
        self.kept = []
        self.scope.flush()


def _copy(device: Any, dst: Any, src: Any, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``src`` into ``dst``, in order with the device's pending
    work: into this context's batch, or else the deferred list (as ``Tensor.zero_``)."""
    queue = device.queue
    with queue.lock:  # (the batch's encoder fetched and used under it: command_queue)
        encoder = queue.encoder()
        if encoder is None:
            queue.defer(lambda e: e.copy_buffer(dst, 0, src, 0, nbytes), (dst, src))
        else:
            encoder.copy_buffer(dst, 0, src, 0, nbytes)


# {function: the argument layouts (plan_layout.layout_key) whose .bwds completed}: a layout
# that SlangPy or pydiff refuses (a loop past its MaxIters for a longer tensor, a binding)
# may follow one that ran, so what ran is known per layout, not per function.
_RAN: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def backward_ran(fn: Any, layout: Any) -> None:
    """``fn.bwds`` of argument layout ``layout`` completed (its backward kernel compiled, its
    checks passed): a tape's backward of a call of that layout is not expected to refuse
    part-way any more (``may_refuse``). ``layout`` None (keywords, structs): not known."""
    if layout is None:
        return
    done = _RAN.get(fn)
    if done is None:
        _RAN[fn] = done = set()
    if len(done) < 256:  # (a bound: more layouts are simply kept on every tape)
        done.add(layout)


def may_refuse(fn: Any, layout: Any) -> bool:
    """Whether a tape's backward of a recorded call of ``fn`` whose backward has argument
    layout ``layout`` may raise part-way: its ``.bwds`` never completed for that layout
    (Slang may refuse to build the backward kernel of a ``[ForwardDifferentiable]``-only
    function: a TypeError, found only then; a loop past its ``[MaxIters]`` for a longer
    tensor; a layout SlangPy cannot bind), or it adds fixed-point gradients
    (``may_overflow``)."""
    done = _RAN.get(fn)
    return done is None or layout not in done or may_overflow(fn)


def unran(fn: Any, layout: Any) -> Any:
    """A tape entry's ``may_refuse`` for a call of ``fn`` whose backward has layout
    ``layout``: False where ``may_refuse`` says no, else ``(fn, layout)``, which ``restoring``
    asks again at each backward (a tape's first backward runs the layout: the next ones of
    the same tape need not keep every gradient buffer).

    >>> unran(m.square, key)     # (m.square, key) before square.bwds ran for key; then False
    """
    return may_refuse(fn, layout) and (fn, layout)


def _refuses(flag: Any) -> bool:
    """Whether a tape entry's ``may_refuse`` (True, False or ``unran``'s pair) holds now."""
    return may_refuse(*flag) if type(flag) is tuple else bool(flag)


def may_overflow(fn: Any) -> bool:
    """Whether ``fn.bwds`` adds a ``FwdDiffTensor``'s gradient through a fixed-point
    accumulator, whose check (at the end of the backward) refuses a sum out of range after
    every kernel of the backward ran: the gradients it wrote are kept first."""
    return fn.signature.has_fwd_tensor  # (read once at load: every recorded call asks)


class restoring:
    """Keep the gradient buffers a tape's backward writes, if one of its ``entries`` was
    recorded with ``may_refuse`` (a call whose stores may be counted, a function whose
    backward never ran, a ``Function`` with a backward of the user's), and put them back if
    the backward raises (``scope``: the backward's; nothing to do where an enclosing
    backward keeps them already): a refused backward leaves every gradient as it was.

        with backward_scope("tape.backward", dev) as scope, restoring(scope, entries, up):
            ...
    """

    __slots__ = ("scope", "keeper", "entries", "upstream")

    def __init__(self, scope: Any, entries: list, upstream: Tensor):
        counted = False
        if scope.keeper is None:
            counted = capturing.recording() is not None  # (a layout without a plan refuses)
            for e in entries:  # (a loop, not a generator; up to the first that refuses)
                if counted or _refuses(e.payload.get("may_refuse")):
                    counted = True
                    break
        self.scope, self.entries, self.upstream = scope, entries, upstream
        self.keeper = GradSnapshot(scope, upstream.device) if counted else None

    def __enter__(self) -> None:
        keeper = self.keeper
        if keeper is None:
            return
        self.scope.keeper = keeper
        held = {id(t.storage): t for e in self.entries for _, t, _ in e.reads if t.requires_grad}
        held.update((id(t.storage), t) for e in self.entries for t in e.writes if t.requires_grad)
        keeper.reserve(held.values())  # (before anything is recorded: pooled buffers)
        for t in (t for entry in self.entries for t in entry.writes if t.requires_grad):
            keeper.keep(t.grad_in)  # (the tape zeroes them; a pending zeroing done first)
            keeper.keep(t.grad_out)
        keeper.keep(self.upstream)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.keeper is None:
            return
        self.scope.keeper = None
        keeper, self.keeper = self.keeper, None
        if exc is not None:
            if isinstance(exc, Exception):
                keeper.restore()
            return
        try:
            self.scope.run_checks()  # (here, not at the scope's end: a refusal puts back)
        except Exception:
            keeper.restore()
            raise
