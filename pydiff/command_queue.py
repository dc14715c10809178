"""The pending GPU work of one device, and the one ``flush`` that submits it.

Submitting a command list costs lavapipe 10-30 us of CPU (more with the fence and wake-up of
its queue thread), as much as a small training step's kernels, so pydiff submits as rarely
as it safely can, through two kinds of pending work:

- the *deferred* list, one per device, shared by all threads: pydiff's own kernels
  (``device.kernels.dispatch``) and zeroings issued outside a batch are appended to it, each
  under the queue's lock with the buffers it binds (``defer``). Holding those buffers keeps
  them out of the buffer pool until the commands are submitted (a pooled buffer is handed out
  again only when nothing else refers to it). A forward pass of pydiff ops thus submits
  nothing until something needs the results;
- a *batch*, per thread and per context (a ``ContextVar``): a backward appends its kernels to
  it (SlangPy's ``append_to``, clears and uploads as well), each under the queue's lock, the
  encoder fetched inside it (``with queue.lock: queue.encoder()``).

Other threads' batches on CUDA: with four threads taking gradients at once on an H200, about
1 in 40 values or gradients came back wrong (zeros, scaled) while one thread's batch held
recorded but unsubmitted commands as another thread submitted or read back; serialised, or
with the backward submitted kernel by kernel, none did (Vulkan copes). So on every backend
but Vulkan, each submission, and each flush before a SlangPy call or a read, also submits
the batches other threads have open (``open_batches``), after the deferred list: a thread's
own commands keep their order, its later ones going into a new encoder.

``flush()`` submits both, the deferred list first (a batch may read what it computed), in
one submission. A batch that ends joins the deferred list, in order, without a submission of
its own: a training step (zeroing, forward, backward, optimizer) is two submissions (the
forward pass when the backward starts, the rest at the optimizer's end). Everything else
that touches the device must flush first: host reads and writes, SlangPy calls, copies,
``Tensor.native``/``bind()`` and ``Device.native``/``library`` (the SlangPy objects handed
to user code) all do; a flush from any thread submits the whole list, so a tensor handed to
another thread reads right. The deferred list is also submitted when it holds
``DEFER_MAX`` commands (a loop of ops that never reads anything back).

One command may be *held back* (``hold``): the dispatch of a product whose consumer may do its
work in the same kernel (``pydiff.head_fusion``: a classifier head's logits and the
cross-entropy that reads them). It is recorded into the deferred list, before anything else,
at the next use of the queue by any thread (a command recorded, a batch's encoder fetched or
ended, a submission: every flush, read, write and SlangPy call), unless its consumer claims it
first (``take_held``) and records the fused kernel instead; so the device sees the commands in
the order they were issued either way.

    token = device.queue.begin_batch()
    device.kernels.dispatch(kernel, 1024, x=buffer)   # appended to the batch
    device.queue.flush()                              # before reading results back
    device.queue.end_batch(token)                     # the rest joins the deferred list
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import slangpy as spy

from . import capturing
from .cuda_context import ensure_current
from .errors import ENV_OFF, ENV_ON, env_choice, env_flag

# Commands the deferred list holds before it is submitted anyway: bounds the memory its
# buffers pin (and a step's few dozen commands stay in one submission).
DEFER_MAX = 256
# PYDIFF_DEFER=0 submits each deferred command at once (debugging, measurements).
DEFER = env_flag("PYDIFF_DEFER", True)

# New device memory after which the host waits for the device. Submissions run
# asynchronously (lavapipe's on its queue thread) and a buffer released meanwhile is freed
# only once the work submitted before its release has run: a loop dropping each result of
# 16 MiB reached 5.3 GB after 300 calls (raw SlangPy's calls too), past a laptop's memory
# for larger tensors. Waiting each ``INFLIGHT_MAX_BYTES`` of new buffers bounds that.
INFLIGHT_MAX_BYTES = 1 << 30

# PYDIFF_POLL_WAIT=0: ``wait()`` blocks in SlangPy's ``wait_for_idle`` (as before 2026-11-29).
POLL_WAIT = env_flag("PYDIFF_POLL_WAIT", True)
# How long ``wait()`` polls the device's last submission, yielding the CPU between polls,
# before it blocks on it (a long wait then costs no CPU). The MLP step waited on each time,
# one process, alternating rounds (2026-11-29, Xeon VM): load ~1.1, wait_for_idle 732-739
# us, polls of 0.2, 0.5, 1, 2 ms 651-682 us, blocking on the last id at once 785 us; other
# processes on 1.3 vCPUs, all within 1598-1666 us (wait_for_idle 1598, 1606).
POLL_MAX_S = 0.0005

# Every queue, for flush_all_deferred (a SlangPy call whose device pydiff does not know).
_queues: "weakref.WeakSet[CommandQueue]" = weakref.WeakSet()


def flush_all_deferred() -> None:
    """Submit the deferred list of every device (before work pydiff cannot attribute to one).

    >>> command_queue.flush_all_deferred()
    """
    for queue in list(_queues):
        queue.flush_deferred()


def build_before_lock(node: Any, *args: Any, **kwargs: Any) -> None:
    """SlangPy's kernel of ``node`` for these arguments built (a new signature: a compile of
    100-300 ms on lavapipe; else a lookup, about 5 us) before the caller takes the queue's
    lock to ``append_to`` it: built inside, it stalled every thread's dispatch meanwhile (only
    with other threads alive: the lookup is 2% of a small tape step's CPU, 3 nodes a step)."""
    build = getattr(node, "debug_build_call_data", None)  # (SlangPy 0.43: cached per signature)
    if build is not None and threading.active_count() > 1:
        build(*args, **kwargs)


