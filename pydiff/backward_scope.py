"""The backward scheduler: one top-level backward, inside which the zeroing policy acts once
per gradient buffer and kernels are appended to the device's batch.

    with backward_scope("tape.backward", device) as scope:
        scope.before_accumulate(x, x.grad_out, "parameter 'x'")   # RESET zeroes it, STRICT checks
        scope.dispatch(node, *args)                                # appended to device's batch
    # on exit: the batch is submitted, gradients are marked as results, checks run
"""

from __future__ import annotations

import contextvars
import weakref
from typing import TYPE_CHECKING, Any, Callable

from . import capturing
from .command_queue import build_before_lock, flush_all_deferred
from .errors import StaleGradientError
from .policy import ZeroPolicy, get_zero_policy

if TYPE_CHECKING:
    from .device import Device
    from .tensor import Tensor

_active_scope: contextvars.ContextVar["BackwardScope | None"] = contextvars.ContextVar(
    "pydiff_backward_scope", default=None
)
#: The buffers an outer pass already applied the policy to (``shared_pass``), if any.
_pass_seen: contextvars.ContextVar["set[int] | None"] = contextvars.ContextVar(
    "pydiff_pass_seen", default=None
)


_POLICY_ADVICE = "Set the policy back, or capture the step again under it"


def _same_policy(owner: "Tensor", outer: ZeroPolicy) -> Callable[[], str | None]:
    """A capture's check (``record_check``) where a backward applied the zeroing policy to
    ``owner``'s gradient: the replay zeroes it, or not, as recorded, so the policy around
    replay() must be the one around the capture (``outer``; one the step sets itself is the
    same at every replay) and ``owner``'s own policy the one it had."""
    ref, own = weakref.ref(owner), owner.zero_policy

    def still_same() -> str | None:
        if (now := get_zero_policy()) is not outer:
            return f"the zeroing policy is {now.name}, not {outer.name} as at the capture"
        t = ref()
        if t is not None and t.zero_policy is not own:
            return "the zeroing policy of its gradient changed since the capture"
        return None

    return still_same


#: ``active_scope()``: the backward running here, if any (the context variable's ``get``:
#: no Python frame on every call's path).
active_scope: Callable[[], "BackwardScope | None"] = _active_scope.get


class BackwardScope:
    """One top-level backward: the policy acts once per gradient buffer inside it.

    Nested scopes (a tape running many bwds) join the outermost one, so RESET zeroes a
    buffer only before its first write and contributions within the backward add up. With a
    ``device``, its kernels are appended to that device's batch (``device.queue``) and
    submitted together; anything that must see their results first calls ``flush()``.
    """

    def __init__(self, label: str, device: "Device | None" = None):
        self.label = label
        self.device = device
        seen = _pass_seen.get()  # inside a shared pass: the buffers it already applied to
        self._seen: set[int] = set() if seen is None else seen
        self._written: list["Tensor"] = []
        self._on_finish: list[Callable[[], None]] = []  # checks that read results back
        #: The buffers to put back if the backward is refused part-way (``grad_restore``):
        #: kept before the policy acts on each (``keep``), or None.
        self.keeper: Any = None
        #: RESET's zeroings held back while a ``.bwds`` binds its arguments (a list, or None:
        #: zeroed at once): recorded with its kernel, or dropped if the call is refused
        #: (``bwds_binding``), so a refused call zeroes nothing.
        self.deferred: list | None = None

    def dispatch(self, node: Any, *args: Any, **kwargs: Any) -> None:
        """Run a SlangPy function node now, or append it to the device's batch."""
        capturing.refuse(f"a SlangPy backward kernel ({self.label})")
        if self.device is None:
            flush_all_deferred()  # SlangPy runs it now: deferred kernels go first
            node(*args, **kwargs)
            return
        queue = self.device.queue
        build_before_lock(node, *args, **kwargs)  # (a first use's compile: not in the lock)
        with queue.lock:  # recording, like every copy, is exclusive (command_queue: CUDA)
            node.append_to(queue.encoder(), *args, **kwargs)

    def flush(self) -> None:
        """Submit the kernels appended so far (before a host read or an ordered copy)."""
        if self.device is not None:
            self.device.flush()

    def clear(self, device: "Device", native: Any) -> None:
        """Zero a SlangPy tensor of ``device`` in order with the kernels appended so far."""
        with device.queue.lock:  # (the batch's encoder fetched and used under it)
            encoder = device.queue.pending_encoder()
            if encoder is None:
                device.queue.flush_deferred()  # cleared now: after the deferred kernels
                native.clear()
            else:
                native.clear(encoder)
        rec = capturing.recording()
        if rec is not None:
            rec.record_clear(device.queue, native)

    def on_finish(self, check: Callable[[], None]) -> None:
        """Run ``check`` when this backward ends, after its kernels have run."""
        capturing.refuse(
            "a check that reads a backward's results (deterministic mode's overflow check)"
        )
        self._on_finish.append(check)

    def before_accumulate(self, owner: "Tensor", grad: "Tensor", owner_desc: str) -> None:
        """Apply the owner's policy to its ``grad`` before this backward adds into it."""
        if self.keeper is not None:
            self.keeper.keep(grad)
        key = id(grad.storage)
        if key in self._seen:
            return
        if (rec := capturing.recording()) is not None:  # a replay zeroes as recorded
            rec.record_check(owner_desc, _same_policy(owner, rec.policy), _POLICY_ADVICE)
        policy = owner.zero_policy or get_zero_policy()
        if policy is ZeroPolicy.STRICT:
            self.check_stale(owner, grad, owner_desc)
        self._seen.add(key)
        if policy is ZeroPolicy.RESET:
            if self.deferred is not None:
                self.deferred.append(grad)
            else:
                self.flush()
                grad.zero_()
        self._written.append(grad)

    def check_stale(self, owner: "Tensor", grad: "Tensor", owner_desc: str) -> None:
        """The STRICT policy's refusal of ``before_accumulate``, changing nothing: a call runs
        it for every buffer it adds into before any policy zeroes one (a refused call leaves
        every gradient as it was)."""
        if id(grad.storage) in self._seen:
            return
        policy = owner.zero_policy or get_zero_policy()
        if policy is ZeroPolicy.STRICT and grad.storage.holds_result_of is not None:
            raise StaleGradientError(
                f"{owner_desc}: its gradient buffer still holds the result of "
                f"{grad.storage.holds_result_of}; this backward ({self.label}) would add to "
                "it. Call .zero_grad() on the tensor first, or use zero_policy('reset') or "
                "'accumulate'."
            )

    def keep(self, grad: "Tensor") -> None:
        """Before this backward writes ``grad`` other than through ``before_accumulate``:
        keep it, if the backward keeps what it writes (``keeper``)."""
        if self.keeper is not None:
            self.keeper.keep(grad)

    def applied(self, grad: "Tensor") -> bool:
        """Whether this backward applied its policy to ``grad`` already (or marked it)."""
        return id(grad.storage) in self._seen

    def forget(self, grad: "Tensor") -> None:
        """Undo ``before_accumulate`` of ``grad`` (a refused call that put the buffer back as
        it was: the next call adding into it applies the policy again)."""
        self._seen.discard(id(grad.storage))
        self._written = [g for g in self._written if g.storage is not grad.storage]

    def mark_result(self, grad: "Tensor") -> None:
        """Record that ``grad`` now holds this backward's result (set, not added)."""
        self._seen.add(id(grad.storage))
        self._written.append(grad)

    def run_checks(self) -> None:
        """Run the checks ``on_finish`` holds now rather than when the backward ends: a
        caller keeping what the backward wrote (``grad_restore``) puts it back if one
        refuses (a fixed-point gradient out of range)."""
        if self._on_finish:
            self.flush()  # the checks read results (else they join the deferred list)
        checks, self._on_finish = self._on_finish, []
        for check in checks:
            check()

    def finish(self) -> None:
        for grad in self._written:
            grad.storage.mark_result(self.label)
        self.run_checks()


