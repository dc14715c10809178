"""What a differentiable function reaches beyond its own text, for pydiff.lint: the index
kinds of the interface diff tensors in the functions it calls (SlangPy 0.43.1 segfaults
compiling a backward that reaches both kinds), and the struct types that hold an interface
tensor however deep (a field of such a struct, a typealias/typedef, a generic parameter
constrained to one: building any call that passes one segfaults). docs/traps.md.

    holders = interface_holders(src)                       # ['Layer', 'Outer', ...]
    reach = reached_kinds([(name, body), ...], own_kinds)  # name -> kind -> shown
"""

from __future__ import annotations

import re

from .lint_flow import call_at, matching

_STRUCT = re.compile(r"\bstruct\s+([A-Za-z_]\w*)[^{;]*\{")
_INTERFACE_TENSOR = re.compile(r"\bI(?:RW|W)?(?:Diff)?Tensor\s*<")
_TYPEALIAS = re.compile(r"\btypealias\s+([A-Za-z_]\w*)\s*=([^;]*);")
_TYPEDEF = re.compile(r"\btypedef\s+([^;]*?)\s*\b([A-Za-z_]\w*)\s*;")


def _holds(text: str, names: set[str]) -> bool:
    """Whether ``text`` names an interface tensor type or one of ``names``."""
    if _INTERFACE_TENSOR.search(text):
        return True
    return any(re.search(rf"(?<![\w.]){re.escape(n)}\b", text) for n in names)


def _generics(head: str) -> str:
    """The generic parameter list of a struct head (``<T : IDiffTensor<float, 1>>``), not
    the interfaces it conforms to (``: IRWDiffTensor<T, D>``, which SlangPy's own tensors
    implement)."""
    head = head.lstrip()
    depth = 0
    for k, ch in enumerate(head if head.startswith("<") else ""):
        depth += (ch == "<") - (ch == ">")
        if depth == 0:
            return head[: k + 1]
    return ""


def interface_holders(src: str) -> list[str]:
    """The structs in ``src`` with an interface tensor field, directly, in a nested struct,
    behind a typealias/typedef or as a generic parameter constrained to one."""
    aliases = {a.group(1): a.group(2) for a in _TYPEALIAS.finditer(src)}
    aliases |= {a.group(2): a.group(1) for a in _TYPEDEF.finditer(src)}
    structs = []
    for m in _STRUCT.finditer(src):
        end = matching(src, m.end() - 1, "{", "}")
        if end > 0:
            structs.append((m.group(1), _generics(src[m.end(1) : m.end() - 1]), src[m.end() : end]))
    holders: list[str] = []
    names: set[str] = set()  # type names that are (or hold) an interface tensor
    changed = True
    while changed:
        changed = False
        for name, target in aliases.items():
            if name not in names and _holds(target, names):
                names.add(name)
                changed = True
        for name, head, body in structs:
            if name not in holders and (_holds(body, names) or _holds(head, names)):
                holders.append(name)
                names.add(name)
                changed = True
    return holders


def reached_kinds(
    functions: list[tuple[str, str]], kinds: dict[str, dict[str, str]]
) -> dict[str, dict[str, str]]:
    """Per function (name, body): each index kind it uses or reaches through the functions
    it calls, with an access that shows it (``w[idx] in h()``)."""
    reach = {name: dict(k) for name, k in kinds.items()}
    changed = True
    while changed:
        changed = False
        for name, body in functions:
            mine = reach.setdefault(name, {})
            for callee, theirs in list(reach.items()):
                if callee == name or call_at(body, callee) < 0:
                    continue
                for kind, shown in theirs.items():
                    if kind not in mine:
                        mine[kind] = f"{shown} in {callee}()" if callee in kinds else shown
                        changed = True
    return reach
