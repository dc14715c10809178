"""Cross-lane and side-effecting code in Slang source, per function: what gives other results
in a kernel that maps call elements to threads otherwise than SlangPy's does.

- **cross-lane**: wave and quad intrinsics (``WaveActiveSum``, ``WaveReadLaneAt``,
  ``WavePrefixSum``, ``WaveGetLaneIndex``, ``QuadReadAcrossX``, ...), ``groupshared``
  variables, group barriers, ``ddx``/``ddy``: their values depend on which elements share a
  wave or a group. pydiff's elementwise generated kernels run eight elements per thread:
  ``a * x + WaveActiveSum(x)`` over 10 elements gave 12, 16, 18, ... there where SlangPy's
  path gives 38, 40, 42, ... (s42). The vector and grid kernels run one element per thread
  in SlangPy's order (``tests/test_s33_grid33.py``, ``test_s42_silentgap.py``): kept.
- **side effect**: atomics (``InterlockedAdd``, ``atomicAdd``, ``Atomic<T>``) and ``printf``.
  The elementwise kernels also run the function on the spare lanes of the last float4
  (results dropped, but not an atomic add or a print).

Functions are keyed by their own name (``lint_nodiff.own_name``), overloads merged; a function
calling or naming one that qualifies qualifies, and so does one whose hand-written derivative
does, one naming a type (or an interface of it) or reading a property whose code qualifies, one
using the symbol of a user-defined operator that qualifies on its types (lanes43), and every
function when a generic ``extension<T> T`` qualifies. Strings naming cross-lane code
(``__intrinsic_asm "WaveActiveSum($0)"``, ``__target_intrinsic``) count. When in doubt it
declines: declining costs only speed.

    lane_effects("float f(float x) { return WaveActiveSum(x); }")
    # {'f': ('cross-lane', "'WaveActiveSum' in f()")}
"""

from __future__ import annotations

import functools
import re

from .lint_atomics import KEYWORDS
from .lint_flow import matching
from .lint_macros import blank_comments_and_strings

