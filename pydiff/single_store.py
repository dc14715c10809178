"""Interface tensors a function called over a grid stores into once per thread, at the
thread's own element (``y[idx] = ...`` for a grid index ``int idx``; ``y[px.y, px.x] = ...``
for ``int2 px``, the row first as SlangPy's grid gives it; 3-D alike), read from its source.

``.bwds`` of an ``IWDiffTensor`` counts the stores of each element (written_mask: two stores
read the upstream gradient twice, a store outside the tensor loses it) and reads the count
back, which costs a flush and a wait per call. Where the text shows one store per thread at
its own grid element, and the grid has the tensor's shape, no element can be stored twice or
outside: the count is skipped. The rules are conservative (a miss keeps the count): exactly
one mention of the tensor, a plain ``=`` store at the grid index or at locals set once from
its components; no loop, ``goto`` or ``switch`` in the function; the index never assigned or
passed to a function that might change it
(through any swizzle, subscript or parentheses: ``px[1] = 0``, ``px.g = 0``, ``f((idx))``);
no ``#include`` (its macros are not read) and no macro defined differently in ``#if`` branches.

    once = stores_once(source, "blur", "px", 2, ["result"])     # {"result"}
"""

from __future__ import annotations

import re

from .lint_atomics import ANY_FUNCTION, KEYWORDS
from .lint_flow import matching
from .lint_index import split_top
from .lint_macros import blank_comments_and_strings, preprocess

_CACHE: dict[tuple, frozenset] = {}
_CACHE_MAX = 1024
_LOOPS = re.compile(r"\b(?:for|while|do|goto|switch)\b")
_ASSIGNED = r"(?:\s*(?:[-+*/%&|^]|<<|>>)?=(?!=)|\s*\+\+|\s*--)"
#: Functions an index may be passed to: intrinsics taking their arguments by value.
_BY_VALUE = set(
    "min max clamp abs float int uint float2 float3 int2 int3 uint2 uint3 select".split()
)
_AXES = "xyz"
#: What may follow a name in an lvalue of it: members/swizzles, subscripts, closing parentheses.
_CHAIN = r"(?:\s*\.\s*\w+|\s*\[[^\[\]]*\]|\s*\))*"


def stores_once(source: str, function: str, grid: str, dims: int, tensors: list) -> frozenset:
    """The names among ``tensors`` (parameters of ``function``) that it stores into exactly
    once per thread, at the element of the grid index parameter ``grid`` of ``dims`` axes."""
    # (a str caches its hash, and compares by identity first: the module's one source object)
    key = (source, function, grid, dims, tuple(tensors))
    found = _CACHE.get(key)
    if found is None:
        found = frozenset(_scan(source, function, grid, dims, tensors))
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = found
    return found


def _body(text: str, function: str) -> str | None:
    """The body of the one definition of ``function`` (None: none, or several), at the top
    level: one in a namespace or struct is another function (``m.f`` may be an imported
    module's ``f``, whose text is not here)."""
    bodies = []
    for m in ANY_FUNCTION.finditer(text):
        if m.group(1) == function and m.group(1) not in KEYWORDS:
            if text.count("{", 0, m.start()) != text.count("}", 0, m.start()):
                return None
            end = matching(text, m.end() - 1, "{", "}")
            bodies.append(text[m.end() : end] if end > 0 else None)
    return bodies[0] if len(bodies) == 1 else None


def _scan(source: str, function: str, grid: str, dims: int, tensors: list) -> list[str]:
    pre = preprocess(source)
    if pre.includes or pre.uncertain or any(m.alternatives for m in pre.macros.values()):
        return []  # (a macro from an #include, or one of several definitions, is not seen)
    text = blank_comments_and_strings(pre.text)
    body = _body(text, function)
    if body is None or _LOOPS.search(body) or not 1 <= dims <= 3:
        return []
    # the index: the grid parameter (1-D) or its components, and locals set once from them
    axes = [grid] if dims == 1 else [f"{grid}.{_AXES[a]}" for a in reversed(range(dims))]
    names = {grid}
    for m in re.finditer(r"\b(?:const\s+)?(?:u?int|let|var)\s+(\w+)\s*=\s*([\w.\s]+?)\s*;", body):
        value = re.sub(r"\s+", "", m.group(2))
        if value in axes:
            axes[axes.index(value)] = m.group(1)  # (its first such local stands for it)
            names.add(m.group(1))
    for name in names:
        # (through any swizzle, subscript or parentheses: ``px.g = 0``, ``px[1] = 0``, ``(i)++``)
        writes = re.findall(
            rf"(?<![\w.])(?:\+\+|--)[\s(]*{name}\b|\b{name}\b{_CHAIN}{_ASSIGNED}", body
        )
        declared = 0 if name == grid else 1
        # (a declaration without a value shadows it too: ``{ int idx; ... }``)
        decls = [d for d in re.findall(rf"(?<![\w.])(\w+)\s+{name}\b", body) if d not in KEYWORDS]
        if len(writes) != declared or len(decls) != declared:
            return []  # (a local's one write is its declaration)
    if _passed_to_calls(text, body, names):
        return []
    once = []
    for tensor in tensors:
        mentions = list(re.finditer(rf"(?<![\w.])\b{re.escape(tensor)}\b", body))
        if len(mentions) != 1:
            continue
        store = re.match(r"\s*\[([^\[\]]*)\]\s*=(?!=)", body[mentions[0].end() :])
        if store is None:
            continue
        index = [re.sub(r"\s+", "", part) for part in split_top(store.group(1))]
        if index == axes:
            once.append(tensor)
    return once


def _passed_to_calls(text: str, body: str, names: set) -> bool:
    """Whether an index name (or a component) is an argument of a call that might change it:
    one at a parameter that is not plainly by value in the function's one definition in
    ``text`` (``inout``, ``out``, ``ref``), or of a function not defined there."""
    lvalue = re.compile(rf"\(*(?:{'|'.join(map(re.escape, names))})\b{_CHAIN}")
    # (a generic call ``bump<int>(idx)`` too; an intrinsic's name defined in the text is the
    # text's function)
    for m in re.finditer(r"\b(\w+)\s*(?:<(?:[^<>(){};]|<[^<>(){};]*>)*>)?\s*\(", body):
        defined = any(d.group(1) == m.group(1) for d in ANY_FUNCTION.finditer(text))
        if m.group(1) in KEYWORDS or (m.group(1) in _BY_VALUE and not defined):
            continue
        args = split_top(body[m.end() : matching(body, m.end() - 1, "(", ")")])
        at = [i for i, a in enumerate(args) if lvalue.fullmatch(re.sub(r"\s+", "", a))]
        if not at:
            continue
        params = _params(text, m.group(1))
        if params is None or any(i >= len(params) or _BY_REF.match(params[i]) for i in at):
            return True
    return False


_BY_REF = re.compile(r"\s*(?:\[[^\]]*\]\s*)*(?:\w+\s+)*?(?:inout|out|ref|__ref)\b")


def _params(text: str, function: str) -> list[str] | None:
    """The parameter texts of the one definition of ``function`` in ``text`` (None: not one)."""
    found = [m.group(3) for m in ANY_FUNCTION.finditer(text) if m.group(1) == function]
    return split_top(found[0]) if len(found) == 1 else None