def forget_queues() -> None:
    """In a forked child (``pydiff.forkguard``): the queues of the devices inherited from the
    parent are not this process's to submit (``flush_all_deferred`` skips them)."""
    _queues.clear()


class _Submissions:
    """The id of the device's last submission, whoever made it: SlangPy reports each new
    command buffer submitted (pydiff's, its own calls', user code's) to
    ``_Submissions.seen``, registered with the device. Ids are the values the device's one
    timeline fence is signalled with, in submission order, so the last one finished means
    everything submitted before it has. ``exact``: nothing before the registration is pending
    (false until a ``wait_for_idle`` after it)."""

    __slots__ = ("last", "exact", "lock", "__weakref__")

    def __init__(self) -> None:
        self.last = 0
        self.exact = False
        self.lock = threading.Lock()

    def seen(self, event: Any) -> None:
        submit_id = event.submit_id
        with self.lock:  # (two threads' callbacks: the larger id stays)
            if submit_id > self.last:
                self.last = submit_id


class _Batch:
    __slots__ = ("encoder",)  # created on first use, under the queue's lock

    def __init__(self) -> None:
        self.encoder: Any = None


def _nothing() -> None:
    """``enter`` where a device needs nothing of a new thread (every backend but CUDA)."""


class CommandQueue:
    """Pending work of one SlangPy device (``device.queue``)."""

    def __init__(self, native_device: Any):
        self.native = native_device
        #: Called where a thread starts using the device: on CUDA, makes the shared primary
        #: context current on a thread that has none (pydiff.cuda_context); else nothing.
        self.cuda = native_device.info.type == spy.DeviceType.cuda
        self.enter = ensure_current if self.cuda else _nothing
        self._batch: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar(
            f"pydiff_batch_{id(self)}", default=None
        )
        # The deferred list: its encoder, the buffers its commands bind, how many commands.
        # The lock makes appending a command and submitting the list exclusive.
        self._lock = threading.RLock()
        # Host transfers (uploads, read-backs) hold it too: slang-rhi's CUDA device aborts the
        # process when two threads copy at once (seen on an H200; Vulkan copes).
        self.lock = self._lock
        self._finished: list = []  # command lists of ended batches, to run before _deferred
        #: Batches with recorded, unsubmitted commands, where submissions take them along
        #: (every backend but Vulkan: see the module docstring); empty elsewhere.
        self.open_batches: set = set()
        #: Every thread's batches with recorded, unsubmitted commands (every backend): their
        #: kernels do not hold the buffers they bind, so the buffer pool hands out none while
        #: one is open (another thread's backward may still read a buffer freed meanwhile).
        self.recording: set = set()
        #: Whether submissions take other threads' open batches along (PYDIFF_SWEEP_BATCHES=1
        #: or 0 forces it on or off, e.g. to test it on Vulkan).
        sweep = env_choice("PYDIFF_SWEEP_BATCHES", ("auto", *ENV_ON, *ENV_OFF))
        self.sweep_batches = (
            native_device.info.type != spy.DeviceType.vulkan
            if sweep in (None, "auto")
            else sweep in ENV_ON
        )
        self._deferred: Any = None
        self._held: list = []
        self._count = 0
        #: Commands wait in the deferred list (any thread's): set with them under the lock and
        #: cleared when their submission returns; an attribute, as every SlangPy call reads it.
        self.deferred = False
        #: Submissions made (for tests and measurements).
        self.submissions = 0
        self.unwaited_bytes = 0  # new buffers' bytes since the host last waited (allocated)
        #: Buffers of large host transfers (pydiff.staging), used under the lock.
        self.staging: dict = {}
        #: The command held back (``hold``): (record, buffers, key, payload), or None.
        self.held: Any = None
        self._keep_held: int | None = None  # (``keeping_held``'s thread: its submissions leave it)
        #: The device's last submission (``wait``): polled on Vulkan, where the submission
        #: ids are one in-order queue's; elsewhere (CUDA streams, interop) None.
        self.submits: _Submissions | None = None
        if POLL_WAIT and native_device.info.type == spy.DeviceType.vulkan:
            self.submits = _Submissions()
            # (the callback holds the tracker, not the queue: no cycle through the device)
            native_device.register_command_recording_submitted_callback(self.submits.seen)
        _queues.add(self)

    def wait(self) -> None:
        """Wait until the device has finished the work submitted so far, by anyone (not what
        is still pending here: ``flush`` first). On Vulkan it polls the last submission's id,
        yielding the CPU between polls, for up to ``POLL_MAX_S``, then blocks on it: a thread
        blocked in ``wait_for_idle`` is woken late on a VM whose other vCPU is halted (100-250
        us a step, docs/benchmarks-history.md, twenty-sixth session). Elsewhere, and before the
        first wait, ``wait_for_idle``.

        >>> dev.queue.flush(); dev.queue.wait()
        """
        submits = self.submits
        if submits is None or not submits.exact:
            self.native.wait_for_idle()
            if submits is not None:
                submits.exact = True  # (later submissions are all reported to it)
            return
        native, last = self.native, submits.last
        if native.is_submit_finished(last):
            return
        deadline = time.perf_counter() + POLL_MAX_S
        while time.perf_counter() < deadline:
            os.sched_yield()
            if native.is_submit_finished(last):
                return
        native.wait_for_submit(last)

    def allocated(self, nbytes: int) -> None:
        """Count a new device buffer of ``nbytes``: past ``INFLIGHT_MAX_BYTES`` since the last
        wait, submit the pending work and wait for the device (not while a capture records:
        its step is replayed whole).

        >>> dev.queue.allocated(16 * float4s)     # after creating a buffer
        """
        self.unwaited_bytes += nbytes
        if self.unwaited_bytes > INFLIGHT_MAX_BYTES and capturing.recording() is None:
            self.flush()
            self.native.wait_for_idle()
            self.unwaited_bytes = 0

    @property
    def batching(self) -> bool:
        """Whether work dispatched here now is appended to a batch rather than submitted."""
        return self._batch.get() is not None

    @property
    def pending(self) -> bool:
        """Commands have been appended to this context's batch but not yet submitted."""
        batch = self._batch.get()
        return batch is not None and batch.encoder is not None

    def begin_batch(self) -> contextvars.Token | None:
        """Start batching (None: a batch is already open here, and this joins it)."""
        if self._batch.get() is not None:
            return None
        return self._batch.set(_Batch())

    def end_batch(self, token: contextvars.Token | None) -> None:
        """Stop batching (no-op for a joined batch): what the batch holds joins the deferred
        list, in order, submitted with it (an optimizer step after a backward: one submission).
        """
        if token is None:
            return
        batch = self._batch.get()
        self._batch.reset(token)
        if batch is None:
            return
        with self._lock:  # (another thread's submission may have taken the encoder)
            if self.held is not None:
                self._record_held()
            if batch.encoder is None:
                return
            if self._deferred is not None:
                self._finished.append(self._deferred.finish())
                self._deferred = None
            self._finished.append(batch.encoder.finish())
            self.deferred = True
            batch.encoder = None
            self.open_batches.discard(batch)
            self.recording.discard(batch)

    def encoder(self) -> Any:
        """The open batch's command encoder (created on first use), or None outside a batch:
        callers then defer their work (``defer``) or record and submit it themselves. Call it
        and record with the lock held (another thread's submission may take the encoder)."""
        if self.held is not None and self._keep_held != threading.get_ident():
            with self._lock:
                self._record_held()
        batch = self._batch.get()
        if batch is None:
            return None
        if batch.encoder is None:
            with self._lock:
                batch.encoder = self.native.create_command_encoder()
                self.recording.add(batch)
                if self.sweep_batches:
                    self.open_batches.add(batch)
        return batch.encoder

    def pending_encoder(self) -> Any:
        """The encoder holding unsubmitted commands of this context's batch, or None."""
        batch = self._batch.get()
        return None if batch is None else batch.encoder

    def defer(self, record: Callable[[Any], None], buffers: Sequence[Any]) -> None:
        """Append commands to the deferred list: ``record(encoder)`` records them (native
        calls only: it runs under the queue's lock); ``buffers`` (a list or tuple, kept as it
        is) are those they bind, held until submitted. Outside a batch only: a batch's work
        would run after them."""
        with self._lock:
            record(self.deferred_encoder())
            self.deferred_added(buffers)

    def deferred_encoder(self) -> Any:
        """The deferred list's encoder (created on first use), for a caller holding the lock
        that records one command into it and then calls ``deferred_added`` (``defer`` without
        a closure: pydiff's kernels, on every call)."""
        if self.held is not None and self._keep_held != threading.get_ident():
            self._record_held()  # (not in ``keeping_held``: its commands neither read nor write it)
        if self._deferred is None:
            self._deferred = self.native.create_command_encoder()
            self.deferred = True
        return self._deferred

    def hold(self, record: Callable[[Any], None], buffers: Any, key: Any, payload: Any) -> None:
        """Hold one command back (outside a batch): ``record(encoder)`` records it (native
        calls only, lock held), ``buffers`` are held until it is submitted; ``take_held(key)``
        claims ``payload`` instead. Any other use of the queue records it first (module
        docstring); a command held before is recorded now."""
        with self._lock:
            if self.held is not None:
                self._record_held()
                if self._count >= DEFER_MAX:  # (bounded as deferred_added bounds the list)
                    self._submit([])
            self.held = (record, buffers, key, payload)
            self.deferred = True  # (every "anything pending?" test sees it: flush first)

    def take_held(self, key: Any, accept: Callable[[Any], bool]) -> Any:
        """The held-back command's payload, now not to be recorded, if it was held with ``key``
        (by identity) and ``accept(payload)``; else None (nothing changed)."""
        with self._lock:
            held = self.held
            if held is None or held[2] is not key or not accept(held[3]):
                return None
            self.held = None
            self.deferred = self._deferred is not None or bool(self._finished)
            return held[3]

    def keeping_held(self, read: Callable[[], Any], key: Any) -> Any:
        """``read()``, a host read of values other than those of ``key`` (a storage), or an
        upload into a new tensor, with the held-back command left held by its commands and
        submissions unless it was held with ``key``: the command issued before it, neither
        written nor read by it, still runs before anything issued later (a cross-entropy's
        label check, or its NumPy labels' upload, between the head and its loss)."""
        # Not under the lock (the read waits for the device and may take the device's own
        # lock: an order another thread takes the other way round); the mark is this thread's,
        # other threads' submissions still record the held command first.
        keep = self.held is not None and self.held[2] is not key
        self._keep_held = threading.get_ident() if keep else None
        try:
            return read()
        finally:
            self._keep_held = None

    def _record_held(self) -> None:
        """Record the held-back command at the end of the deferred list (lock held)."""
        if self.held is None:  # (recorded by another thread meanwhile)
            return
        record, buffers, _, _ = self.held
        self.held = None
        if self._deferred is None:
            self._deferred = self.native.create_command_encoder()
        self.deferred = True
        record(self._deferred)
        self._held.append(buffers)
        self._count += 1

    def deferred_added(self, held: Any) -> None:
        """One command recorded into ``deferred_encoder()`` (lock held); ``held`` (anything
        referring to the buffers it binds) is kept until submitted."""
        self._held.append(held)
        self._count += 1
        if self._count >= DEFER_MAX or not DEFER:
            self._submit([])

    def flush_deferred(self) -> None:
        """Submit the deferred list and other threads' open batches (not this context's)."""
        if self.deferred or self._others_open():
            with self._lock:
                self._submit([])

    def _others_open(self) -> bool:
        """Whether a batch other than this context's has unsubmitted commands."""
        count = len(self.open_batches)
        if not count:
            return False
        own = self._batch.get()
        return count > (own is not None and own.encoder is not None)

    def flush(self) -> None:
        """Submit the deferred list, then this context's batch, in one submission (before a
        host read, a SlangPy call, a copy)."""
        batch = self._batch.get()
        if batch is not None and batch.encoder is not None:
            with self._lock:
                encoder, batch.encoder = batch.encoder, None
                self.open_batches.discard(batch)
                self.recording.discard(batch)
                self._submit([encoder] if encoder is not None else [])
        elif self.deferred or self.open_batches:  # (nothing pending: no lock)
            with self._lock:
                self._submit([])

    def _submit(self, after: list) -> None:
        """Submit the deferred list (if any) and then ``after``'s encoders (lock held). The
        list reads as pending until the submission returns: a thread that checks it without
        the lock (``deferred``, ``flush``) must wait for this submission, not overtake it; so
        does a batch taken from another thread (its owner, finding it gone, waits too)."""
        self.enter()
        if self.held is not None and self._keep_held != threading.get_ident():
            self._record_held()
        buffers = list(self._finished)
        if self._deferred is not None:
            buffers.append(self._deferred.finish())
        if self.open_batches:  # other threads' (module docstring); this context's stays open
            own = self._batch.get()
            for batch in list(self.open_batches):
                if batch is not own and batch.encoder is not None:
                    self.deferred = True  # (its owner's flush waits, as for the list)
                    buffers.append(batch.encoder.finish())
                    batch.encoder = None
                    self.open_batches.discard(batch)
                    self.recording.discard(batch)
        buffers.extend(e.finish() for e in after)
        if buffers:
            if len(buffers) == 1:
                self.native.submit_command_buffer(buffers[0])
            else:
                self.native.submit_command_buffers(buffers)
            self.submissions += 1
        self._finished = []
        self._deferred = None
        self.deferred = self.held is not None
        # Submitted: later work runs after these commands, so their buffers may be reused.
        self._held.clear()
        self._count = 0
