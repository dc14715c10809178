"""Loops whose trip count is a tensor parameter's length, checked against their
``[MaxIters(n)]`` before ``.bwds``: Slang's backward keeps at most n iterations' values, so a
call whose tensor makes the loop run longer gets wrong gradients without an error (forward
values and ``.fwds`` stay right). Only this pattern is caught, where the count is a length
pydiff sees at the call: ``[MaxIters(n)] for (...; k < x.dim(a); ...)`` (also ``x.shape[a]``,
``<=``, a ``while`` condition) with ``x`` a parameter of the function itself.

    loop_bounds.check(fn, bound)   # ValueError: the loop at m.slang:7 runs x.dim(0) = 1100 ...
"""

from __future__ import annotations

import re
from typing import Any


_LOOP = re.compile(r"\[\s*MaxIters\s*\(\s*(\d+)\s*\)\s*\]\s*(?:\[[^\]]*\]\s*)*(for|while)\s*\(")
_LENGTH = re.compile(
    r"(<=?)\s*([A-Za-z_]\w*)\s*\.\s*(?:dim\s*\(\s*(\d+)\s*\)|shape\s*\[\s*(\d+)\s*\])"
)
_LENGTH_LOCAL = re.compile(
    r"\b(?:const\s+)?(?:int|uint|let|var)\s+([A-Za-z_]\w*)\s*=\s*(?:int|uint)?\s*\(?\s*"
    r"([A-Za-z_]\w*)\s*\.\s*(?:dim\s*\(\s*(\d+)\s*\)|shape\s*\[\s*(\d+)\s*\])\s*\)?\s*;"
)
_NAME_BOUND = re.compile(r"(<=?)\s*([A-Za-z_]\w*)\b(?!\s*[.(\[])")
_FUNCTION = re.compile(r"\b([A-Za-z_]\w*)\s*\(([^(){};]*)\)\s*\{")
_CACHE: dict[str, dict] = {}
_CACHE_MAX = 64


def _matching(src: str, start: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for i in range(start, len(src)):
        if src[i] == open_ch:
            depth += 1
        elif src[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    return len(src)


def _blank_comments(src: str) -> str:
    """Comments as spaces (offsets and lines kept)."""
    return re.sub(
        r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), src, flags=re.S
    )


def scan(source: str) -> dict[str, list[tuple[str, int, int, int, int]]]:
    """Per function name, its loops bounded by a parameter's length: (parameter, axis,
    MaxIters n, iterations past the length (1 for ``<=``, else 0), line)."""
    src = _blank_comments(source)
    functions = []
    for m in _FUNCTION.finditer(src):
        if m.group(1) in ("for", "while", "if", "switch"):
            continue
        names = set()
        for param in m.group(2).split(","):
            words = re.findall(r"[A-Za-z_]\w*", param.split("=")[0])
            if words:
                names.add(words[-1])  # (the parameter's name: its last word)
        functions.append((m.group(1), names, m.end() - 1, _matching(src, m.end() - 1, "{", "}")))
    found: dict[str, list] = {}
    for loop in _LOOP.finditer(src):
        header = src[loop.end() : _matching(src, loop.end() - 1, "(", ")")]
        if loop.group(2) == "for":
            parts = header.split(";")
            header = parts[1] if len(parts) == 3 else ""
        inside = [f for f in functions if f[2] < loop.start() < f[3]]
        if not inside:
            continue
        name, params, body_start = inside[-1][0], inside[-1][1], inside[-1][2]
        # a local holding a parameter's length (`int n = x.shape[0];`, as traps.md asks)
        lengths = {
            m.group(1): (m.group(2), m.group(3) or m.group(4))
            for m in _LENGTH_LOCAL.finditer(src, body_start, loop.start())
            if m.group(2) in params
        }
        bounds = [
            (m.group(1), m.group(2), m.group(3) or m.group(4)) for m in _LENGTH.finditer(header)
        ]
        bounds += [
            (m.group(1), *lengths[m.group(2)])
            for m in _NAME_BOUND.finditer(header)
            if m.group(2) in lengths
        ]
        for op, param, axis in bounds:
            if param in params:
                line = src.count("\n", 0, loop.start()) + 1
                found.setdefault(name, []).append(
                    (param, int(axis), int(loop.group(1)), int(op == "<="), line)
                )
    return found


def check(fn: Any, bound: list) -> None:
    """Refuse a ``.bwds`` whose tensor makes one of ``fn``'s length-bounded loops run past
    its ``[MaxIters(n)]`` (scanned once per module source). ``fn``: a shader function (its
    ``name``, ``label``, ``module.source``/``file``); ``bound``: its (ParamInfo, value) pairs."""
    source = fn.module.source
    if source is None or "MaxIters" not in source:
        return
    loops = _CACHE.get(source)
    if loops is None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        loops = _CACHE[source] = scan(source)
    for param, axis, n, extra, line in loops.get(fn.name, ()):
        for p, value in bound:
            shape: Any = getattr(value, "shape", None)
            if p.name != param or not isinstance(shape, tuple) or axis >= len(shape):
                continue
            runs = shape[axis] + extra
            if runs > n:
                raise ValueError(
                    f"{fn.label}: the loop at {fn.module.file}:{line} runs {runs} times here "
                    f"({param}.dim({axis}) = {shape[axis]}), past its [MaxIters({n})]: "
                    f"Slang's backward keeps at most {n} iterations' values, so the gradients "
                    f"would be wrong (silently). Raise MaxIters to at least {runs}, or pass "
                    f"a shorter '{param}'"
                )
