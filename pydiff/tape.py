"""Host-side tape: record Slang calls, then run their backward kernels in reverse order.

with pydiff.Tape() as tape:
    h = m.layer(x, w, _result="tensor")
    loss = m.loss(h, _result="tensor")
tape.backward(loss)          # w.grad, x.grad now hold dloss/dw, dloss/dx
"""

from __future__ import annotations

import contextvars
import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from . import capturing, forward_trace
from .backward_claims import BackwardRun, running
from .backward_scope import backward_scope
from .grad_restore import restoring
from .errors import TapeReuseWarning, env_flag, warn_once
from .seeds import KeptEnter, device_seed, fusable_forward, prepare_one, seed_upstream
from .seeds import host_seed, tensor_seed
from .tape_reads import Forgotten, check_reads
from .tensor import Tensor
from .unrecorded import check_versions, marked_refusal, not_recorded
from .unrecorded import overwritten_refusal

# PYDIFF_TAPE_BATCH=0 submits each backward kernel on its own (for measurements).
_BATCH = env_flag("PYDIFF_TAPE_BATCH", True)
_active_tape: contextvars.ContextVar["Tape | None"] = contextvars.ContextVar(
    "pydiff_tape", default=None
)


#: ``active_tape()``: the tape recording here, if any (the context variable's own ``get``).
active_tape: Callable[[], "Tape | None"] = _active_tape.get
#: ``token = pause_recording()`` ... ``resume_recording(token)``: ``suspend_recording`` as C calls.
pause_recording: Callable[[], Any] = functools.partial(_active_tape.set, None)
resume_recording: Callable[[Any], None] = _active_tape.reset


class suspend_recording:
    """Run a block without recording (used for a Function's own forward)."""

    def __enter__(self) -> None:
        self._token = _active_tape.set(None)

    def __exit__(self, *exc: Any) -> None:
        _active_tape.reset(self._token)


@dataclass
class _Entry:
    """One recorded operation: what it read (at which version) and what it wrote."""

    index: int
    label: str
    reads: list[tuple[str, Tensor, int]]  # (description, tensor, version when read)
    writes: list[Tensor]
    run_backward: Callable[["_Entry"], None]
    payload: dict = field(default_factory=dict)
    #: ``Storage.replaced`` counts of the writes when recorded: values written from outside
    #: a call since then (``fill``, ``copy_``) are not this call's any more.
    replaced: tuple[int, ...] = ()