class separate_backward:
    """Run a backward of its own inside another one rather than joining it.

    For a backward that computes something for its caller (an implicit solve's
    vector-Jacobian products of ``f`` on a tape of its own, one per adjoint step): its
    gradient buffers are not the outer backward's, and joined, the outer scope would keep
    every one of them (and its id) until it ends, 3 buffers per step of a solve of 10^5
    steps. Kernels still go to the device's open batch, in order.

        with separate_backward():
            vjp_tape.backward(out, grad=lam)
    """

    __slots__ = ("_token", "_pass_token")

    def __enter__(self) -> None:
        self._token = _active_scope.set(None)
        self._pass_token = _pass_seen.set(None)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _pass_seen.reset(self._pass_token)
        _active_scope.reset(self._token)


class shared_pass:
    """Run top-level backwards that belong to one larger pass (one torch ``backward()``
    reaching several pydiff calls, each a tape backward of its own): the zeroing policy acts
    once per gradient buffer for the whole pass, as inside one tape backward. ``seen`` is
    the pass's set of buffers already reset or checked, the same object for each of them.

        with shared_pass(seen):
            tape.backward(out, grad=g)     # RESET zeroes w.grad only if no earlier one did
    """

    __slots__ = ("seen", "_token")

    def __init__(self, seen: set[int]):
        self.seen = seen

    def __enter__(self) -> None:
        self._token = _pass_seen.set(self.seen)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _pass_seen.reset(self._token)


class backward_scope:
    """Enter a top-level backward, or join the one already running.

    A class rather than a generator: this sits on every ``.bwds`` call's path.
    """

    __slots__ = ("label", "device", "_scope", "_token", "_batch")

    def __init__(self, label: str, device: "Device | None" = None):
        self.label = label
        self.device = device

    def __enter__(self) -> BackwardScope:
        outer = _active_scope.get()
        if outer is not None:
            self._scope, self._token, self._batch = outer, None, None
            return outer
        self._scope = BackwardScope(self.label, self.device)
        self._token = _active_scope.set(self._scope)
        self._batch = self.device.queue.begin_batch() if self.device is not None else None
        return self._scope

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._token is None:
            return
        _active_scope.reset(self._token)
        try:
            if exc_type is None:
                self._scope.finish()
            else:
                self._scope.flush()
        finally:
            if self.device is not None:
                self.device.queue.end_batch(self._batch)
