"""Capture a step once, replay its GPU commands: no Python per op on later steps.

A training step of small tensors spends most of its time in Python (ops, tape, optimizer)
and in per-kernel binding, not in its kernels. ``capture`` runs a function once, as usual,
and records the commands pydiff issued for it (its kernels, zeroing, constant uploads);
``replay()`` submits them again, in order, on the same buffers, in one command list, like
``torch.cuda.CUDAGraph``.

    step = pydiff.capture(train_step)                    # runs train_step once
    for xb_host, yb_host in batches:
        xb.copy_from_numpy(xb_host); yb.copy_from_numpy(yb_host)
        step.replay()                                    # same kernels, new data
    print(step.result.item())                            # train_step's return value, updated

What stays the same on replay: the tensors (their buffers), shapes and the kernels chosen,
and the Python numbers passed to them (``m.f(0.5, x)``: 0.5 is in the recorded kernel; pass a
value that changes per step in a tensor). What is re-read on replay: optimizer
hyper-parameters and step counts (bias correction goes on), and labels changed since they
were range-checked. Everything else a captured function computes on the host (Python control
flow, numbers read back) is frozen, so anything pydiff cannot record raises ``CaptureError``
during the capture instead of replaying stale work.

What can be captured: the ops that run on pydiff's own kernels (linear, matmul, relu,
cross_entropy with int labels, on float tensors of a Vulkan device), pydiff.nn, the
optimizers, ``zero_grad``, ``Tape.backward``, and calls of a user's Slang function (``fn(...)``
into a tensor or a new result, ``fn.bwds``, and its ``.bwds`` in ``Tape.backward``) that its
call plan runs on pydiff's generated kernel (capture_calls; a layout's first call runs the
full path unrecorded to make the plan). Refused: whatever SlangPy's kernel would run (a
function or layout the generator does not cover, struct, ``inout`` or host arguments, a host
result, ``fn.fwds``, the ops built on SlangPy: the elementwise ops, sum/mean, softmax, norms,
attention), a STRICT zeroing policy, host writes (``copy_from_numpy``,
``pydiff.tensor(array)``), optimizer state created on the first step (run one step first) and
deterministic-mode overflow checks.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any, Callable

import numpy as np

import slangpy as spy

from .capture_inputs import CapturedInputs
from .errors import CaptureError
from .policy import get_zero_policy


_recording: contextvars.ContextVar["CapturedStep | None"] = contextvars.ContextVar(
    "pydiff_capture", default=None
)


#: ``recording()``: the capture in progress, if any (pydiff's kernels and clears report to
#: it). The context variable's own ``get``: no Python frame on every call's path.
recording: Callable[[], "CapturedStep | None"] = _recording.get


def refuse(what: str) -> None:
    """Raise CaptureError if a capture is in progress: ``what`` cannot be replayed."""
    if _recording.get() is not None:
        raise CaptureError(
            f"pydiff.capture: {what} cannot be recorded for replay. A captured step may use the "
            "ops that run on pydiff's own kernels (linear, matmul, relu, cross_entropy with int "
            "labels, on float32 tensors; linear takes them when in_features is a multiple of 4, "
            "matmul(a, b) when b's columns are: see docs/capture.md), pydiff.nn, the "
            "optimizers, zero_grad and Tape.backward, and calls of your own Slang functions "
            "that pydiff's generated kernels cover, on tensors already on the device; copy "
            "new inputs into the captured tensors before replay()."
        )


class paused:
    """Run a block unrecorded inside a capture: a user function's first call of a layout runs
    the full path (which makes the call plan) before the recorded call takes the plan."""

    def __enter__(self) -> None:
        self._token = _recording.set(None)

    def __exit__(self, *exc: Any) -> None:
        _recording.reset(self._token)


def on_replay(action: Callable[[], None]) -> None:
    """Run ``action`` at this point of every replay of the capture in progress (host state
    that advances per step, e.g. an optimizer's step count). No-op outside a capture."""
    if (rec := _recording.get()) is not None:
        rec.record_host(action)


def check_on_replay(
    what: str, still_same: Callable[[], str | None], advice: str | None = None
) -> None:
    """Before every replay of the capture in progress, call ``still_same()``: it returns None
    when the objects ``what`` names are still those the capture recorded, else a description
    of what was replaced; replay() then refuses instead of running on the old buffers.
    ``advice``: what the refusal tells the user to do (else: copy values in place, or
    capture again). No-op outside a capture."""
    rec = _recording.get()
    if rec is not None:
        rec.record_check(what, still_same, advice)


def same_objects(recorded: dict[str, Any], current: Callable[[], dict[str, Any]]):
    """A ``still_same`` for check_on_replay: the named objects are the very objects
    recorded (tensors: ``is``; strings and numbers: equal), none missing and none added.

    >>> capturing.check_on_replay("nn.Linear(4, 3)",
    ...     capturing.same_objects(layer_tensors(), layer_tensors))
    """

    def still_same() -> str | None:
        now = current()
        for name, obj in recorded.items():
            value = now.get(name, _MISSING)
            if value is not obj and not (isinstance(obj, (str, int, float)) and value == obj):
                return f"{name} was replaced" if name in now else f"{name} was removed"
        for name in now:
            if name not in recorded:
                return f"{name} was added"
        return None

    return still_same


_MISSING = object()
_REPLAY_GUARDS: list[Callable[[], str | None]] = []


def guard_replays(check: Callable[[], str | None]) -> None:
    """Have every ``replay()`` call ``check()`` first: why it cannot run here, or None."""
    _REPLAY_GUARDS.append(check)


class CapturedStep:
    """What ``pydiff.capture`` returns: ``replay()`` and the captured call's ``result``."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict):
        if _recording.get() is not None:
            raise CaptureError("pydiff.capture: captures cannot be nested")
        self._commands: list[tuple] = []
        self._checks: list[tuple[str, Callable[[], str | None], str | None]] = []
        self._queue: Any = None  # the CommandQueue of the one device the step uses
        # Storages the step wrote (Storage.wrote), by id: (storage, version before): a replay
        # adds the versions they moved by, so a check of values read before (a tape's, a
        # .bwds's stale read) sees the replay's writes as it sees an eager step's.
        self._writes: dict[int, tuple[Any, int]] = {}
        self.replays = 0
        self.policy = get_zero_policy()  # around the capture (a replay's must be the same)
        # The step kept: tensors only its closure holds stay valid inputs (record_reads).
        self._step = (fn, args, kwargs)
        self._inputs = CapturedInputs()  # the tensors it read from outside (record_reads)
        token = _recording.set(self)
        try:
            self.result = fn(*args, **kwargs)
        finally:
            _recording.reset(token)
            if self._queue is not None:
                self._queue.flush()
        if self._queue is None:
            raise CaptureError("pydiff.capture: the function issued no GPU work to record")
        self._bumps = [  # what the step left in each storage it wrote (Storage.replayed), held
            # weakly: a later capture's count of references to its inputs must not fall by ours
            (weakref.ref(s), s.version - v, s.holds_result_of, s.last_writer)
            for s, v in self._writes.values()
        ]
        self._inputs.settle(self._writes)
        self._writes.clear()

    # --- recording (called by pydiff's kernels, tensors and optimizers) -----------------
    def _use_device(self, queue: Any) -> None:
        if self._queue is None:
            self._queue = queue
        elif self._queue is not queue:
            raise CaptureError(
                "pydiff.capture: the step uses two devices; capture one device's work"
            )

    def record_dispatch(
        self,
        queue: Any,
        kernel: Any,
        threads: int,
        buffers: list,
        scalars: list,
        dynamic: Callable[[], dict] | None,
    ) -> None:
        """A kernel dispatch (``queue``: the device's CommandQueue)."""
        self._use_device(queue)
        root = kernel.device.create_root_shader_object(kernel.program)
        cursor = spy.ShaderCursor(root).find_entry_point(0)
        for name, value in [*buffers, *scalars]:
            cursor[name] = value
        # The buffers ride along: their memory must outlive the capture, and Python must
        # not hand them to other tensors (pydiff's pool checks their reference counts).
        self._commands.append(("dispatch", kernel, root, cursor, threads, dynamic, buffers))

    def drop_dispatch(self, kernel: Any) -> bool:
        """Forget the latest non-host command if it dispatches ``kernel`` (head_fusion)."""
        at = max((i for i, c in enumerate(self._commands) if c[0] != "host"), default=-1)
        if at < 0 or self._commands[at][:2] != ("dispatch", kernel):
            return False
        return self._commands.pop(at) is not None

    def record_write(self, storage: Any) -> None:
        """A write of ``storage``'s values (``Storage.wrote``), before its version moves."""
        self._writes.setdefault(id(storage), (storage, storage.version))

    def record_new(self, storage: Any) -> None:
        """A storage made during the capture (its values are the step's, as if written)."""
        self._writes.setdefault(id(storage), (storage, storage.version))

    def wrote(self, storage: Any) -> bool:
        """Whether the step so far wrote (or made) ``storage``: its values are the step's."""
        return id(storage) in self._writes

    def record_reads(self, what: str, read: list) -> None:
        """``read``: ``(description, tensor)`` a recorded call reads. Those the step neither
        made nor wrote before are its inputs: a replay refuses once one was dropped (its name
        re-bound to a new tensor: ``capture_inputs``), as it would read the old buffer."""
        still_same = self._inputs.add(read, self._writes)
        if still_same is not None:
            advice = "Copy new values into the captured tensors, or capture again."
            self.record_check(what, still_same, advice)

    def record_host(self, action: Callable[[], None]) -> None:
        """Host code to run at this point of every replay."""
        self._commands.append(("host", action))

    def record_check(
        self, what: str, still_same: Callable[[], str | None], advice: str | None = None
    ) -> None:
        """A check run before every replay (see ``check_on_replay``)."""
        self._checks.append((what, still_same, advice))

    def record_clear(self, queue: Any, native: Any) -> None:
        """Zeroing of a SlangPy tensor."""
        self._use_device(queue)
        self._commands.append(("clear", native))

    def record_upload(self, queue: Any, buffer: Any, data: np.ndarray) -> None:
        """A host upload of ``data`` into ``buffer`` (replayed with the same values)."""
        self._use_device(queue)
        self._commands.append(("upload", buffer, np.array(data, copy=True)))

    # --- replay ---------------------------------------------------------------------------
    def replay(self) -> Any:
        """Submit the captured commands again (one command list); returns ``result``."""
        if _recording.get() is not None:
            raise CaptureError("pydiff.capture: replay() inside a capture")
        for guard in _REPLAY_GUARDS:
            if (why := guard()) is not None:
                raise CaptureError(f"pydiff.capture: replay() refused: {why}")
        for what, still_same, advice in self._checks:
            changed = still_same()
            if changed is not None and advice is not None:
                raise CaptureError(f"pydiff.capture: replay() refused: {what}: {changed}. {advice}")
            if changed is not None:
                raise CaptureError(
                    f"pydiff.capture: replay() refused: {what}: {changed} since the capture, "
                    "and the captured kernels would still read and write the old tensors. "
                    "Copy new values into the captured tensors instead (copy_from_numpy, "
                    "load_state_dict, which loads in place), or capture the step again."
                )
        with self._queue.lock:  # recording and submitting: exclusive (command_queue)
            self._queue.flush()  # (under the lock: no other thread records in between)
            device = self._queue.native
            encoder = device.create_command_encoder()
            for command in self._commands:
                kind = command[0]
                if kind == "dispatch":
                    _, kernel, root, cursor, threads, dynamic, _ = command
                    if dynamic is not None:
                        for name, value in dynamic().items():
                            cursor[name] = (
                                value  # uniforms are copied when the dispatch is recorded
                            )
                    compute = encoder.begin_compute_pass()
                    compute.bind_pipeline(kernel.pipeline, root)
                    compute.dispatch([threads, 1, 1])
                    compute.end()
                elif kind == "clear":
                    command[1].clear(encoder)
                elif kind == "upload":
                    encoder.upload_buffer_data(command[1], 0, command[2])
                else:  # host state for the dispatches after it (their uniforms are read now)
                    command[1]()
            device.submit_command_buffer(encoder.finish())
        for ref, moved, mark, writer in self._bumps:  # the step's writes and marks, again
            if (st := ref()) is not None:
                st.replayed(moved, mark, writer)
        self.replays += 1
        return self.result

    def __repr__(self) -> str:
        kinds = [c[0] for c in self._commands]
        return (
            f"<pydiff.CapturedStep: {kinds.count('dispatch')} kernels, {kinds.count('clear')} "
            f"clears, {kinds.count('upload')} uploads, replayed {self.replays}x>"
        )


def capture(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CapturedStep:
    """Run ``fn(*args, **kwargs)`` once, recording pydiff's GPU commands; replay them with
    ``.replay()``. See the module docstring for what a captured step may contain.

    >>> step = pydiff.capture(train_step)      # after one ordinary train_step()
    >>> step.replay(); loss = step.result.item()
    """
    return CapturedStep(fn, args, kwargs)