class Tape:
    """Records pydiff calls (and ``pydiff.Function`` applications) made inside ``with``.

    ``backward(output, grad=None)`` runs the recorded backward kernels in reverse order,
    wiring each intermediate's gradient from its consumers into its producer. Results made
    inside the tape get gradient buffers when any input has one. Tapes do not nest (a
    ``with Tape()`` inside another raises). ``backward`` may run again over the same
    recording: intermediate gradients restart from zero, leaf gradients follow the zeroing
    policy (ACCUMULATE adds, RESET replaces, STRICT raises).

    A tape reading a result another tape recorded warns (its backward stops there) unless
    made with ``reads_other_tapes=True``: its backwards are then chained by hand.

    >>> with pydiff.Tape() as tape:
    ...     y = m.square(x, _result="tensor")
    >>> tape.backward(y, grad=np.ones(y.shape))
    """

    def __init__(self, *, reads_other_tapes: bool = False) -> None:
        #: True: this tape reads results of other tapes on purpose, as constants (pydiff's
        #: transforms: a closure's tensors) or with the backwards chained by hand: no
        #: GradientFlowWarning.
        self.reads_other_tapes = reads_other_tapes
        self._entries: list[_Entry] = []
        self._made: set[int] = set()  # ids of the recorded results (``made``)
        self._token: contextvars.Token | None = None
        self._touched: dict[int, Tensor] = {}
        # Tensors that held gradients of their own before this tape overwrote them: their
        # buffers serve as intermediates during a backward, then get those gradients back.
        self._leaves: dict[int, Tensor] = {}
        #: A backward ran over the recording held now (``__enter__`` warns on reuse).
        self._backward_ran = False

    # --- recording ----------------------------------------------------------------------
    def __enter__(self) -> "Tape":
        if _active_tape.get() is not None:
            raise RuntimeError(
                "pydiff.Tape: tapes do not nest; record everything on the outer tape, or "
                "finish it before starting another"
            )
        if self._backward_ran and self._entries:
            warn_once(
                "pydiff.Tape: this tape ran a backward and still holds its recording "
                "(backward's retain_graph=True, the default); recording again adds to "
                "that: a loop reusing it keeps every step's work alive. Use a fresh Tape per step, "
                "tape.backward(loss, retain_graph=False), or tape.reset() before recording anew",
                TapeReuseWarning,
            )
        self._token = _active_tape.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active_tape.reset(self._token)
        self._token = None

    def record(
        self,
        label: str,
        reads: Sequence[tuple[str, Tensor] | tuple[str, Tensor, int]],
        writes: list[Tensor],
        run_backward: Callable[[_Entry], None],
        overwritten: Sequence[Tensor] = (),
        **payload: Any,
    ) -> _Entry:
        """Append an operation; ``reads`` (description, tensor, and optionally the version its
        backward needs, else the current one) are checked for later overwrites at backward.
        ``overwritten``: written tensors that held values before the call (in place, or given
        as an output); those this tape did not produce keep their gradients across backwards."""
        reads = [(r[0], r[1], r[2] if len(r) > 2 else r[1].storage.version) for r in reads]
        check_reads(self, label, reads)
        entry = _Entry(
            len(self._entries) + 1,
            label,
            reads,
            list(writes),
            run_backward,
            payload,
            tuple([t.storage.replaced[0] for t in writes]),  # (lists: no generator frames)
        )
        for _, t, _ in reads:  # (a view's base: after a forget a view may die before its base)
            self._touched[id(t.storage)] = t if t.base is None else t.base
        for t in overwritten:
            if t.storage.producer is not self and t.requires_grad:
                self._leaves.setdefault(id(t.storage), t)
        for t in writes:
            self._touched[id(t.storage)] = t if t.base is None else t.base
            self._made.add(id(t))  # (entries hold them: an id here is that tensor's)
            t.storage.producer = self
        self._entries.append(entry)
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def made(self, t: Tensor) -> bool:
        """Whether ``t`` is one of the recording's results or a view of one (a new leaf that
        shares a result's storage, ``detach()``, is a leaf on purpose)."""
        return id(t) in self._made or (t.base is not None and id(t.base) in self._made)

    def reaches(self, output: Tensor, storages: set[int]) -> bool:
        """Whether a gradient from ``output`` would reach one of ``storages`` (ids): its
        storage is one, or the recorded calls it depends on read one (``_needed``'s walk).

        >>> tape.reaches(y, {id(x.storage)})     # False: y was made on the host from x
        """
        needed = {id(output.storage)}
        if needed & storages:
            return True
        for entry in reversed(self._entries):
            if any(
                id(t.storage) in needed and t.storage.replaced[0] == n
                for t, n in zip(entry.writes, entry.replaced)
            ):
                read = {id(t.storage) for _, t, _ in entry.reads}
                if read & storages:
                    return True
                needed |= read
        return False

    def inputs(self) -> list[Tensor]:
        """The tensors the recorded calls read that no recorded call wrote, in order."""
        written = {id(t.storage) for entry in self._entries for t in entry.writes}
        seen: set[int] = set()
        out = []
        for entry in self._entries:
            for _, t, _ in entry.reads:
                if id(t.storage) not in written and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    # --- backward -----------------------------------------------------------------------
    def _needed(self, output: Tensor) -> tuple[list[_Entry], set[int]]:
        """Entries the output depends on, in recording order, and the storages (ids) on the
        way. A call whose written values were all overwritten from outside a call later
        (``fill``: constants, no gradient) is not; copied over by ``copy_`` from values with a
        gradient path: refused."""
        needed = {id(output.storage)}
        chosen = []
        for entry in reversed(self._entries):
            hit = None  # (the first needed write; loops, not a list and a generator per entry)
            for t, n in zip(entry.writes, entry.replaced):
                if id(t.storage) in needed:
                    hit = t if hit is None else hit
                    if t.storage.replaced[0] == n:
                        chosen.append(entry)
                        needed.update([id(t.storage) for _, t, _ in entry.reads])
                        break
            else:
                writer = hit.storage.replaced[1] if hit is not None else None
                if (refusal := overwritten_refusal(entry.index, entry.label, writer)) is not None:
                    raise refusal
        return chosen[::-1], needed

    def backward(self, output: Tensor, grad: Any = None, *, retain_graph: bool = True) -> None:
        """Backpropagate from ``output`` through the recorded calls.

        ``grad`` is dL/d(output): an array or tensor of its shape; it may be omitted when the
        output has one element (then 1), and one value serves any one-element output (a 0-d
        loss takes ``[1.0]``, a (1,) one ``1.0``). ``retain_graph=False`` forgets the whole
        recording afterwards (PyTorch's default frees what a backward walked), so that the
        step's intermediate tensors are freed as soon as nothing else holds them: a tape and
        its tensors refer to each other, which otherwise leaves them to Python's cycle
        collector (a training loop's fastest form; a backward from them is then refused).

        >>> tape.backward(loss, retain_graph=False)    # one backward per recording
        """
        if not isinstance(output, Tensor):
            raise TypeError(
                f"tape.backward: output must be a pydiff.Tensor, not {type(output).__name__}"
            )
        if type(retain_graph) is not bool and not isinstance(retain_graph, np.bool_):
            raise TypeError(
                f"tape.backward: retain_graph must be True or False, not {retain_graph!r}"
            )
        if isinstance(output.producer, Forgotten):
            raise output.producer.refusal("tape.backward")
        entries, path = self._needed(output)
        if not entries:
            wrote = any(output.storage is t.storage for e in self._entries for t in e.writes)
            where = "tape.backward"
            raise RuntimeError(not_recorded(where, output, self, len(self._entries), wrote))
        check_versions(entries, path)
        trace = forward_trace.active()
        reads = [t for e in entries for _, t, _ in e.reads] if trace is not None else []
        if any(trace.tangent(t) is not None for t in reads):
            raise NotImplementedError(
                "tape.backward inside pydiff.jvp (forward over reverse, e.g. pydiff.grad in a "
                "function given to jvp/jacfwd): the gradient would carry no tangent. For second "
                "derivatives use pydiff.hvp or pydiff.hessian (reverse over forward)"
            )
        if grad is None and output.numel != 1:
            raise ValueError(
                f"tape.backward: grad= is required for an output of shape {output.shape} "
                "(only a single-element output defaults to 1)"
            )
        if not output.requires_grad:
            raise RuntimeError(
                marked_refusal("tape.backward", output)
                or "tape.backward: the output has no gradient buffer, so nothing it depends on "
                "requires a gradient (create inputs with requires_grad=True)"
            )
        # Owed gradient buffers made here, outside the batch (the pool reuses buffers there),
        # zeroed below; the output's by the read of its upstream (not twice).
        keeping = fusable_forward(output, entries)  # (a held generated forward of output: kept)
        owed = keeping(
            lambda: [t for entry in entries for t in entry.writes if t.make_owed()], None
        )
        upstream = keeping(lambda: output.grad_in, None)
        zeroed = output if any([t is output for t in owed]) else None
        want = output.expected_numpy_shape()
        on_device = device_seed(grad, output, entries) if isinstance(grad, Tensor) else None
        if grad is None or on_device is not None:
            seed = None  # 1 (one element) or grad: copied on the device (copy_one, copy_seed)
        else:
            if isinstance(grad, Tensor):  # (a capture's replay checks it still holds them)
                grad = tensor_seed(grad)
            seed = host_seed(grad, "tape.backward: grad", output.scalar_type)
        if seed is not None and seed.size == 1 and math.prod(want) == 1:
            seed = seed.reshape(want)  # one value for one value: a 0-d loss takes [1.0] too
        if seed is not None and seed.shape != want:
            raise ValueError(
                f"tape.backward: grad has shape {seed.shape}, the output needs "
                f"{output.expected_numpy_shape()}"
            )
        # The forward pass's kernels start now, on lavapipe's queue thread, while the backward
        # is recorded here: on an idle second core the step's wall time drops 0.78 -> 0.68 ms
        # (MLP step; one more submission, ~35 us of CPU; benchmarks-history.md, Host cost per op).
        keeping(lambda: (output.device.flush(), prepare_one(output.device)), None)
        # A captured backward is batched whatever PYDIFF_TAPE_BATCH says: its seed is then a
        # recorded upload, where unbatched it is a host write a replay cannot repeat.
        batch = _BATCH or capturing.recording() is not None
        # No recording while it runs (inside `with` too): a Function's backward is no call.
        scope_device = output.device if batch else None
        with (
            suspend_recording(),
            backward_scope("tape.backward", scope_device) as scope,
            KeptEnter(keeping, restoring(scope, entries, upstream)),  # (a refused store count)
        ):
            # Intermediates restart from zero, then the seed goes into the output's upstream:
            # recorded into the backward's own command list when it has one (one submission).
            kept = self._keep_leaf_gradients(entries, scope)
            queue = output.device.queue
            keeping(
                lambda: seed_upstream(queue, entries, zeroed, seed, upstream, want, on_device),
                None,
            )
            scope.mark_result(upstream)  # the seed is set, not a stale result to add to
            run = BackwardRun(self._entries, entries)
            token = running.set(run)
            try:
                for entry in reversed(entries):
                    if id(entry) not in run.skipped:  # (taken over by a later call's backward)
                        run.current = entry
                        entry.run_backward(entry)
                        run.pending.discard(id(entry))
            finally:
                running.reset(token)
            for t, before in kept:
                scope.flush()
                t.grad.copy_from_numpy(t.grad.numpy() + before)
        self._backward_ran = True
        if not retain_graph:
            self._forget("an earlier backward(retain_graph=False)")

    def _keep_leaf_gradients(self, entries: list[_Entry], scope: Any) -> list:
        """The gradients that overwritten leaves hold now, under their zeroing policy (STRICT
        raises on a stale one, RESET drops it), to add back after the backward. STRICT's
        refusal of any leaf comes first, before a node changes a gradient."""
        kept = []
        written = {id(t.storage) for entry in entries for t in entry.writes}
        for entry in entries:
            for desc, t, _ in entry.reads:
                if id(t.storage) not in written and t.requires_grad:
                    scope.check_stale(t, t.grad_out, desc)
        leaves = [t for key, t in self._leaves.items() if key in written and t.requires_grad]
        for t in leaves:  # (all checked before RESET zeroes any: a refusal changes none)
            scope.check_stale(t, t.grad, f"tape.backward: tensor {t.shape} overwritten")
        for t in leaves:
            scope.before_accumulate(t, t.grad, f"tape.backward: tensor {t.shape} overwritten")
            scope.flush()
            kept.append((t, t.grad.numpy()))
        return kept

    def zero(self) -> None:
        """Zero every gradient buffer the recorded calls touched (also once the recording is
        forgotten: of the tensors still alive)."""
        for held in list(self._touched.values()):
            t = held() if isinstance(held, weakref.ref) else held
            if t is not None and t.requires_grad:
                t.zero_grad()

    def reset(self) -> None:
        """Forget the recording (gradients are left as they are); the tape may record anew.

        >>> tape.reset()    # its results refuse a backward from now on
        """
        self._forget("tape.reset()")

    def _forget(self, why: str) -> None:
        """Drop the recording: its results' producer becomes a ``Forgotten`` (a backward from
        them is refused, a later recording on this tape treats them as made elsewhere), and
        the touched tensors are held weakly, for ``zero()`` only: nothing here keeps the
        step's tensors alive, so they are freed without Python's cycle collector."""
        results = [t for entry in self._entries for t in entry.writes]
        forgotten = Forgotten(why, results)
        for t in results:
            if (storage := t.storage).producer is self:
                storage.producer = forgotten
        touched = {}  # (a tape reused step after step keeps only the tensors still alive)
        for key, held in self._touched.items():
            held = held if isinstance(held, weakref.ref) else weakref.ref(held)
            if held() is not None:
                touched[key] = held
        self._touched = touched
        self._entries.clear()
        self._made.clear()
        self._leaves.clear()
        self._backward_ran = False
