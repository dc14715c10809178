"""The scan for math intrinsics called on ``double`` values (which some drivers get wrong).

SPIR-V's GLSL.std.450 defines sin, exp, log, pow, ... for 16- and 32-bit floats only; Slang
emits them on doubles all the same, and Mesa's lavapipe returns 0, 1 or denormal garbage for
them (sqrt, fma, floor, ... are right). Which intrinsics a device gets wrong is measured once
per device (``pydiff.double_math``); this scan finds where a function calls one of them on a
double: an argument naming a ``double`` parameter, local or global, a ``double(...)`` cast, a
double literal (``1.0l``) or a call of a module function declared to return a double, outside
``float(...)``/``int(...)`` conversions and calls of functions returning float. A generic
function calling one on a value of its generic type (``T tsin<T>(T x) { return sin(x); }``)
counts as calling it wherever it is called with a double there (``tsin(d)``: T inferred).
``let``/``var`` locals take their initialiser's type; in a function that uses doubles, a value
whose type the scan cannot infer (a generic's or an imported function's result) counts as a
double: a false refusal says so, a wrong value would not. Callers inherit it.

    calls = double_calls(source)     # {function: [(line, "sin", function calling it), ...]}
"""

from __future__ import annotations

import re
from typing import Any

from .lint_index import split_top
from .lint_double_text import closing as _closing
from .lint_double_text import mentions as _mentions
from .lint_double_text import narrowed as _narrowed
from .lint_double_text import plain_generics
from .lint_macros import Defines, blank_comments_and_strings, preprocess

#: The intrinsics measured per device (one and two arguments; ``sincos`` writes two outs).
UNARY = (
    "sin cos tan asin acos atan exp exp2 exp10 log log2 log10 sinh cosh tanh asinh acosh atanh "
    "sqrt rsqrt sinpi cospi"
).split()
BINARY = ("atan2", "pow", "powr", "fmod", "ldexp")
OUT_PARAMS = ("sincos",)

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


def _functions(text: str) -> list[tuple[str, str, int, int, int]]:
    """(name, parameter text, body start, body end, name start) of each function definition."""
    found = []
    for m in _FUNCTION.finditer(text):
        if m.group(1) in _KEYWORDS:
            continue
        brace = m.end() - 1
        found.append((m.group(1), m.group(2), brace, _closing(text, brace), m.start(1)))
    return found


def _double_names(text: str) -> set[str]:
    names = set()
    for m in _DOUBLE_DECL.finditer(text):
        names.add(m.group(1))
        names.update(re.findall(r",\s*([A-Za-z_]\w*)", m.group(2) or ""))
    return names


_TYPE = r"[A-Za-z_]\w*(?:\s*<(?:[^<>;{}()]|<[^<>;{}()]*>)*>)?"
_MODIFIERS = r"(?:(?:in|out|inout|const|static|no_diff|uniform|groupshared|precise)\s+)*"
#: ``TYPE name`` declarations (parameters, locals, globals, fields), more declarators after.
_DECL = re.compile(
    r"(?:^|[(,;{}])\s*" + _MODIFIERS + r"(" + _TYPE + r")\s+([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)?"
    r"((?:(?:=[^,;)]*)?,\s*[A-Za-z_]\w*)*)\s*(?=[=,;)\[:])"
)
#: ``let y = ...`` / ``var y : T = ...``: the type comes from the annotation or the initialiser.
_LET = re.compile(r"\b(?:let|var)\s+([A-Za-z_]\w*)\s*(?::\s*(" + _TYPE + r"))?\s*=([^;]*)")
_DOUBLE_TYPE = re.compile(r"\b(?:double[234]?(?:x[234])?|float64_t)\b")
_OTHER_TYPE = re.compile(
    r"\b(?:(?:float|half|int|uint|bool)[234]?(?:x[234])?|u?int(?:8|16|32|64)_t|float(?:16|32)_t|"
    r"void)\b"
)
_NOT_TYPES = _KEYWORDS | {"let", "var", "case", "goto", "typedef", "typealias", "import"}
_IGNORED = {"true", "false", "vector", "matrix", "sizeof", "no_diff", "detach"}
#: Intrinsics whose result has their arguments' type (the arguments are looked at).
_PASSTHROUGH = set(
    "abs min max clamp lerp saturate floor ceil round trunc frac fma mad sign dot length "
    "distance normalize cross select step smoothstep reflect refract mul transpose "
    "determinant copysign rcp degrees radians".split()
)
_RETURN_TYPE = re.compile(r"(" + _TYPE + r")\s*$")
_MEASURED = {*UNARY, *BINARY, *OUT_PARAMS}
#: ``typedef T name;`` and ``typealias name = T;`` (not generic ones)
_ALIAS = re.compile(
    r"\btypedef\s+(" + _TYPE + r")\s+([A-Za-z_]\w*)\s*;|"
    r"\btypealias\s+([A-Za-z_]\w*)\s*=\s*(" + _TYPE + r")\s*;"
)


