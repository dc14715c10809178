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
what the eager order gives (the labels' range check reads through
``CommandQueue.keeping_held``: it leaves the product held). Inside ``pydiff.capture`` the
product is recorded into the capture when issued and dropped from it when fused.

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


class HeadPlan:
    """What a product's plan keeps for holding it back: its kernel's ``defines`` and
    ``threads``, and the fused kernel once built (``fused_kernel``)."""

    __slots__ = ("defines", "threads", "fused")

    def __init__(self, defines: dict, threads: int) -> None:
        self.defines, self.threads = defines, threads
        self.fused: tuple | None = None  # (key, kernel), replaced whole (threads read it)

    def fused_kernel(self, kernels: Any) -> Any:
        """The product's kernel with the cross-entropy (``CE``), built once (19 defines: a
        lookup by them cost ~9 us a step), again when the cache evicted it."""
        fused = self.fused
        if fused is None or not kernels.touch(fused[0]):
            defines = dict(self.defines, CE=1, TG=self.threads)
            fused = self.fused = kernels.get_keyed("ops/matmul.slang", "mm_nt", **defines)
        return fused[1]


def head_plan(kind: str, m: int, n: int, rows: int, cols: int, fixed: bool, gpu: bool, defines):
    """A ``HeadPlan`` where a product of this plan may be held back for a cross-entropy: a
    forward ``mm_nt`` of whole rows per thread (``cols == n``), sizes constant (a hot shape),
    within the limits above, on lavapipe's plans (a GPU's blocks split the rows); else None."""
    threads = m // rows
    fits = kind == "mm_nt" and fixed and not gpu and cols == n
    if fits and n <= MAX_CLASSES and m <= MAX_ROWS and threads <= MAX_THREADS:
        return HeadPlan(defines, threads)
    return None


class HeldProduct:
    """A held-back product: its plan's ``HeadPlan``, kernel, buffers and uniforms, and its
    output's storage and shape (what the cross-entropy checks); called, records the product."""

    __slots__ = ("plan", "kernels", "kernel", "buffers", "scalars", "shape", "capture")

    def __init__(self, plan, kernels, kernel, buffers, scalars, shape, capture) -> None:
        self.plan, self.kernels, self.kernel = plan, kernels, kernel
        self.buffers, self.scalars, self.shape = buffers, scalars, shape
        self.capture = capture  # the capture recording when it was issued (or None)

    def __call__(self, encoder: Any) -> None:
        with capturing.paused():  # (issued before any capture now recording)
            self.kernels.dispatch_split(
                self.kernel, self.plan.threads, self.buffers, self.scalars, encoder=encoder
            )


def hold(kernel: Any, plan: HeadPlan, buffers: list, scalars: list, out: Any) -> bool:
    """Hold the dispatch of ``kernel`` (``plan``'s product) into ``out`` back in the queue
    (True), or False (nothing done: record it as usual) inside a batch, with PYDIFF_DEFER=0
    or ``HOLD_HEADS`` False. A capture records the product now, in order (``HeldProduct``
    records natively only), and drops it where the cross-entropy records the fused kernel."""
    kernels = out.device.kernels
    queue = kernels.queue
    if not (HOLD_HEADS and command_queue.DEFER) or queue.batching:
        return False
    rec = capturing.recording()
    if rec is not None:
        rec.record_dispatch(queue, kernel, plan.threads, buffers, scalars, None)
    held = HeldProduct(plan, kernels, kernel, buffers, scalars, out.shape, rec)
    queue.hold(held, buffers, out.storage, held)
    return True


def with_cross_entropy(logits: Any, labels: Any, lse: Any, loss: Any) -> bool:
    """Record the held-back product that makes ``logits`` fused with the forward of the mean
    cross-entropy of ``labels`` (int, dense, range-checked): ``lse`` (B, 2) and ``loss`` ()
    written as ce_forward writes them. False (nothing done) unless that product is held."""
    queue = logits.device.queue
    if queue.held is None:
        return False
    shape, rec = logits.shape, capturing.recording()

    def fits(p: HeldProduct) -> bool:  # (in a capture: the product issued in it, dropped)
        return (
            p.shape == shape and p.capture is rec and (rec is None or rec.drop_dispatch(p.kernel))
        )

    # The fused kernel built (a compile, seconds the first time) before the product is claimed:
    # an exception or KeyboardInterrupt there leaves it held, recorded as issued, not lost.
    peek = queue.held
    if peek is not None and isinstance(peek[3], HeldProduct) and peek[2] is logits.storage:
        peek[3].plan.fused_kernel(peek[3].kernels)
    held = queue.take_held(logits.storage, fits)
    if held is None:
        return False
    buffers = held.buffers + [("labels", labels.buffer), ("lse", lse.buffer), ("loss", loss.buffer)]
    try:
        kernel = held.plan.fused_kernel(held.kernels)
        # (the mean divides by the uniform ce_rows, as ce_forward by B: not by the constant)
        scalars = held.scalars + [("ce_rows", shape[0])]
        held.kernels.dispatch_split(kernel, held.plan.threads, buffers, scalars)
    except BaseException:  # (claimed, not recorded: the product as issued, then the error)
        held.kernels.dispatch_split(held.kernel, held.plan.threads, held.buffers, held.scalars)
        raise
    return True
