"""Large host transfers through staging buffers each device keeps (Vulkan).

SlangPy's ``copy_from_numpy`` and ``to_numpy`` stage every transfer through new host memory,
which lavapipe maps on first touch, 4 KiB a page: 34 MB took 18.8 ms up and 36.3 ms back,
against 4.2 and 8.3 ms through two kept 4 MiB buffers, chunk by chunk (2026-11-27).
Contiguous tensors of 4-byte scalars (``SCALARS``: float, int, uint: labels, the store
counts a backward over a grid reads back) of at least ``STAGING_MIN_BYTES`` take this path;
smaller ones, other dtypes and strided views keep SlangPy's. Writes of up to 64 KiB of them
made behind pending work, outside a backward's batch, join the device's deferred list
instead (no submission first: ``write_in_order``). Callers hold the queue's lock.

    staging.write(queue, native, arr)           # staged, or SlangPy's copy_from_numpy
    values = staging.read(queue, native, reader)    # None: SlangPy's to_numpy reads them
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import slangpy as spy

from . import capturing
from .command_queue import CommandQueue

STAGING_MIN_BYTES = 1 << 20
#: The element types staged: 4-byte scalars, by Slang name (their NumPy type).
SCALARS = {"float": np.float32, "int": np.int32, "uint": np.uint32}
CHUNK_BYTES = 4 << 20  # (16 MiB chunks read back slower: to_numpy copies the whole buffer)
#: Host writes up to this size are recorded in order with pending work (``write_in_order``):
#: up to ``command_queue.DEFER_MAX`` of them held at once.
IN_ORDER_MAX_BYTES = 64 << 10
#: Reads up to this size (a loss, a metric) copy into a kept read-back buffer in the same
#: submission as the work before them, waited for by polling (``read_small``).
SMALL_READ_BYTES = 4 << 10


def _staged(queue: CommandQueue, native: Any, nbytes: int) -> bool:
    return (
        nbytes >= STAGING_MIN_BYTES
        and queue.native.info.type == spy.DeviceType.vulkan
        and native.dtype.full_name in SCALARS
        and native.is_contiguous()
    )


def _buffer(queue: CommandQueue, kind: str, size: int = CHUNK_BYTES) -> Any:
    """The queue's staging buffer of ``kind`` ("upload", "read_back" or "read_small") and
    ``size``, made on first use (``empty_cache`` releases them: ``queue.staging``)."""
    buffer = queue.staging.get(kind)
    if buffer is None or buffer.size != size:  # (the size changed since: remade)
        usage, memory = (
            (spy.BufferUsage.copy_source, spy.MemoryType.upload)
            if kind == "upload"
            else (spy.BufferUsage.copy_destination, spy.MemoryType.read_back)
        )
        buffer = queue.native.create_buffer(size=size, usage=usage, memory_type=memory)
        queue.staging[kind] = buffer
    return buffer


def _copy(queue: CommandQueue, dst: Any, dst_at: int, src: Any, src_at: int, n: int) -> None:
    encoder = queue.native.create_command_encoder()
    encoder.copy_buffer(dst, dst_at, src, src_at, n)
    queue.native.submit_command_buffer(encoder.finish())
    queue.native.wait_for_idle()  # before the staging buffer is written or read again


def write(
    queue: CommandQueue,
    native: spy.Tensor,
    arr: np.ndarray,
    zero_d: bool = False,
    flush: Callable[[], None] | None = None,
) -> None:
    """Write ``arr`` (C-contiguous, already of the tensor's NumPy type and shape; ``zero_d``:
    a 0-d tensor's value, its storage a (1,) view) into ``native``'s elements: in order with
    the device's pending work where small (``write_in_order``), else after ``flush()`` (the
    caller's: its work submitted), staged where it pays, else SlangPy's ``copy_from_numpy``.

    >>> staging.write(dev.queue, x.native, np.ones(x.shape, np.float32), flush=dev.flush)
    """
    arr = arr.reshape((1,) + arr.shape) if zero_d else arr
    if not native.is_contiguous():  # (SlangPy: "Destination tensor must be contiguous")
        if flush is not None:
            flush()
        write_strided(native, arr)
        return
    flat = arr.reshape(-1).view(np.uint8) if arr.flags.c_contiguous else None
    if flat is not None and write_in_order(queue, native, arr, flat):
        return
    if flush is not None:
        flush()
    staged = flat is not None and _staged(queue, native, flat.nbytes)
    if not staged or arr.dtype != SCALARS[native.dtype.full_name]:
        native.copy_from_numpy(arr)
        return
    if flat.nbytes != 4 * _numel(native):
        native.copy_from_numpy(arr)  # (its shape error)
        return
    staging, at = _buffer(queue, "upload"), 4 * native.offset
    for start in range(0, flat.nbytes, CHUNK_BYTES):
        part = flat[start : start + CHUNK_BYTES]
        staging.copy_from_numpy(part)
        _copy(queue, native.storage, at + start, staging, 0, part.nbytes)


def write_in_order(queue: CommandQueue, native: spy.Tensor, arr: np.ndarray, flat: Any) -> bool:
    """Append a small write (up to ``IN_ORDER_MAX_BYTES`` of a contiguous tensor of
    ``SCALARS``) to the deferred list, after the commands appended before it, rather than
    submitting them first (a submission costs lavapipe more than a small kernel); False:
    nothing done. Callers hold the lock.

    Only behind pending work (with none, written at once: a raw SlangPy loop on handles kept
    from before, ``x.copy_from_numpy(b); raw.f(nx)``, reads each write), and not inside a
    batch (a backward's: a custom Function's ``backward`` runs in the tape's): recorded
    there, the write would wait for the batch's end, which ``Tensor.native`` does not
    submit, and raw SlangPy given ``t.native`` just after it read the old values.

    >>> staging.write_in_order(dev.queue, x.native, arr, arr.reshape(-1).view(np.uint8))
    """
    if not queue.deferred or queue.batching or flat.nbytes > IN_ORDER_MAX_BYTES:
        return False
    if not native.is_contiguous():
        return False
    if SCALARS.get(native.dtype.full_name) is not arr.dtype.type:
        return False
    if flat.nbytes != 4 * _numel(native):
        return False  # (SlangPy's copy raises the shape error)
    storage, at, data = native.storage, 4 * native.offset, flat  # (copied as recorded)
    queue.defer(lambda enc: enc.upload_buffer_data(storage, at, data), (storage,))
    return True


def read(queue: CommandQueue, native: spy.Tensor, reader: Callable) -> np.ndarray | None:
    """``native``'s values as a new array of its shape (float32, int32 or uint32), or None
    where SlangPy's path must read them. A view with negative strides is read through
    ``reader`` (storage's read of a SlangPy view), as ``read_reversed`` says.

    >>> staging.read(dev.queue, x.native, reader)       # array of x.shape, float32
    """
    if native.shape and min(native.shape) > 0 and min(native.strides) < 0:
        return read_reversed(native, reader)
    nbytes = 4 * _numel(native)
    if nbytes < CHUNK_BYTES or not _staged(queue, native, nbytes):
        return None  # (below a chunk, to_numpy of the whole staging buffer costs more)
    staging, at = _buffer(queue, "read_back"), 4 * native.offset
    out = np.empty(nbytes, np.uint8)
    for start in range(0, nbytes, CHUNK_BYTES):
        n = min(CHUNK_BYTES, nbytes - start)
        _copy(queue, staging, 0, native.storage, at + start, n)
        out[start : start + n] = staging.to_numpy()[:n]
    return out.view(SCALARS[native.dtype.full_name]).reshape(tuple(native.shape))


def read_small(queue: CommandQueue, native: spy.Tensor) -> np.ndarray | None:
    """``native``'s values as a new array, for a contiguous view of up to ``SMALL_READ_BYTES``
    of ``SCALARS`` on Vulkan, outside a batch and a capture; else None (nothing done). The
    copy into a kept read-back buffer joins the deferred list, submitted with the work before
    it, and the read waits by polling (``CommandQueue.wait``) then maps the buffer: SlangPy's
    ``to_numpy`` would submit a copy of its own and block in ``vkQueueWaitIdle`` (a thread
    woken late on a VM). Callers hold the queue's lock.

    >>> staging.read_small(dev.queue, loss.native)      # array of shape (), float32
    """
    if queue.submits is None or queue.batching or capturing.recording() is not None:
        return None
    kind = SCALARS.get(native.dtype.full_name)
    nbytes = 4 * _numel(native)
    if kind is None or not 0 < nbytes <= SMALL_READ_BYTES or not native.is_contiguous():
        return None
    buffer, storage, at = (
        _buffer(queue, "read_small", SMALL_READ_BYTES),
        native.storage,
        4 * native.offset,
    )
    queue.defer(lambda enc: enc.copy_buffer(buffer, 0, storage, at, nbytes), (storage,))
    queue.flush()
    queue.wait()
    return buffer.to_numpy()[:nbytes].view(kind).reshape(tuple(native.shape))


def read_reversed(native: spy.Tensor, read: Callable[[spy.Tensor], np.ndarray]) -> Any:
    """The values of a view with negative strides (SlangPy's ``to_numpy`` reads others'
    memory there): the elements it spans, read as a contiguous view by ``read``, viewed with
    its strides in NumPy and copied. None for elements of several components.

    >>> staging.read_reversed(x.native, lambda v: read_back(dev, v))   # x[::-1]'s values
    """
    shape, strides = list(native.shape), list(native.strides)
    low = native.offset + sum((d - 1) * s for d, s in zip(shape, strides) if s < 0)
    high = native.offset + sum((d - 1) * s for d, s in zip(shape, strides) if s > 0)
    span = spy.Tensor(native.storage, native.dtype, [high - low + 1], [1], low)
    flat = read(span)
    if flat.ndim != 1:
        return None
    step = flat.itemsize
    start = flat[native.offset - low :]
    picked = np.lib.stride_tricks.as_strided(start, shape, [s * step for s in strides])
    return picked.copy()


def write_strided(native: spy.Tensor, arr: np.ndarray) -> None:
    """Write ``arr`` into a strided view (a transpose, every other row, negative strides) of
    distinct elements: the span of storage it covers read, its elements set in NumPy, the span
    written back (the rest of the span keeps its values). A view that repeats an element (a
    stride of 0) is refused with ``ValueError``: which value would it keep? Callers hold the
    queue's lock, its pending work submitted.

    >>> staging.write_strided(view.native, np.ones(view.shape, np.float32))
    """
    shape, strides = list(native.shape), list(native.strides)
    if not shape or min(shape) == 0:
        return
    offsets = native.offset
    for d, s in zip(shape, strides):
        offsets = np.add.outer(offsets, np.arange(d) * s)
    if np.unique(offsets).size != offsets.size:
        raise ValueError(
            f"cannot write into a view of shape {tuple(shape)} and strides {tuple(strides)}: "
            "it holds some elements more than once (a stride of 0 or overlapping axes); "
            "write into a tensor of its own"
        )
    low, high = int(offsets.min()), int(offsets.max())
    span = spy.Tensor(native.storage, native.dtype, [high - low + 1], [1], low)
    flat = np.array(span.to_numpy())  # (one row per element: vector elements trailing)
    step = flat.strides[0]
    picked = np.lib.stride_tricks.as_strided(
        flat[native.offset - low :],
        tuple(shape) + flat.shape[1:],
        tuple(s * step for s in strides) + flat.strides[1:],
        writeable=True,
    )
    picked[...] = arr.reshape(picked.shape)
    span.copy_from_numpy(flat)


def _numel(native: spy.Tensor) -> int:
    count = 1
    for d in native.shape:
        count *= d
    return count