def _type_kind(type_text: str) -> str:
    """'double', 'other' (a float/int/bool type or a container of one) or 'unknown'."""
    if _DOUBLE_TYPE.search(type_text) or re.search(r"\bvector\s*<\s*double|\bmatrix\s*<\s*double",
                                                   type_text):  # fmt: skip
        return "double"
    return "other" if _OTHER_TYPE.search(type_text) else "unknown"


def _declared(text: str) -> dict[str, str]:
    """name -> kind of each name declared with an explicit type in ``text``."""
    kinds: dict[str, str] = {}
    for m in _DECL.finditer(text):
        if m.group(1) in _NOT_TYPES or m.group(2) in _NOT_TYPES:
            continue
        kind = _type_kind(m.group(1))
        for name in (m.group(2), *re.findall(r",\s*([A-Za-z_]\w*)", m.group(3) or "")):
            kinds[name] = "double" if "double" in (kind, kinds.get(name)) else kind
    for name in _double_names(text):  # the declarator forms the generic pattern misses
        kinds[name] = "double"
    return kinds


def _return_kinds(text: str, functions: list) -> dict[str, str]:
    """Function name -> kind of its declared return type ('double' if any overload is)."""
    kinds: dict[str, str] = {}
    for name, _, start, _end, name_at in functions:
        if name in _MEASURED or name in _PASSTHROUGH:
            continue  # a method of the user's named like an intrinsic: calls of it are qualified
        m = _RETURN_TYPE.search(text[max(0, name_at - 200) : name_at])
        kind = _type_kind(m.group(1)) if m and m.group(1) not in _NOT_TYPES else "unknown"
        old = kinds.get(name)
        kinds[name] = kind if old in (None, kind) else ("double" if "double" in (old, kind)
                                                        else "unknown")  # fmt: skip
    return kinds


class _Scope:
    """What the scan knows of one function's names and the module's functions."""

    def __init__(self, names: dict[str, str], returns: dict[str, str]) -> None:
        self.names = names
        self.returns = returns
        self.intrinsics = set(UNARY) | set(BINARY) | set(OUT_PARAMS) | _PASSTHROUGH
        self.uses_double = False
        self.guessed: set[str] = set()  # let/var locals counted as double for want of a type
        self.fields: dict[str, str] = {}  # struct fields (globals' kinds), not swizzles

    def kind(self, expr: str) -> str:
        """'double' if ``expr`` may hold a double, 'other' if it cannot, 'unknown'."""
        expr = self._without_narrowing(_narrowed(expr))
        if _DOUBLE_LITERAL.search(expr):
            return "double"
        unknown = False
        for m in re.finditer(r"(\.\s*)?\b([A-Za-z_]\w*)\s*(\(|<[^<>;]*>\s*\()?", expr):
            word, call = m.group(2), m.group(3)
            if m.group(1) and (self.returns if call else self.fields).get(word) == "double":
                return "double"  # a method of the module's declared to return a double,
                # or a struct's double field (p.v): whatever the object's type
            if m.group(1) or word in _IGNORED or word in _KEYWORDS:
                continue  # another member (its object is seen) or a keyword
            if _type_kind(word) != "unknown":  # a type: a conversion or a template argument
                if _type_kind(word) == "double":
                    return "double"
                continue
            if call:
                kind = self.returns.get(word)
                if kind == "double":
                    return "double"
                if kind == "unknown" or (kind is None and word not in self.intrinsics):
                    unknown = True  # a function of another module, a method: its type unseen
                continue
            kind = self.names.get(word, "unknown")
            if kind == "double":
                return "double"
            unknown = unknown or kind == "unknown"
        return "unknown" if unknown else "other"

    def _without_narrowing(self, expr: str) -> str:
        """``expr`` with calls whose result is surely not a double cut out: float/int/...
        conversions and functions of the module declared to return such a type."""
        pos = 0
        while (m := re.compile(r"\b([A-Za-z_]\w*)\s*\(").search(expr, pos)) is not None:
            word = m.group(1)
            narrowing = _NARROWING.match(m.group(0)) or re.match(r"(?:u?int|bool)[234]?$", word)
            if narrowing or self.returns.get(word) == "other":
                end = _closing(expr, m.end() - 1)
                expr = expr[: m.start()] + " 0 " + expr[end + 1 :]
                pos = m.start() + 3
            else:
                pos = m.end()
        return expr