_CROSS_LANE = re.compile(
    r"\b(Wave[A-Z]\w*|Quad[A-Z]\w*|GroupMemoryBarrier\w*|AllMemoryBarrier\w*|"
    r"DeviceMemoryBarrier\w*|ddx\w*|ddy\w*|fwidth\w*|__syncwarp|subgroup[A-Z]\w*|"
    r"OpGroupNonUniform\w*|OpControlBarrier|OpSubgroup\w*|gl_Subgroup\w*|__shfl\w*|"
    r"__ballot\w*|__activemask|__any_sync|__all_sync|__match\w*|__reduce\w*_sync|"
    r"__syncthreads\w*|barrier|memoryBarrier\w*|groupMemoryBarrier)\b"
)
_SIDE_EFFECT = re.compile(r"\b(Interlocked[A-Z]\w*|atomic[A-Z]\w*|Atomic\s*<|printf)")
_GROUPSHARED = re.compile(r"\bgroupshared\b([^;=]*)")
_NAME = re.compile(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*$")
_DERIVATIVE = re.compile(
    r"\[\s*(?:Backward|Forward|Primal)(?:Derivative|Substitute)(Of)?\s*\(\s*(?:[A-Za-z_]\w*::)*([A-Za-z_]\w*)"
)
#: a call's name (``f(``, ``f<float>(``, a method ``a.f(``: as lint_flow.call_at finds them,
#: and ``g`` of ``bwd_diff(g)(...)`` / ``fwd_diff(g)(...)``: a call of g's derivative, which
#: runs g's cross-lane code too; review42)
_CALL = re.compile(
    r"\b(?:__)?(?:bwd|fwd)_diff\s*\(\s*(?:[A-Za-z_]\w*::)*([A-Za-z_]\w*)"
    r"|\b([A-Za-z_]\w*)\s*(?:<[^;{}()]*>\s*)?\("
)
#: a type whose body (properties, subscripts, ``__init``, methods) may hold such code
_TYPE = re.compile(
    r"\b(?=__generic|struct|class|interface|extension)(?:(__generic\s*<[^{};]*>\s*)?"
    r"(?:struct|class|interface|extension)\s*(<[^{};]*?>)?\s*)([A-Za-z_]\w*)([^{};]*)\{"
)
_PARENS = r"\([^(){};]*\)"
for _ in range(5):  # (parentheses nested six deep: ``s = max(1.0, min(a, abs(b)))``)
    _PARENS = rf"\((?:[^(){{}};]|{_PARENS})*\)"
#: a function definition (lint_atomics.ANY_FUNCTION's, with parentheses nested in the
#: parameter list and ``operator+`` etc. as names, lanes43; ``func f(x: float) -> float``,
#: ``throws E`` and ``: SV_Target`` before the body, review43b)
_FUNCTION = re.compile(
    r"(?:^|[;}\]\s])(operator\s*(?:\(\s*\)|\[\s*\]|[^\w\s(){};\[\]]{1,3})|[A-Za-z_]\w*)\s*"
    rf"(<(?:[^<>(){{}};]|<[^<>(){{}};]*>)*>)?\s*\(((?:[^(){{}};]|{_PARENS})*)\)"
    r"\s*(?:(?:->|throws\b|:)[^(){};=]*?)?(?:where\b[^(){};]*)?\{"
)
#: a declaration without a body after ``__target_intrinsic(...)``: its name
_DECLARED = re.compile(r"\s*(?:\[[^\]]*\]\s*)*[^(){};]*?\b([A-Za-z_]\w*)\s*(?:<[^;{}()]*>\s*)?\(")
_ALIAS = re.compile(
    r"\b(?=type)(?:typealias\s+(\w+)[^=;{}]*=([^;{}]*);|typedef\b([^;{}]*)\b(\w+)\s*;)"
)
_PROPERTY = re.compile(r"\bproperty\s+(?:[^{};]*?\s)?([A-Za-z_]\w*)\s*[{:;]")
_WORD = re.compile(r"\b[A-Za-z_]\w*")
_SLANGPY = re.compile(r"^\s*(?:implementing|module)\s+slangpy\s*;", re.M)

#: kind ("cross-lane" / "side effect") and what and where, per function name
Effects = dict[str, tuple[str, str]]


def lane_effects(*texts: str) -> Effects:
    """The functions of ``texts`` (a module's preprocessed source and its imports) whose code
    is cross-lane or side-effecting, directly or through the functions they call."""
    fns: dict[str, tuple[str, str]] = {}  # name -> (attributes before it, bodies)
    shared: list[str] = []  # groupshared variable names
    types: dict[str, tuple[str, set[str], bool]] = {}  # name -> (bodies, conforms, generic)
    for text in texts:
        text_fns, text_shared, text_types = _parse(text)
        shared.extend(text_shared)
        for name, body, conforms, generic in text_types:
            old = types.get(name, ("", set(), False))
            types[name] = (old[0] + body, old[1] | set(conforms), old[2] or generic)
        for name, attrs, body in text_fns:
            old_attrs, old_body = fns.get(name, ("", ""))
            fns[name] = (old_attrs + attrs, old_body + body)
    found: Effects = {}
    for name, (_, body) in fns.items():
        if (m := _CROSS_LANE.search(body)) is not None:
            found[name] = ("cross-lane", f"'{m.group(1)}' in {name}()")
        elif (g := next((s for s in shared if re.search(rf"\b{s}\b", body)), None)) is not None:
            found[name] = ("cross-lane", f"groupshared '{g}' in {name}()")
        elif (m := _SIDE_EFFECT.search(body)) is not None:
            found[name] = ("side effect", f"'{m.group(1).rstrip('< ')}' in {name}()")
    # A property, subscript or __init (``p.s``, ``p[0]``, ``P(x)``: no call by name) reaches
    # a type's code: a function naming a type whose body qualifies qualifies (review42), or
    # an interface it implements (``T.get()``, ``T(x)``, ``t[0]`` in a generic), or reading a
    # property of it (``x.ws``: an extension's); a generic extension's (``extension<T> T``)
    # reaches any function (lanes43).
    members: dict[str, tuple[str, str]] = {}  # property name -> why
    everything = None
    for name, (body, _, _) in types.items():
        if name not in found and (m := _CROSS_LANE.search(body) or _SIDE_EFFECT.search(body)):
            kind = "cross-lane" if _CROSS_LANE.search(body) else "side effect"
            found[name] = (kind, f"'{m.group(1).rstrip('< ')}' in {name}")
    # a type holding one that qualifies (``p.q[0]``), an alias of it (``typealias V = S``)
    while found.keys() & types.keys() and (
        held := {
            t: found[w]
            for t, (body, _, _) in types.items()
            if t not in found
            for w in _WORD.findall(body)
            if w in found and w in types
        }
    ):
        found.update(held)
    for name, (body, conforms, generic) in types.items():
        if name in found:
            for word in conforms - found.keys():
                found[word] = found[name]
            members.update((p, found[name]) for p in _PROPERTY.findall(body))
            if generic and (everything is None or _worse(found[name], everything)):
                everything = found[name]
    calls = {name: {a or b for a, b in _CALL.findall(body)} for name, (_, body) in fns.items()}
    operators = _operators(fns, types)
    for name, (_, body) in fns.items():
        words = set(_WORD.findall(body))
        calls[name] |= words  # (a type, interface or function named: passed as a value)
        # a user-defined operator: called by a function using its symbol on its types, a
        # type holding them, or what a function it calls returns (lanes43)
        if operators:
            heads = (fns[c][0] for c in calls[name] if c in fns)
            words.update(w for head in heads for w in _WORD.findall(head))
            calls[name] |= {
                op
                for op, (symbol, reach) in operators.items()
                if symbol in body and (reach is None or reach & words)
            }
        why = next((w for p, w in members.items() if re.search(rf"\.\s*{p}\b", body)), None)
        for extra in (why, everything):
            if extra is not None and (name not in found or _worse(extra, found[name])):
                found[name] = extra
    changed = bool(found)
    while changed:
        changed = False
        for name, (attrs, _) in fns.items():
            for of, target in _DERIVATIVE.findall(attrs):
                a, b = (name, target) if of else (target, name)  # b's derivative is a
                if a in found and (b not in found or _worse(found[a], found[b])):
                    found[b] = found[a]
                    changed = True
            for callee in calls[name] & found.keys():
                why = found[callee]
                if callee != name and (name not in found or _worse(why, found[name])):
                    found[name] = why
                    changed = True
    return found


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> tuple[tuple[tuple[str, str, str], ...], tuple[str, ...], tuple]:
    """One file's functions (name, attributes before it, body), groupshared names and types
    (name, body, the interfaces it implements, whether a generic parameter is extended);
    none for SlangPy's own files (its gradient atomics run on both paths alike). Kept per
    text: the imported files' texts (pydiff's shaders: ~60 ms) are the same for every
    module."""
    src = blank_comments_and_strings(text)
    if _SLANGPY.search(src):
        return (), (), ()
    src = _with_asm_strings(text, src)
    shared = []
    for m in _GROUPSHARED.finditer(src):
        if (name := _NAME.search(m.group(1).strip())) is not None:
            shared.append(name.group(1))
    fns, prev = [], 0
    for m in _FUNCTION.finditer(src):
        name = re.sub(r"\s+", "", m.group(1))
        end = matching(src, m.end() - 1, "{", "}")
        if name in KEYWORDS or end < 0:
            continue
        head = max(src.rfind(";", prev, m.start()), src.rfind("}", prev, m.start()), prev)
        fns.append((name, src[head : m.start() + 1], src[m.start() : end]))  # (with its
        prev = end  # parameters: a type named there counts)
    # ``__target_intrinsic(glsl, "subgroupAdd($0)") float f(float x);``: no body
    for m in re.finditer(r"\b__target_intrinsic\s*\(", src) if "__target_i" in src else ():
        end = matching(src, m.end() - 1, "(", ")")
        if end >= 0 and (d := _DECLARED.match(src, end + 1)) is not None:
            fns.append((d.group(1), "", src[m.start() : d.end()]))
    types = []  # (``typealias V = S;``, ``typedef S V;``: V, naming S)
    aliases = re.finditer(_ALIAS, src) if "typealias" in src or "typedef" in src else ()
    for m in aliases:
        types.append((m.group(1) or m.group(4), f" {m.group(2) or m.group(3)} ", (), False))
    for m in _TYPE.finditer(src):
        if (end := matching(src, m.end() - 1, "{", "}")) >= 0:
            params = set(_WORD.findall((m.group(1) or "") + (m.group(2) or "")))
            tail = m.group(4)
            while (bare := re.sub(r"<[^<>]*>", " ", tail)) != tail:
                tail = bare
            tail = tail.partition(":")[2].partition("where")[0]
            conforms = tuple(set(_WORD.findall(tail)) - params - {m.group(3)})
            types.append((m.group(3), src[m.end() - 1 : end], conforms, m.group(3) in params))
    return tuple(fns), tuple(shared), tuple(types)


def _with_asm_strings(text: str, src: str) -> str:
    """``src`` (``text`` with comments and strings blanked) with the words of the strings
    that name cross-lane or side-effecting code back (``__intrinsic_asm "WaveActiveSum($0)"``,
    ``__target_intrinsic(glsl, "subgroupAdd($0)")``; lanes43), their punctuation blanked."""
    for m in re.finditer(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', text, flags=re.S):
        string = m.group(0)
        if string[0] == '"' and (_CROSS_LANE.search(string) or _SIDE_EFFECT.search(string)):
            words = re.sub(r"[^\w\n<]", " ", string)
            src = src[: m.start()] + words + src[m.end() :]
    return src


def _operators(fns: dict, types: dict) -> dict[str, tuple[str, set[str] | None]]:
    """User-defined operators (``operator+``): their symbol, and the types through which a
    function reaches them: the user types their text names and the types holding those;
    None (any use of the symbol) for one naming no user type (generic, on builtin types)."""
    out: dict[str, tuple[str, set[str] | None]] = {}
    for name, (attrs, body) in fns.items():
        if name.startswith("operator"):
            reach = set(_WORD.findall(attrs + body)) & types.keys()
            while grown := {
                t
                for t, (text, _, _) in types.items()
                if t not in reach and reach & set(_WORD.findall(text))
            }:
                reach |= grown
            out[name] = (name[8:].strip("()[]") or name[8], reach or None)
    return out


def _worse(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Whether ``a`` rules out more kernels than ``b`` (cross-lane: every generated one)."""
    return a[0] == "cross-lane" and b[0] != "cross-lane"
