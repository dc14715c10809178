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
"""

from __future__ import annotations

from typing import Any

from .signature import ParamInfo
from .storage import Storage
from .tensor import Tensor

_FIELDS = Storage.__slots__


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


def _writes(p: ParamInfo) -> bool:
    return p.io == "out" or p.access in ("write", "read_write")


class GradSnapshot:
    """The gradient buffers one ``.bwds`` adds into, as they were before it."""

    def __init__(self, scope: Any, device: Any):
        self.scope = scope
        self.device = device
        # (grad, copy, bytes, the storage's fields, whether the scope had applied its policy)
        self.kept: list[tuple[Tensor, Any, int, tuple | None, bool]] = []
        self._storages: set[int] = set()

    def keep(self, grad: Tensor) -> None:
        """Copy ``grad``'s buffer (the bytes its values span; all of it for a view that is not
        dense) before anything of this call writes it: call it before ``before_accumulate``."""
        storage = grad.storage
        fields = None
        if id(storage) not in self._storages:  # (the first copy of a storage: the oldest state)
            self._storages.add(id(storage))
            fields = tuple(getattr(storage, f) for f in _FIELDS)
        src = grad.buffer
        nbytes = grad.numel * grad.element_type.buffer_layout.stride
        if not grad.dense:
            nbytes = src.size
        copy = self.device.pool.float4_buffer(max(1, -(-nbytes // 16)))
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
