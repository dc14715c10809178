"""Deterministic mode's scan: functions whose backward adds with float atomics
(``InterlockedAdd``, ``atomicAdd``, ``AtomicTensor``), whose order, and so whose rounding,
depends on thread scheduling; through calls and hand-written derivatives.

    reasons = float_atomic_functions(open("splat.slang").read())
    reasons.get("splat")   # "'InterlockedAdd' in splat_bwd() (line 12): ..."
"""

from __future__ import annotations

import re

from .lint_flow import call_at
from .lint_flow import matching as _matching
from .lint_macros import blank_comments_and_strings as _strip_comments

_ATOMIC = re.compile(
    r"\b(Interlocked(?:Add|AddF32|AddF16|AddF64|CompareExchange\w*)|atomicAdd|AtomicTensor|"
    r"InterlockedAddF32|_NvInterlockedAdd\w*)\b"
)
# (a generic's ``where`` clause may stand between the parameters and the body)
ANY_FUNCTION = re.compile(
    r"(?:^|[;}\]\s])([A-Za-z_]\w*)\s*(<(?:[^<>(){};]|<[^<>(){};]*>)*>)?\s*\(([^(){};]*)\)"
    r"\s*(?:where\b[^(){};]*)?\{"
)
_DERIVATIVE_ATTR = re.compile(
    r"\[\s*(BackwardDerivative|BackwardDerivativeOf)\s*\(\s*([A-Za-z_]\w*)"
)
KEYWORDS = {"if", "for", "while", "switch", "return", "else", "do"}


def _all_functions(src: str) -> dict[str, tuple[str, str]]:
    """Every function definition: name -> (the text of the attributes before it, body)."""
    out: dict[str, tuple[str, str]] = {}
    prev_end = 0
    for m in ANY_FUNCTION.finditer(src):
        name = m.group(1)
        if name in KEYWORDS:
            continue
        brace = m.end() - 1
        end = _matching(src, brace, "{", "}")
        if end < 0:
            continue
        head_start = max(
            src.rfind(";", prev_end, m.start()), src.rfind("}", prev_end, m.start()), prev_end
        )
        attrs = src[head_start : m.start() + 1]
        body = src[brace:end]
        attrs_old, body_old = out.get(name, ("", ""))
        out[name] = (attrs_old + attrs, body_old + body)  # overloads: merged
        prev_end = end
    return out


def float_atomic_functions(source: str) -> dict[str, str]:
    """Functions whose backward may add with atomics in a scheduling-dependent order.

    A function qualifies if its body (or a function it calls, or its hand-written backward
    derivative) uses InterlockedAdd/atomicAdd/AtomicTensor. Returns name -> reason.

    >>> float_atomic_functions(src).get("splat")
    "'InterlockedAdd' in splat_bwd() (line 12): ..."
    """
    src = _strip_comments(source)
    fns = _all_functions(src)
    reason: dict[str, str] = {}
    for name, (_, body) in fns.items():
        m = _ATOMIC.search(body)
        if m:
            line = src.count("\n", 0, src.find(body) + m.start()) + 1
            reason[name] = (
                f"'{m.group(1)}' in {name}() (line {line}) adds in whatever order threads arrive; "
                "on floats that order changes the rounding. Accumulate in fixed point "
                "(int64 InterlockedAdd of round(g * 2^32)) or use pydiff's FwdDiffTensor"
            )
    changed = True
    while changed:
        changed = False
        for name, (attrs, body) in fns.items():
            if name in reason:
                for kind, target in _DERIVATIVE_ATTR.findall(attrs):
                    if kind == "BackwardDerivativeOf" and target not in reason:
                        reason[target] = reason[name]  # name is target's backward
                        changed = True
                continue
            for kind, target in _DERIVATIVE_ATTR.findall(attrs):
                if kind == "BackwardDerivative" and target in reason:
                    reason[name] = reason[target]
            for callee, why in list(reason.items()):
                if name not in reason and callee != name and call_at(body, callee) >= 0:
                    reason[name] = why
            changed = changed or name in reason
    return reason