def _globals(text: str, functions: list) -> dict[str, str]:
    """Kinds of the names declared outside function definitions (globals, struct fields);
    macros are expanded before (``#define`` lines are blank)."""
    outside = list(text)
    for _, _, _, end, name_at in functions:
        outside[name_at : end + 1] = " " * (end + 1 - name_at)
    return _declared("".join(outside))


def _scope(text: str, params: str, body: str, base: dict[str, str], returns: dict) -> _Scope:
    """The function's names with their kinds; ``let``/``var`` locals get their initialiser's
    kind, through chains of them. In a function that uses doubles, a local whose type the
    scan cannot infer counts as a double: a false refusal says so, a wrong value would not."""
    scope = _Scope({**base, **_declared(params + ";" + body)}, returns)
    scope.fields = {k: v for k, v in base.items() if not re.fullmatch("[xyzw]{1,4}|[rgba]{1,4}", k)}
    uses_double = scope.kind(params + ";" + body) == "double"
    lets = list(_LET.finditer(body))
    for _ in range(len(lets) + 1):  # each round settles at least one more link of a chain
        changed = False
        for m in lets:
            kind = _type_kind(m.group(2)) if m.group(2) else scope.kind(m.group(3))
            if kind == "unknown" and uses_double:
                kind = "double"
                scope.guessed.add(m.group(1))
            uses_double = uses_double or kind == "double"
            if scope.names.get(m.group(1)) != kind:
                scope.names[m.group(1)] = kind
                changed = True
        if not changed:
            break
    scope.uses_double = uses_double
    return scope


def _guess(scope: _Scope, arg: str) -> bool:
    """Whether ``arg`` is a double only through locals whose type was guessed."""
    if not scope.guessed:
        return False
    known = scope.names
    scope.names = {k: ("unknown" if k in scope.guessed else v) for k, v in known.items()}
    try:
        return scope.kind(arg) != "double"
    finally:
        scope.names = known


def _without_aliases(text: str) -> str:
    """``text`` with each alias of a float, int or double type replaced by that type (through
    chains of aliases) and the alias declarations blanked; lines stay on their lines."""
    for _ in range(16):  # an alias of an alias is settled in the next round
        aliases = {}
        for m in _ALIAS.finditer(text):
            target, name = (m.group(1), m.group(2)) if m.group(2) else (m.group(4), m.group(3))
            if _type_kind(target) != "unknown" and name not in _NOT_TYPES:
                aliases[name] = target
        if not aliases:
            return text
        text = _ALIAS.sub(lambda m: " " * len(m[0]) if (m[2] or m[3]) in aliases else m[0], text)
        used = re.compile(r"(?<![.\w])\b(" + "|".join(map(re.escape, aliases)) + r")\b")
        text = used.sub(lambda m: aliases[m.group(1)], text)
    return text


