"""The pending GPU work of one device: kernels appended to one command encoder and
submitted together, and the one ``flush`` that submits them.

Submitting a command list costs lavapipe 30-200 us, more than most kernels of a small
training step, so a backward (and an optimizer step) appends its kernels to one encoder
inside a *batch*. Anything that must see their results first (a host read, a SlangPy call,
a copy) calls ``flush()``. Batches are per thread and per context (a ``ContextVar``), so two
threads never append to each other's encoder.

    token = device.queue.begin_batch()
    device.kernels.dispatch(kernel, 1024, x=buffer)   # appended, not yet submitted
    device.queue.flush()                              # before reading results back
    device.queue.end_batch(token)                     # submits what is left
"""

from __future__ import annotations

import contextvars
from typing import Any


class _Batch:
    __slots__ = ("encoder",)

    def __init__(self) -> None:
        self.encoder: Any = None


class CommandQueue:
    """Pending work of one SlangPy device (``device.queue``)."""

    def __init__(self, native_device: Any):
        self.native = native_device
        self._batch: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar(
            f"pydiff_batch_{id(self)}", default=None
        )

    @property
    def batching(self) -> bool:
        """Whether work dispatched here now is appended to a batch rather than submitted."""
        return self._batch.get() is not None

    @property
    def pending(self) -> bool:
        """Commands have been appended but not yet submitted."""
        batch = self._batch.get()
        return batch is not None and batch.encoder is not None

    def begin_batch(self) -> contextvars.Token | None:
        """Start batching (None: a batch is already open here, and this joins it)."""
        if self._batch.get() is not None:
            return None
        return self._batch.set(_Batch())

    def end_batch(self, token: contextvars.Token | None) -> None:
        """Submit what the batch holds and stop batching (no-op for a joined batch)."""
        if token is None:
            return
        self.flush()
        self._batch.reset(token)

    def encoder(self) -> Any:
        """The open batch's command encoder (created on first use), or None outside a batch:
        callers then record and submit work of their own."""
        batch = self._batch.get()
        if batch is None:
            return None
        if batch.encoder is None:
            batch.encoder = self.native.create_command_encoder()
        return batch.encoder

    def pending_encoder(self) -> Any:
        """The encoder holding unsubmitted commands, or None (nothing is waiting)."""
        batch = self._batch.get()
        return None if batch is None else batch.encoder

    def flush(self) -> None:
        """Submit the commands appended so far (before a host read or an unbatched call)."""
        batch = self._batch.get()
        if batch is not None and batch.encoder is not None:
            encoder, batch.encoder = batch.encoder, None
            self.native.submit_command_buffer(encoder.finish())
