"""Deterministic mode: every gradient pydiff produces is bitwise the same from run to run.

pydiff's own reductions (broadcast parameters, FwdDiffTensor gradients, ops, optimizers) are
order-independent in every mode; deterministic mode adds what costs extra (separate buffers
for a tensor passed to several parameters) and warns, naming the function, about what a
user's shader does that pydiff cannot make deterministic (docs/determinism.md).

    pydiff.set_deterministic(True)               # process-wide
    with pydiff.deterministic():                 # this block only
        m.f.bwds(x, _result=1.0)                 # NondeterminismWarning if f uses float atomics
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterator

from . import lint, lint_atomics
from .errors import NondeterminismWarning
from .lint_nodiff import own_name
from .signature import FunctionTarget

_global = False
_context: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "pydiff_deterministic", default=None
)
_warned: set[tuple[str, str]] = set()  # (function label, reason): each warning once
_reasons_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # function -> reasons

__all__ = [
    "NondeterminismWarning",
    "deterministic",
    "is_deterministic",
    "set_deterministic",
    "warn_nondeterministic",
]


def set_deterministic(enabled: bool = True) -> None:
    """Turn deterministic mode on or off for the whole process.

    >>> pydiff.set_deterministic(True)
    >>> m.f.bwds(x, _result=1.0)      # the same bits every run
    >>> pydiff.set_deterministic(False)
    """
    global _global
    _global = bool(enabled)


def is_deterministic() -> bool:
    """Whether deterministic mode is on here (the innermost block, else the process-wide one)."""
    inner = _context.get()
    return _global if inner is None else inner


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Deterministic mode (or, with False, not) inside the block.

    >>> with pydiff.deterministic():
    ...     loss.backward()
    """
    token = _context.set(bool(enabled))
    try:
        yield
    finally:
        _context.reset(token)


def _module_source(module: Any) -> str | None:
    path = Path(module.file)
    if not module.file.startswith("<") and path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    return lint.scanned_source(module.file)


def _reasons(fn: FunctionTarget) -> list[str]:
    """Why ``fn``'s backward may not be deterministic (empty when pydiff can vouch for it)."""
    cached = _reasons_of.get(fn)
    if cached is not None:
        return cached
    reasons = []
    for p in fn.params:
        if p.tensor_kind in ("diff", "idiff") and p.writes_gradient:
            reasons.append(
                f"parameter '{p.name}' is a SlangPy {p.type_name}, whose gradient is added with "
                f"float atomics at indices pydiff cannot see; declare it pydiff's "
                f"{'RW' if p.access == 'read_write' else ''}FwdDiffTensor<N> (import pydiff;), "
                "whose gradients are summed in fixed point"
            )
        for path, field in _diff_tensor_fields(p.struct_fields or ()):
            reasons.append(
                f"field '{p.name}.{path}' is a SlangPy {field.type_name}, whose gradient is "
                "added with float atomics at indices pydiff cannot see; pass the tensor as a "
                "FwdDiffTensor<N> parameter of its own (import pydiff;), whose gradients are "
                "summed in fixed point"
            )
    source = _module_source(fn.module)
    if source is not None:
        found = lint_atomics.float_atomic_functions(source).get(own_name(fn.name))
        if found:
            reasons.append(found)
    _reasons_of[fn] = reasons
    return reasons


def warn_nondeterministic(fn: FunctionTarget, extra: list[str] = ()) -> None:
    """In deterministic mode, warn once per function and reason that pydiff cannot keep the
    promise for it (called by ``.bwds``)."""
    for reason in [*_reasons(fn), *extra]:
        key = (fn.label, reason)
        if key in _warned:
            continue
        _warned.add(key)
        warnings.warn(
            f"{fn.label}.bwds: deterministic mode cannot make this gradient bitwise reproducible: "
            f"{reason}",
            NondeterminismWarning,
            stacklevel=4,
        )


def _diff_tensor_fields(fields: tuple, depth: int = 0) -> list[tuple[str, Any]]:
    """(dotted path, FieldInfo) of the DiffTensor fields of a struct's fields, nested too."""
    out = []
    for f in fields:
        if f.diff_tensor and f.access in ("read", "read_write"):
            out.append((f.name, f))
        elif f.fields and depth < 8:
            out += [(f"{f.name}.{sub}", g) for sub, g in _diff_tensor_fields(f.fields, depth + 1)]
    return out


#: What a refused replay of a ``.bwds`` captured with deterministic mode off tells the user.
REPLAY_ADVICE = (
    "Replay with deterministic mode off (pydiff.set_deterministic(False), or replay() inside "
    "`with pydiff.deterministic(False):`), or run the step eagerly: deterministic mode does "
    "not capture .bwds"
)


def off_at_capture() -> str | None:
    """A capture's replay check (``capturing.check_on_replay``) for a ``.bwds`` recorded with
    deterministic mode off (the only way one is recorded: its call plan declines in the mode,
    and a capture refuses what the plan declines). The replay runs the recorded kernel, which
    adds a tensor's gradients as the mode-off path does (several parameters into one buffer,
    in another rounding than the mode's separate sums): with the mode on now, refused."""
    if is_deterministic():
        return (
            "deterministic mode is on, but the step was captured with it off: the replay would "
            "run the kernels chosen without it, which the mode does not vouch for"
        )
    return None
