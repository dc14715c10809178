"""Loops whose trip count is a tensor parameter's length, checked against their
``[MaxIters(n)]`` before ``.bwds``: Slang's backward keeps at most n iterations' values, so a
call whose tensor makes the loop run longer gets wrong gradients without an error (forward
values and ``.fwds`` stay right). Only this pattern is caught, where the count is a length
pydiff sees at the call: ``[MaxIters(n)] for (...; k < x.dim(a); k++)`` (also ``x.shape[a]``,
``<=``, a local set once from it, ``while (k < n)``) with ``x`` a tensor parameter of the
function itself and the condition that one comparison, a ``for`` loop stepping by one.
Anything else (other steps, a bound computed from the length, loops in helpers or imported
files, an overloaded name) is left alone rather than refused on a guess: docs/traps.md.

    loop_bounds.check(fn, bound)   # ValueError: the loop at m.slang:7 runs 1100 times ...
"""

from __future__ import annotations

import re
from typing import Any

from .lint_flow import matching
from .lint_macros import preprocess
from .lint_nodiff import own_name

_LOOP = re.compile(r"\[\s*MaxIters\s*\(\s*(\d+)\s*\)\s*\]\s*(?:\[[^\]]*\]\s*)*(for|while)\s*\(")
_CAST = r"(?:\(\s*(?:int|uint)\s*\)\s*|(?:int|uint)\s*\(\s*)?"
_OF = (  # x.dim(a) or x.shape[a], the cast's ")", and what is subtracted ("- 1")
    r"([A-Za-z_]\w*)\s*\.\s*(?:dim\s*\(\s*(\d+)\s*\)|shape\s*\[\s*(\d+)\s*\])"
    r"\s*\)?(?:\s*-\s*(\d+))?"
)
# the whole condition one comparison: `k < x.dim(0)`, `k <= n`
_CONDITION = re.compile(r"^\s*[A-Za-z_]\w*\s*(<=?)\s*(?:" + _CAST + _OF + r"|([A-Za-z_]\w*))\s*$")
_LENGTH_LOCAL = re.compile(
    r"\b(?:const\s+)?(?:int|uint|let|var)\s+([A-Za-z_]\w*)\s*=\s*" + _CAST + _OF + r"\s*;"
)
_STEP_ONE = re.compile(r"^\s*(?:\+\+\s*\w+|\w+\s*\+\+|\w+\s*\+=\s*1)\s*$")
_FUNCTION = re.compile(  # (a generic's `where` clause before the body too)
    r"\b([A-Za-z_]\w*)\s*(?:<[^(){};]*>\s*)?\(([^(){};]*)\)\s*(?:where\b[^(){};]*)?\{"
)
_NOT_FUNCTIONS = ("for", "while", "if", "switch", "return")
_CACHE: dict[str, dict] = {}
_CACHE_MAX = 64


def _matching(src: str, start: int, open_ch: str, close_ch: str) -> int:
    """The offset of the bracket closing the one at ``start`` (the text's end if none)."""
    end = matching(src, start, open_ch, close_ch)
    return len(src) if end < 0 else end


def _blank_comments(src: str) -> str:
    """Comments as spaces (offsets and lines kept)."""
    return re.sub(
        r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), src, flags=re.S
    )


def _split_params(text: str) -> list[str]:
    """A parameter list split at its own commas (not those of ``Tensor<float, 2>``)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    return out + [text[start:]]


def _functions(src: str) -> tuple[list, dict[str, int]]:
    """(name, tensor parameters -> their dimensions, body start, body end) per function, and
    how many functions share each name."""
    functions, counts = [], {}
    for m in _FUNCTION.finditer(src):
        if m.group(1) in _NOT_FUNCTIONS:
            continue
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        dims = {}  # (a tensor type's dimensions: the last number in its declaration)
        for param in _split_params(m.group(2)):
            words = re.findall(r"[A-Za-z_]\w*", param.split("=")[0])
            numbers = re.findall(r"\d+", param.split("=")[0])
            if words and "Tensor" in param and numbers:
                dims[words[-1]] = int(numbers[-1])
        functions.append((m.group(1), dims, m.end() - 1, _matching(src, m.end() - 1, "{", "}")))
    return functions, counts


def _bound(src: str, condition: re.Match, body_start: int, loop_start: int) -> tuple | None:
    """(parameter, axis, what is subtracted from its length) whose length the loop's
    condition compares against, or None."""
    param, axis = condition.group(2), condition.group(3) or condition.group(4)
    if param is not None:
        return param, int(axis), int(condition.group(5) or 0)
    local = condition.group(6)  # a local set once from a length (`int n = x.shape[0];`)
    before = src[body_start:loop_start]
    sets = [m for m in _LENGTH_LOCAL.finditer(before) if m.group(1) == local]
    assigned = re.findall(rf"(?<![\w.]){local}\s*(?:[-+*/%&|^]|<<|>>)?=(?!=)", before)
    if len(sets) != 1 or len(assigned) != 1:
        return None  # (set again, or not from a length)
    found = sets[0]
    return found.group(2), int(found.group(3) or found.group(4)), int(found.group(5) or 0)


def scan(source: str) -> dict[str, list[tuple[str, int, int, int, int, int]]]:
    """Per function name, its loops bounded by a tensor parameter's length: (parameter, axis,
    the parameter's dimensions, MaxIters n, iterations past the length (1 for ``<=``, less
    what the bound subtracts: ``k <= x.dim(0) - 1`` runs the length), line)."""
    src = _blank_comments(preprocess(source).text)  # (macros expanded, `#if 0` dropped)
    functions, counts = _functions(src)
    found: dict[str, list] = {}
    for loop in _LOOP.finditer(src):
        header = src[loop.end() : _matching(src, loop.end() - 1, "(", ")")]
        if loop.group(2) == "for":
            parts = header.split(";")
            if len(parts) != 3 or not _STEP_ONE.match(parts[2]):
                continue  # (another step: the count is not the length)
            header = parts[1]
        inside = [f for f in functions if f[2] < loop.start() < f[3]]
        condition = _CONDITION.match(header)
        if not inside or condition is None or counts[inside[-1][0]] > 1:
            continue  # (an overloaded name: which overload's loop runs is not known here)
        name, dims, body_start = inside[-1][0], inside[-1][1], inside[-1][2]
        bound = _bound(src, condition, body_start, loop.start())
        if bound is not None and bound[0] in dims:
            line = src.count("\n", 0, loop.start()) + 1
            n, extra = int(loop.group(1)), int(condition.group(1) == "<=") - bound[2]
            found.setdefault(name, []).append((*bound[:2], dims[bound[0]], n, extra, line))
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
    # the scan keys loops by the function's own name (f<2>, A::f: f; a name defined twice,
    # in two namespaces too, has none)
    for param, axis, dims, n, extra, line in loops.get(own_name(fn.name), ()):
        for p, value in bound:
            shape: Any = getattr(value, "shape", None)
            if p.name != param or not isinstance(shape, tuple) or not axis < dims <= len(shape):
                continue
            length = shape[len(shape) - dims + axis]  # (leading axes: the call's own)
            runs = length + extra
            if runs > n:
                raise ValueError(
                    f"{fn.label}: the loop at {fn.module.file}:{line} runs {runs} times here "
                    f"({param}.dim({axis}) = {length}), past its [MaxIters({n})]: Slang's "
                    f"backward keeps at most {n} iterations' values, so the gradients would be "
                    f"wrong (silently). Raise MaxIters to at least {runs}, or pass a shorter "
                    f"'{param}'"
                )
