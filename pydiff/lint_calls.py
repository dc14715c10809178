"""Calls from differentiable code to helpers that are not differentiable but write a
differentiable value (issue 15, class 10): a function without ``[Differentiable]`` that writes
through an ``out``/``inout`` float parameter (``void step(inout float t, float a)``), or a
``[mutating]`` method of an ``IDifferentiable`` struct without ``[Differentiable]``. Slang
compiles the call and its backward treats the written value as a constant: the derivative
through it is lost (measured on SlangPy 0.43.1: ``da`` = 1.0 or 0.0 where 2.5 is right, no
error). The same helper *returning* the value is a compile error, so only these get through.

    helpers = non_differentiable_writers(text)                 # name -> Writer
    findings = scan_source(text, "m.slang", helpers)           # lint.Finding per call
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .lint import Finding
from .lint_flow import call_at, matching
from .lint_index import split_top

KIND = "non-differentiable-helper"
_DIFF = re.compile(
    r"\[\s*(Differentiable|BackwardDifferentiable|BackwardDerivative|ForwardDerivative|"
    r"TreatAsDifferentiable)\b"
)
_DERIVATIVE_OF = re.compile(r"\[\s*(BackwardDerivativeOf|ForwardDerivativeOf)\b")
_DEF = re.compile(r"([A-Za-z_]\w*)\s*(<(?:[^<>(){};]|<[^<>(){};]*>)*>)?\s*\(")
_BRACE = re.compile(r"\s*(?:where\b[^{};()]*)?\{")  # (a generic's where clause)
_STRUCT = re.compile(r"\bstruct\s+([A-Za-z_]\w*)([^{;]*)\{")
# an extension's methods are methods of the extended type ('extension float { ... }')
_EXTENSION = re.compile(r"\bextension\s+([A-Za-z_]\w*(?:\s*<[^{;]*>)?)([^{;]*)\{")
_NAMESPACE = re.compile(r"\bnamespace\s+([A-Za-z_]\w*)")
_KEYWORDS = {"if", "for", "while", "switch", "return", "do", "else", "no_diff", "sizeof"}
_FLOATY = re.compile(
    r"^(?:float|half|double)(?:[1-4](?:x[1-4])?)?$|^(?:vector|matrix)\s*<\s*(?:float|half|double)"
)


@dataclass(frozen=True)
class Writer:
    """A non-differentiable function or method that writes a differentiable value."""

    name: str
    struct: str  # "" for a free function
    written: str  # the out/inout parameter, or "this" for a [mutating] method
    arity: tuple[int, int]  # (required, all) parameters


@dataclass(frozen=True)
class _Def:
    name: str
    struct: str
    attrs: str
    params: tuple[str, ...]
    generics: str  # the generic parameters `<T : IFloat>`, then any `where T : IFloat`
    body: str
    body_at: int
    name_at: int


@functools.lru_cache(maxsize=64)
def _definitions(src: str) -> tuple[_Def, ...]:
    structs = []
    for m in (*_STRUCT.finditer(src), *_EXTENSION.finditer(src)):
        end = matching(src, m.end() - 1, "{", "}")
        structs.append((m.end(), end if end > 0 else len(src), _type_name(m.group(1))))
    out = []
    for m in _DEF.finditer(src):
        if m.group(1) in _KEYWORDS or src[: m.start()].rstrip().endswith("."):
            continue
        close = matching(src, m.end() - 1, "(", ")")
        opening = _BRACE.match(src, close + 1) if close > 0 else None
        if opening is None:
            continue
        brace = opening.end() - 1
        end = matching(src, brace, "{", "}")
        head = max(src.rfind(c, 0, m.start()) for c in ";{}")
        attrs = src[head + 1 : m.start()]
        if end < 0 or re.search(r"[=(]", attrs):
            continue  # a call or an initialiser, not a definition
        struct = next((n for s, e, n in structs if s <= m.start() < e), "")
        params = tuple(p.strip() for p in split_top(src[m.end() : close]) if p.strip())
        out.append(
            _Def(
                m.group(1),
                struct,
                attrs,
                params,
                (m.group(2) or "") + src[close + 1 : brace],  # (and a `where` clause's)
                src[brace:end],
                brace,
                m.start(),
            )
        )
    return tuple(out)


def _type_name(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _differentiable_structs(src: str) -> set[str]:
    out = {m.group(1) for m in _STRUCT.finditer(src) if "IDifferentiable" in m.group(2)}
    for m in _EXTENSION.finditer(src):  # extension float { [mutating] ... }: writes a float
        name = _type_name(m.group(1))
        if _FLOATY.match(name) or name in out or "IDifferentiable" in m.group(2):
            out.add(name)
    return out


def _type_of(param: str) -> tuple[str, str]:
    """(direction, type) of a parameter declaration."""
    words = param.split("=")[0].split()
    direction = next((w for w in words if w in ("out", "inout", "in")), "in")
    kept = [w for w in words[:-1] if w not in ("out", "inout", "in", "const", "no_diff")]
    return direction, " ".join(kept)


@functools.lru_cache(maxsize=64)
def non_differentiable_writers(text: str) -> dict[str, list[Writer]]:
    """Helpers in ``text`` (preprocessed, comments blanked) that write a differentiable value
    without being differentiable: name -> its definitions."""
    diff_structs = _differentiable_structs(text)
    out: dict[str, list[Writer]] = {}
    for d in _definitions(text):
        if _DIFF.search(d.attrs) or _DERIVATIVE_OF.search(d.attrs) or "no_diff" in d.attrs:
            continue
        generics = set(re.findall(r"([A-Za-z_]\w*)\s*:", d.generics))
        written = ""
        for p in d.params:
            direction, typ = _type_of(p)
            if direction == "in" or "no_diff" in p.split():
                continue
            if _FLOATY.match(typ) or typ in generics or typ in diff_structs:
                written = p.split("=")[0].split()[-1]
                break
        if not written and d.struct in diff_structs and re.search(r"\[\s*mutating\s*\]", d.attrs):
            written = "this"
        if written:
            required = sum("=" not in p for p in d.params)
            w = Writer(d.name, d.struct, written, (required, len(d.params)))
            out.setdefault(d.name, []).append(w)
    return out


def _differentiable_overload(defs: tuple[_Def, ...], name: str, struct: str, n: int) -> bool:
    return any(
        d.name == name and d.struct == struct and _DIFF.search(d.attrs) and len(d.params) == n
        for d in defs
    )


def _receiver_type(recv: str, caller: _Def) -> str | None:
    if recv == "this":
        return caller.struct
    text = ", ".join(caller.params) + ";" + caller.body
    m = re.search(rf"\b([A-Za-z_]\w*)\s+{re.escape(recv)}\s*[;,=)\[]", text)
    return m.group(1) if m else None


def scan_source(text: str, file: str, writers: dict[str, list[Writer]]) -> list[Finding]:
    """Calls, from differentiable functions in ``text``, of the ``writers`` (from every file
    the module compiles): each loses the derivative through the value it writes."""
    names = [n for n in writers if n in text]
    if not names or not re.search(r"\b(" + "|".join(map(re.escape, names)) + r")\b", text):
        return []
    return list(_scan(text, file, tuple((n, tuple(writers[n])) for n in sorted(names))))


@functools.lru_cache(maxsize=64)
def _scan(text: str, file: str, writers: tuple[tuple[str, tuple[Writer, ...]], ...]) -> tuple:
    defs = _definitions(text)
    namespaces = frozenset(_NAMESPACE.findall(text))
    findings = []
    for caller in (d for d in defs if _DIFF.search(d.attrs)):
        for name, ws in writers:
            at = call_at(caller.body, name)
            while at >= 0:
                hit = _match(caller, defs, name, ws, at, namespaces)
                if hit:
                    line = text.count("\n", 0, caller.body_at + at) + 1
                    findings.append(Finding(file, line, caller.name, KIND, _message(hit)))
                    break
                at = call_at(caller.body, name, at + len(name))
    return tuple(findings)


def _match(
    caller: _Def,
    defs: tuple[_Def, ...],
    name: str,
    ws: list[Writer],
    at: int,
    namespaces: frozenset[str] = frozenset(),
) -> Writer | None:
    body = caller.body
    paren = body.find("(", at + len(name))
    close = matching(body, paren, "(", ")")
    n = len([a for a in split_top(body[paren + 1 : close]) if a.strip()]) if close > 0 else -1
    if re.search(r"\bno_diff\s*\(?\s*$", body[:at]):
        return None  # the author asked for no derivative
    recv = re.search(r"([A-Za-z_]\w*)\s*(?:\.|::)\s*$", body[:at])
    if recv and recv.group(1) in namespaces:  # nn.stp(...), nn::stp(...): a free function
        cands = [w for w in ws if not w.struct]
    elif not body[:at].rstrip().endswith("."):  # free, or a method of the caller's struct
        cands = [w for w in ws if not w.struct or w.struct == caller.struct]
    else:
        struct = _receiver_type(recv.group(1), caller) if recv else None
        if struct is None and any(
            d.name == name and d.struct and _DIFF.search(d.attrs) for d in defs
        ):
            return None  # a receiver of unknown type, and a differentiable method of that name
        cands = [w for w in ws if w.struct and struct in (None, w.struct)]
    for w in cands:
        if w.arity[0] <= n <= w.arity[1] and not _differentiable_overload(defs, name, w.struct, n):
            return w
    return None


def _message(w: Writer) -> str:
    what = (
        f"the [mutating] method {w.struct}.{w.name}(), which changes the IDifferentiable "
        f"struct {w.struct}"
        if w.written == "this"
        else f"{w.struct + '.' if w.struct else ''}{w.name}(), which writes a differentiable "
        f"value through its out/inout parameter '{w.written}'"
    )
    mutating = "[mutating] " if w.written == "this" else ""
    return (
        f"calls {what}, but is not [Differentiable]: Slang's backward treats what it writes "
        "as a constant, so the derivative through it is lost (wrong gradients, no error, "
        f"SlangPy 0.43); mark the helper [Differentiable] ('[Differentiable] {mutating}"
        f"void {w.name}(...)')"
    )
