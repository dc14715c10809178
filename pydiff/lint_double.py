"""The scan for math intrinsics called on ``double`` values (which some drivers get wrong).

SPIR-V's GLSL.std.450 defines sin, exp, log, pow, ... for 16- and 32-bit floats only; Slang
emits them on doubles all the same, and Mesa's lavapipe returns 0, 1 or denormal garbage for
them (sqrt, fma, floor, ... are right). Which intrinsics a device gets wrong is measured once
per device (``pydiff.double_math``); this scan finds where a function calls one of them on a
double: an argument naming a ``double`` parameter or local, a ``double(...)`` cast or a double
literal (``1.0l``), outside ``float(...)``/``half(...)`` conversions. Callers inherit it.

    calls = double_calls(source)     # {function: [(line, "sin", function calling it), ...]}
"""

from __future__ import annotations

import re

from .lint_macros import blank_comments_and_strings

#: The intrinsics measured per device (one and two arguments).
UNARY = (
    "sin cos tan asin acos atan exp exp2 log log2 log10 sinh cosh tanh asinh acosh atanh sqrt rsqrt"
).split()
BINARY = ("atan2", "pow", "fmod", "ldexp")

_FUNCTION = re.compile(
    r"(?:^|[;}\]\s])([A-Za-z_]\w*)\s*(?:<(?:[^<>(){};]|<[^<>(){};]*>)*>)?\s*\(([^(){};]*)\)"
    r"\s*(?:where\b[^{;]*)?\{"
)
_DOUBLE_DECL = re.compile(
    r"\b(?:double[234]?(?:x[234])?|float64_t|vector\s*<\s*double\s*,\s*\d\s*>|"
    r"matrix\s*<\s*double[^>]*>)\s+([A-Za-z_]\w*)((?:\s*(?:=[^,;)]*)?,\s*[A-Za-z_]\w*)*)"
)
_DOUBLE_LITERAL = re.compile(r"\b\d+(?:\.\d*)?(?:[eE][-+]?\d+)?[lL]\b|\bdouble[234]?\s*\(")
_NARROWING = re.compile(r"\b(?:float|half)[234]?\s*\(")
_KEYWORDS = {"if", "for", "while", "switch", "return", "else", "do"}


def _closing(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] in "({":
            depth += 1
        elif text[i] in ")}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def _functions(text: str) -> list[tuple[str, str, int, int]]:
    """(name, parameter text, body start, body end) of each function definition."""
    found = []
    for m in _FUNCTION.finditer(text):
        if m.group(1) in _KEYWORDS:
            continue
        brace = m.end() - 1
        found.append((m.group(1), m.group(2), brace, _closing(text, brace)))
    return found


def _without_narrowing(arg: str) -> str:
    """``arg`` with its ``float(...)``/``half(...)`` conversions cut out (computed in float)."""
    while (m := _NARROWING.search(arg)) is not None:
        end = _closing(arg, m.end() - 1)
        arg = arg[: m.start()] + arg[end + 1 :]
    return arg


def _double_names(text: str) -> set[str]:
    names = set()
    for m in _DOUBLE_DECL.finditer(text):
        names.add(m.group(1))
        names.update(re.findall(r",\s*([A-Za-z_]\w*)", m.group(2) or ""))
    return names


def double_calls(source: str) -> dict[str, list[tuple[int, str, str]]]:
    """Per function: (line, intrinsic, function calling it) of each intrinsic it calls with a
    double argument, or reaches through the functions it calls."""
    text = blank_comments_and_strings(source)
    functions = _functions(text)
    intrinsic = re.compile(r"\b(" + "|".join((*UNARY, *BINARY)) + r")\s*\(")
    own: dict[str, list[tuple[int, str, str]]] = {}
    for name, params, start, end in functions:
        body = text[start:end]
        doubles = _double_names(params + ";" + body)
        for m in intrinsic.finditer(body):
            close = _closing(body, m.end() - 1)
            arg = _without_narrowing(body[m.end() : close])
            words = set(re.findall(r"[A-Za-z_]\w*", arg))
            if words & doubles or _DOUBLE_LITERAL.search(arg):
                line = text.count("\n", 0, start + m.start()) + 1
                own.setdefault(name, []).append((line, m.group(1), name))
    result = {name: list(calls) for name, calls in own.items()}
    changed = True
    while changed:  # callers inherit (matched by name, as the trap scan does)
        changed = False
        for name, _, start, end in functions:
            for callee, calls in list(result.items()):
                if callee == name or not re.search(rf"\b{callee}\s*\(", text[start:end]):
                    continue
                for call in calls:
                    if call not in result.setdefault(name, []):
                        result[name].append(call)
                        changed = True
    return result
