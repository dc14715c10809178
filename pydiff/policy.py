"""Zeroing policies: what a backward does with a gradient buffer that already holds values.

pydiff.set_zero_policy("reset")            # every backward starts from zero
with pydiff.zero_policy("strict"):         # adding into a used gradient raises
    module.f.bwds(x, _result=y)
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from typing import Iterator


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
