"""A classifier head's product and the cross-entropy that reads its logits, in one dispatch.

In an eager step ``ops.cross_entropy(layers[-1](h), labels)`` the head's product is issued
before the cross-entropy is called. Where its kernel could also compute the loss
(matmul.slang's ``mm_nt`` with ``CE``: each thread holds whole rows, one workgroup all of
them), ``products.fast_product`` hands its dispatch to ``hold``, which holds it back in the
device's queue (``CommandQueue.hold``) instead of recording it. The cross-entropy's forward
then claims it (``with_cross_entropy``) and records the fused kernel: logits, row statistics
and mean loss, the same bits as the two kernels (ce_forward's operations and order). Any
other use of the queue first records the product as it was issued (command_queue), so a
read, another op, a flush, a capture, or a product that no cross-entropy reads sees exactly
what the eager order gives.

    out = empty((256, 10)); fast_product("mm_nt", h, w, out, 0.0, b)   # held back
    head_fusion.with_cross_entropy(out, labels, lse, loss)             # True: one dispatch
"""

from __future__ import annotations

from typing import Any

from . import capturing, command_queue

#: False: never hold a product back (the two kernels; measurements, A/B).
HOLD_HEADS = True
#: Largest batch (rows) and classes the fused kernel takes: ce_forward's one-SIMD-batch rule
#: (its order of sums, so its bits) holds to 2048 rows; a row's classes are unrolled.
MAX_ROWS = 2048
MAX_CLASSES = 32
MAX_THREADS = 256  # one workgroup: every row's loss term in its shared memory


def head_defines(kind: str, m: int, n: int, rows: int, cols: int, fixed: bool, gpu: bool):
    """Whether a product of this plan may be held back for a cross-entropy: a forward
    ``mm_nt`` of whole rows per thread (``cols == n``), sizes constant (a hot shape),
    within the limits above; lavapipe's plans (a GPU's blocks split the rows)."""
    return (
        kind == "mm_nt"
        and fixed
        and not gpu
        and cols == n
        and n <= MAX_CLASSES
        and m <= MAX_ROWS
        and m // rows <= MAX_THREADS
    )


class HeldProduct:
    """A held-back product: what the fused kernel needs (the product's defines, buffers and
    uniforms) and its output's storage and shape (what the cross-entropy checks)."""

    __slots__ = ("kernels", "defines", "threads", "buffers", "scalars", "storage", "shape")

    def __init__(self, kernels, defines, threads, buffers, scalars, storage, shape) -> None:
        self.kernels, self.defines, self.threads = kernels, defines, threads
        self.buffers, self.scalars, self.storage, self.shape = buffers, scalars, storage, shape


def hold(kernel: Any, defines: dict, threads: int, buffers: list, scalars: list, out: Any) -> bool:
    """Hold the dispatch of ``kernel`` (a plan's, of ``defines``) into ``out`` back in the
    queue (True), or False (nothing done: record it as usual) inside a capture or a batch,
    with PYDIFF_DEFER=0 or ``HOLD_HEADS`` False."""
    kernels = out.device.kernels
    queue = kernels.queue
    if not (HOLD_HEADS and command_queue.DEFER) or queue.batching or capturing.recording():
        return False

    def record(encoder: Any) -> None:
        with capturing.paused():  # (issued before any capture now recording)
            kernels.dispatch_split(kernel, threads, buffers, scalars, encoder=encoder)

    held = HeldProduct(kernels, defines, threads, buffers, scalars, out.storage, out.shape)
    queue.hold(record, buffers, out.storage, held)
    return True


def with_cross_entropy(logits: Any, labels: Any, lse: Any, loss: Any) -> bool:
    """Record the held-back product that makes ``logits`` fused with the forward of the mean
    cross-entropy of ``labels`` (int, dense, range-checked): ``lse`` (B, 2) and ``loss`` ()
    written as ce_forward writes them. False (nothing done) unless that product is held."""
    queue = logits.device.queue
    if queue.held is None:
        return False
    shape = logits.shape
    held = queue.take_held(logits.storage, lambda p: p.shape == shape)
    if held is None:
        return False
    defines = dict(held.defines, CE=1, TG=held.threads)
    kernel = held.kernels.get("ops/matmul.slang", "mm_nt", **defines)
    buffers = held.buffers + [
        ("labels", labels.buffer),
        ("lse", lse.buffer),
        ("loss", loss.buffer),
    ]
    held.kernels.dispatch_split(kernel, held.threads, buffers, held.scalars)
    return True
