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


_OLD_GENERIC = re.compile(
    r"\b__generic\s*<((?:[^<>(){};]|<[^<>(){};]*>)*)>(\s*(?:\[[^\]]*\]\s*)*[^(){};=]*?)"
    r"\b([A-Za-z_]\w*)\s*\("
)
_DOUBLE_EXTENSION = re.compile(
    r"\bextension\s+(?:double[234]?(?:x[234])?|float64_t|vector\s*<\s*double[^>]*>)\s*"
    r"(?::[^{;]*)?\{"
)


def plain_generics(text: str) -> str:
    """``text`` with Slang's older generic syntax written as the newer one the scan reads
    (``__generic<T : I> T f(T x)`` as ``T f<T : I>(T x)``), and ``this`` in an extension of a
    double type written ``double(this)``; the lines stay on their lines."""
    text = _OLD_GENERIC.sub(lambda m: f"{m[2]}{m[3]}<{m[1]}>(", text)
    for m in reversed(list(_DOUBLE_EXTENSION.finditer(text))):
        end = closing(text, m.end() - 1)
        body = re.sub(r"\bthis\b", "double(this)", text[m.end() : end])
        text = text[: m.end()] + body + text[end:]
    return text
