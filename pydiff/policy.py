"""Zeroing policies: what a backward does with a gradient buffer that already holds values.

    pydiff.set_zero_policy("reset")            # every backward starts from zero
    with pydiff.zero_policy("strict"):         # adding into a used gradient raises
        module.f.bwds(x, _result=y)
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ._errors import StaleGradientError

if TYPE_CHECKING:
    from .tensor import Tensor


class ZeroPolicy(enum.Enum):
    """How a top-level backward treats gradient buffers it is about to add into.

    ACCUMULATE: add (SlangPy's and PyTorch's rule); the user zeroes.
    RESET: zero each buffer it writes before the first write.
    STRICT: raise StaleGradientError if a buffer still holds an earlier backward's result.
    """

    ACCUMULATE = "accumulate"
    RESET = "reset"
    STRICT = "strict"

    @classmethod
    def parse(cls, value: "ZeroPolicy | str") -> "ZeroPolicy":
        if isinstance(value, ZeroPolicy):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"zero policy {value!r}: expected one of "
                f"{[p.value for p in ZeroPolicy]} or a pydiff.ZeroPolicy"
            ) from None


_global_policy = ZeroPolicy.ACCUMULATE
_context_policy: contextvars.ContextVar[ZeroPolicy | None] = contextvars.ContextVar(
    "pydiff_zero_policy", default=None
)
_active_scope: contextvars.ContextVar["BackwardScope | None"] = contextvars.ContextVar(
    "pydiff_backward_scope", default=None
)


def set_zero_policy(policy: ZeroPolicy | str) -> None:
    """Set the process-wide default policy (``"accumulate"``, ``"reset"`` or ``"strict"``)."""
    global _global_policy
    _global_policy = ZeroPolicy.parse(policy)


def get_zero_policy() -> ZeroPolicy:
    """The policy in force here: the innermost ``zero_policy`` block, else the global one."""
    return _context_policy.get() or _global_policy


@contextlib.contextmanager
def zero_policy(policy: ZeroPolicy | str) -> Iterator[ZeroPolicy]:
    """Use ``policy`` for backwards run inside the block.

    >>> with pydiff.zero_policy("reset"):
    ...     module.f.bwds(x, _result=y)    # x.grad holds this backward's gradient only
    """
    token = _context_policy.set(ZeroPolicy.parse(policy))
    try:
        yield _context_policy.get()
    finally:
        _context_policy.reset(token)


class BackwardScope:
    """One top-level backward: the policy acts once per gradient buffer inside it.

    Nested scopes (a tape running many bwds) join the outermost one, so RESET zeroes a
    buffer only before its first write and contributions within the backward add up.
    """

    def __init__(self, label: str, device=None):
        self.label = label
        self._seen: set[int] = set()
        self._written: list["Tensor"] = []
        # With a device, backward kernels are appended to one command encoder and
        # submitted together (fewer submissions); anything that must see their results
        # first calls flush().
        self._device = device
        self._encoder = None
        self._on_finish: list = []  # checks that read results back (fixed-point overflow)

    def dispatch(self, node, *args, **kwargs) -> None:
        """Run a SlangPy function node now, or append it to this backward's encoder."""
        from . import capturing

        capturing.refuse(f"a SlangPy backward kernel ({self.label})")
        if self._device is None:
            node(*args, **kwargs)
            return
        if self._encoder is None:
            self._encoder = self._device.native.create_command_encoder()
        node.append_to(self._encoder, *args, **kwargs)

    def encoder(self) -> Any:
        """This backward's command encoder (created on first use; needs a batching device)."""
        if self._encoder is None:
            self._encoder = self._device.native.create_command_encoder()
        return self._encoder

    def flush(self) -> None:
        """Submit the kernels appended so far (before a host read or an ordered copy)."""
        if self._encoder is not None:
            self._device.native.submit_command_buffer(self._encoder.finish())
            self._encoder = None

    def clear(self, native: Any) -> None:
        """Zero a SlangPy tensor in order with the kernels appended so far."""
        from . import capturing

        native.clear(self._encoder) if self._encoder is not None else native.clear()
        rec = capturing.recording()
        if rec is not None:
            rec.record_clear(native)

    def on_finish(self, check: Callable[[], None]) -> None:
        """Run ``check`` when this backward ends, after its kernels have run."""
        from . import capturing

        capturing.refuse("a check that reads a backward's results (deterministic mode's overflow check)")
        self._on_finish.append(check)

    def before_accumulate(self, owner: "Tensor", grad: "Tensor", owner_desc: str) -> None:
        """Apply the owner's policy to its ``grad`` before this backward adds into it."""
        key = grad._storage_key()
        if key in self._seen:
            return
        self._seen.add(key)
        policy = owner.zero_policy or get_zero_policy()
        if policy is ZeroPolicy.RESET:
            self.flush()
            grad._clear()
        elif policy is ZeroPolicy.STRICT and grad._holds_result_of is not None:
            raise StaleGradientError(
                f"{owner_desc}: its gradient buffer still holds the result of "
                f"{grad._holds_result_of}; this backward ({self.label}) would add to it. "
                "Call .zero_grad() on the tensor first, or use zero_policy('reset') or "
                "'accumulate'."
            )
        self._written.append(grad)

    def mark_result(self, grad: "Tensor") -> None:
        """Record that ``grad`` now holds this backward's result (set, not added)."""
        self._seen.add(grad._storage_key())
        self._written.append(grad)

    def finish(self) -> None:
        self.flush()
        for grad in self._written:
            grad._holds_result_of = self.label
        checks, self._on_finish = self._on_finish, []
        for check in checks:
            check()


class backward_scope:
    """Enter a top-level backward, or join the one already running.

    A class rather than a generator: this sits on every ``.bwds`` call's path.
    """

    __slots__ = ("label", "device", "_scope", "_token")

    def __init__(self, label: str, device=None):
        self.label = label
        self.device = device

    def __enter__(self) -> BackwardScope:
        outer = _active_scope.get()
        if outer is not None:
            self._scope, self._token = outer, None
            return outer
        self._scope = BackwardScope(self.label, self.device)
        self._token = _active_scope.set(self._scope)
        return self._scope

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._token is None:
            return
        _active_scope.reset(self._token)
        if exc_type is None:
            self._scope.finish()
        else:
            self._scope.flush()
