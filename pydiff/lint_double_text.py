"""Text helpers of the double-intrinsic scan (``lint_double``): the bracket an opening one
closes, conversions to float cut out of an expression, whether an expression names a value.

    closing("f(a(b), c)", 1)          # 9: the ')' closing the '(' at 1
    narrowed("sin(float(x)) + y")     # 'sin( 0 ) + y'
"""

from __future__ import annotations

import re
from typing import Any


def closing(text: str, open_at: int) -> int:
    """Where the bracket (``(`` or ``{``) at ``open_at`` closes (``len(text)`` if never)."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] in "({":
            depth += 1
        elif text[i] in ")}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


_TO_FLOAT = re.compile(r"[\w.\[\]]+\s*\.\s*toFloat\s*\(\s*\)")
_CONVERSION = re.compile(
    r"\b(?:(?:float|half)[234]?|__realCast\s*<\s*(?:float|half)[234]?\s*>)\s*\("
)


def narrowed(expr: str) -> str:
    """``expr`` with its conversions to float cut out (``float(x)``, ``x.toFloat()``,
    ``__realCast<float>(x)``: how a generic computes in float)."""
    expr = _TO_FLOAT.sub(" 0 ", expr)
    while (m := _CONVERSION.search(expr)) is not None:
        expr = expr[: m.start()] + " 0 " + expr[closing(expr, m.end() - 1) + 1 :]
    return expr


def mentions(expr: str, names: set, typed: Any) -> bool:
    """Whether ``expr``, its float conversions cut out, names one of ``names`` or a type
    ``typed`` matches."""
    expr = narrowed(expr)
    return bool(typed.search(expr)) or any(re.search(rf"\b{re.escape(n)}\b", expr) for n in names)