def double_calls(
    source: str, guessed: set[tuple[str, int]] | None = None, defines: Defines | None = None
) -> dict[str, list[tuple[int, str, str]]]:
    """Per function: (line, intrinsic, function calling it) of each intrinsic it calls with a
    double argument, or reaches through the functions it calls. ``guessed`` gets the
    (function, line) of calls counted as double only because a type could not be inferred;
    ``defines``: the macros the device defines (``#if`` branches follow them)."""
    text = blank_comments_and_strings(preprocess(source, defines).text)
    text = plain_generics(_without_aliases(text))
    functions = _functions(text)
    returns = _return_kinds(text, functions)
    base = _globals(text, functions)
    intrinsic = re.compile(r"\b(" + "|".join(sorted(_MEASURED)) + r")\s*\(")
    own: dict[str, list[tuple[int, str, str]]] = {}
    for name, params, start, end, _ in functions:
        body = text[start:end]
        scope = _scope(text, params, body, base, returns)
        for m in intrinsic.finditer(body):
            if re.search(r"(?:\.|::)\s*$", body[max(0, m.start() - 40) : m.start()]):
                continue  # a member of the user's (S.exp(x), obj.exp(x), S::exp(x))
            close = _closing(body, m.end() - 1)
            arg = body[m.end() : close]
            kind = scope.kind(arg)
            if kind == "double" or (kind == "unknown" and scope.uses_double):
                line = text.count("\n", 0, start + m.start()) + 1
                if guessed is not None and (kind == "unknown" or _guess(scope, arg)):
                    guessed.add((name, line))
                own.setdefault(name, []).append((line, m.group(1), name))
    _inferred_generic_calls(text, functions, own, base, returns, guessed)
    _generic_struct_calls(text, functions, own)
    result = {name: list(calls) for name, calls in own.items()}
    called = [
        (name, set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", text[start:end])) - {name})
        for name, _, start, end, _ in functions
    ]
    changed = True
    while changed:  # callers inherit (matched by name, as the trap scan does)
        changed = False
        for name, callees in called:
            for callee in callees & result.keys():
                calls = result[callee]
                for call in calls:
                    if call not in result.setdefault(name, []):
                        result[name].append(call)
                        changed = True
    return result


_GENERIC_HEAD = re.compile(r"[A-Za-z_]\w*\s*<((?:[^<>(){};]|<[^<>(){};]*>)*)>\s*\(")


def _generic_intrinsics(text: str, functions: list) -> dict[str, tuple[set, list]]:
    """Per generic function of ``text``: the positions of its parameters of a generic type,
    and (line, intrinsic, function) of each measured intrinsic it calls on a value of such a
    type, directly or through another generic called with one (T inferred there too)."""
    intrinsic = re.compile(r"\b(" + "|".join(sorted(_MEASURED)) + r")\s*\(")
    found: dict[str, tuple[set, list]] = {}
    bodies: dict[str, tuple[str, int, set]] = {}
    for name, params, start, end, name_at in functions:
        head = _GENERIC_HEAD.match(text, name_at)
        if head is None or head.end() > start:
            continue
        types = {
            m.group(1)
            for p in split_top(head.group(1))
            if (m := re.match(r"\s*([A-Za-z_]\w*)", p)) and m.group(1) != "let"
        }
        if not types:
            continue
        typed = re.compile(r"\b(?:" + "|".join(map(re.escape, types)) + r")\b")
        positions, names = set(), set()
        for i, p in enumerate(split_top(params)):
            decl = re.match(r"\s*(.*?)\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?\s*(?:=.*)?$", p, re.S)
            if decl and typed.search(decl.group(1)):
                positions.add(i)
                names.add(decl.group(2))
        body = text[start:end]
        for m in _DECL.finditer(body):
            if typed.search(m.group(1)):
                names.add(m.group(2))
        for _ in range(8):  # let/var locals set from generic values, through chains
            more = {m.group(1) for m in _LET.finditer(body) if _mentions(m.group(3), names, typed)}
            if more <= names:
                break
            names |= more
        calls = []
        for m in intrinsic.finditer(body):
            if re.search(r"(?:\.|::)\s*$", body[max(0, m.start() - 40) : m.start()]):
                continue
            if _mentions(body[m.end() : _closing(body, m.end() - 1)], names, typed):
                calls.append((text.count("\n", 0, start + m.start()) + 1, m.group(1), name))
        found[name] = (positions, calls)
        bodies[name] = (body, start, names, typed)
    for _ in range(len(found)):  # a generic passing its generic values to another inherits
        changed = False
        for name, (body, _, names, typed) in bodies.items():
            for callee, arg in _generic_call_args(body, found):
                if callee != name and _mentions(arg, names, typed):
                    for call in found[callee][1]:
                        if call not in found[name][1]:
                            found[name][1].append(call)
                            changed = True
        if not changed:
            break
    return {name: v for name, v in found.items() if v[1]}


def _generic_call_args(body: str, generics: dict) -> list[tuple[str, str]]:
    """(generic, argument) of each argument at a generic position of each call in ``body`` of
    a function of ``generics`` without explicit generic arguments (T inferred)."""
    if not generics:
        return []
    names = "|".join(map(re.escape, generics))
    # (qualified: ns::f(d), S::f(d), S.f(d) or s.f(d), a struct's generic method)
    call = re.compile(r"(?<!\w)(?:\w+\s*(?:::|\.)\s*)*\b(" + names + r")\s*\(")
    out = []
    for m in call.finditer(body):
        args = split_top(body[m.end() : _closing(body, m.end() - 1)])
        positions = generics[m.group(1)][0]
        out += [(m.group(1), a) for i, a in enumerate(args) if i in positions]
    return out


def _inferred_generic_calls(
    text: str, functions: list, own: dict, base: dict, returns: dict, guessed: Any
) -> None:
    """Add to ``own`` the intrinsic calls of generics (``_generic_intrinsics``) each function
    reaches by calling one with a double where its generic type is inferred."""
    generics = _generic_intrinsics(text, functions)
    if not generics:
        return
    names = "|".join(map(re.escape, generics))
    explicit = re.compile(r"(?<!\w)(" + names + r")\s*<((?:[^<>(){};]|<[^<>(){};]*>)*)>\s*\(")
    for name, params, start, end, _ in functions:
        body = text[start:end]
        for m in explicit.finditer(body):  # f<double>(x): its callers inherit too
            if _type_kind(m.group(2)) == "double":
                own.setdefault(name, []).extend(
                    c for c in generics[m.group(1)][1] if c not in own[name]
                )
        pairs = _generic_call_args(body, generics)
        if not pairs:
            continue
        scope = _scope(text, params, body, base, returns)
        for callee, arg in pairs:
            kind = scope.kind(arg)
            if kind != "double" and not (kind == "unknown" and scope.uses_double):
                continue
            for line, intrinsic, origin in generics[callee][1]:
                if guessed is not None and (kind == "unknown" or _guess(scope, arg)):
                    guessed.add((origin, line))
                if (line, intrinsic, origin) not in own.setdefault(name, []):
                    own[name].append((line, intrinsic, origin))


_GENERIC_STRUCT = re.compile(
    r"\bstruct\s+([A-Za-z_]\w*)\s*<((?:[^<>(){};]|<[^<>(){};]*>)*)>[^{;]*\{"
)


def _generic_struct_calls(text: str, functions: list, own: dict) -> None:
    """Add to ``own`` the measured intrinsics the methods of a generic struct call on values of
    its generic types (fields, parameters, locals), for each function naming the struct with
    a double argument (``S<double> s; s.run()``: S<double>'s methods compute on doubles)."""
    intrinsic = re.compile(r"\b(" + "|".join(sorted(_MEASURED)) + r")\s*\(")
    for m in _GENERIC_STRUCT.finditer(text):
        params = [re.match(r"\s*([A-Za-z_]\w*)", p) for p in split_top(m.group(2))]
        types = {p.group(1) for p in params if p and p.group(1) != "let"}
        if not types:
            continue
        typed = re.compile(r"\b(?:" + "|".join(map(re.escape, types)) + r")\b")
        at, end = m.end() - 1, _closing(text, m.end() - 1)
        body = text[at:end]
        names = {d.group(2) for d in _DECL.finditer(body) if typed.search(d.group(1))}
        names |= {v.group(1) for v in _LET.finditer(body) if _mentions(v.group(3), names, typed)}
        calls = []
        for c in intrinsic.finditer(body):
            if re.search(r"(?:\.|::)\s*$", body[max(0, c.start() - 40) : c.start()]):
                continue
            if _mentions(body[c.end() : _closing(body, c.end() - 1)], names, typed):
                pos = at + c.start()
                inner = [f for f in functions if f[4] <= pos <= f[3]]
                origin = inner[-1][0] if inner else m.group(1)
                calls.append((text.count("\n", 0, pos) + 1, c.group(1), origin))
        use = re.compile(rf"\b{m.group(1)}\s*<[^;{{}}()]*?" + _DOUBLE_TYPE.pattern)
        for name, _, _, fend, name_at in functions if calls else ():
            if not at <= name_at <= end and use.search(text, name_at, fend):
                own.setdefault(name, []).extend(c for c in calls if c not in own[name])
