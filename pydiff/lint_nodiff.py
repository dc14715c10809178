"""Tensor parameters marked ``no_diff`` in a module's source (and the files it imports).

Reflection cannot tell them apart: SlangPy 0.43 reports ``no_diff`` for every parameter whose
type is not differentiable (an ``int``, any ``IDiffTensor`` or ``DiffTensor``). Yet their
loads still add gradients into whatever gradient buffer the backward binds, so ``.bwds`` must
bind a throwaway one there (docs/tape.md: a tensor at a ``no_diff`` parameter gets no
gradient). The scan records every parameter written ``no_diff``, whatever its type is spelled
as (a ``typealias`` too): the caller keeps those whose reflected type is a diff tensor.
Functions are named as pydiff names them, inside their namespaces and structs (``A::f``).

    no_diff_tensors("void f(int i, no_diff IDiffTensor<float, 1> x, ...) {...}")  # {'f': {'x'}}
    no_diff_fields("struct S { no_diff DiffTensor<float, 1> t; };")             # {'S': {'t'}}
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# What stands before a function's parameter list: its name and generic parameters.
# (generic parameters may nest one level: ``f<T : IArray<float>>``)
_NAME_BEFORE = re.compile(r"\b([A-Za-z_]\w*)\s*(?:<(?:[^<>(){};]|<[^<>(){};]*>)*>\s*)?$")
# what may follow the parameter list: a result type (``-> float``), a generic's ``where``
_RETURN_TYPE = re.compile(r"\)\s*(?:->|\bwhere\b)[^(){};]*$")
# A scope that names the functions inside it: ``namespace A.B {``, ``struct S<T> : I {``.
_SCOPE = re.compile(r"\b(namespace|struct|class|extension|interface)\s+([A-Za-z_][\w.:]*)")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_NAME = re.compile(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*(?::\s*\w+\s*)?(?:=.*)?$", re.S)


def generic_base(name: str) -> str:
    """The name a function is written under in its source, from the name of a call SlangPy
    takes: a generic's specialisation (``f<2>``, ``A::f<float>``) or a method of a generic
    struct's (``S<2>::f``, ``S<2>.f``) has the source's ``f``, ``A::f``, ``S::f``: what the
    per-function scans (traps, no_diff parameters, loops, hand-written derivatives, atomics)
    are keyed by.

    >>> generic_base("A::f<vector<float, 3>>"), generic_base("S<2>.f"), generic_base("f")
    ('A::f', 'S::f', 'f')
    """
    while True:
        bare = re.sub(r"<[^<>]*>", "", name)
        if bare == name:
            return re.sub(r"\s*(?:::|\.)\s*", "::", bare).strip()
        name = bare


def own_name(name: str) -> str:
    """A function's own name, without generic arguments, namespaces or struct (``A::f<2>``,
    ``S<2>.f``: ``f``): the key of the scans that merge same-named functions.

    >>> own_name("A::f<vector<float, 3>>")
    'f'
    """
    return generic_base(name).rsplit("::", 1)[-1]


def _header(head: str) -> tuple[str, str] | None:
    """The name and parameter list of a function definition whose body opens after
    ``head``, or None (parameters may hold parentheses: ``float c = float(1)``)."""
    head = head.rstrip()
    if (arrow := _RETURN_TYPE.search(head)) is not None:
        head = head[: arrow.start() + 1]
    if not head.endswith(")"):
        return None
    depth = 0
    for i in range(len(head) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(head[i], 0)
        if depth == 0:
            name = _NAME_BEFORE.search(head[:i])
            return (name.group(1), head[i + 1 : -1]) if name is not None else None
    return None


def _split_params(params: str) -> list[str]:
    """Split a parameter list at the commas outside ``<...>`` and ``(...)``."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(params):
        if c in "<(":
            depth += 1
        elif c in ">)":
            depth = max(depth - 1, 0)
        elif c == "," and depth == 0:
            out.append(params[start:i])
            start = i + 1
    out.append(params[start:])
    return out


def _marked(params: str) -> set[str]:
    return {name for name, marked in _named(params) if marked}


def _named(params: str) -> list[tuple[str, bool]]:
    """Each parameter's name (where one is read) and whether it is written ``no_diff``."""
    named = []
    for param in _split_params(params):
        if (m := _NAME.search(param.strip())) is not None:
            named.append((m.group(1), "no_diff" in param.split()))
    return named


def _scan(text: str, found: dict, fields: dict, defs: dict | None = None) -> None:
    text = _COMMENTS.sub(lambda c: re.sub(r"[^\n]", " ", c.group()), text)  # (lines kept)
    # a (name, kind) per open brace: a namespace's or a struct's, else None
    scopes: list[tuple[str, str] | None] = []
    in_body = 0  # braces open inside a function's body
    start = 0  # where the text before the next brace begins
    for brace in re.finditer(r"[{};]", text):
        c = brace.group()
        head = text[start : brace.start()]
        start = brace.end()
        if c == ";":
            inner = scopes[-1] if scopes else None
            field = _NAME.search(head.strip()) if "no_diff" in head.split() else None
            if not in_body and inner and inner[1] != "namespace" and "(" not in head and field:
                fields.setdefault(_qualified(scopes, None), set()).add(field.group(1))
            continue
        if c == "}":
            if in_body:
                in_body -= 1
            elif scopes:
                scopes.pop()
            continue
        if in_body:
            in_body += 1
            continue
        header = _header(head)
        scope = _SCOPE.search(head)
        if header is not None and scope is None:
            names = _marked(header[1])
            if names:
                found.setdefault(_qualified(scopes, header[0]), set()).update(names)
            if defs is not None:  # every definition, its parameters' names and markings
                named = _named(header[1])
                named_at = re.search(rf"\b{header[0]}\s*[<(]", head)  # (its name's line)
                at = brace.start() - len(head) + (named_at.start() if named_at else 0)
                line = text.count("\n", 0, at) + 1
                entry = (tuple(n for n, _ in named), frozenset(n for n, m in named if m), line)
                defs.setdefault(_qualified(scopes, header[0]), []).append(entry)
            in_body = 1
            continue
        named = (scope.group(2).replace(".", "::"), scope.group(1)) if scope else None
        scopes.append(named)


def _qualified(scopes: list, name: str | None) -> str:
    return "::".join([s[0] for s in scopes if s] + ([name] if name else []))


def no_diff_tensors(source: str, imported: Iterable[str] = ()) -> dict[str, set[str]]:
    """Per function (its name with its namespaces and structs: ``A::f``), the names of its
    parameters marked ``no_diff``, in ``source`` and the ``imported`` files' texts (the
    parameters of every overload of a name together).

    >>> no_diff_tensors("namespace A { void f(int i, no_diff IDiffTensor<float, 1> x) { } }")
    {'A::f': {'x'}}
    """
    return _scan_all(source, imported)[0]


def no_diff_fields(source: str, imported: Iterable[str] = ()) -> dict[str, set[str]]:
    """Per struct (its name with its namespaces: ``A::S``), the names of its fields marked
    ``no_diff``, in ``source`` and the ``imported`` files' texts.

    >>> no_diff_fields("struct S { no_diff DiffTensor<float, 1> t; float a; };")
    {'S': {'t'}}
    """
    return _scan_all(source, imported)[1]


def _scan_all(source: str, imported: Iterable[str], defs: dict | None = None) -> tuple:
    found: dict[str, set[str]] = {}
    fields: dict[str, set[str]] = {}
    for k, text in enumerate((source, *imported)):
        own: dict = {}
        _scan(text, found, fields, own)
        for name, entries in own.items() if defs is not None else ():
            # (a line of an imported text is not the module's: 0)
            defs.setdefault(name, []).extend(e if k == 0 else (*e[:2], 0) for e in entries)
    return found, fields


def no_diff_definitions(source: str, imported: Iterable[str] = ()) -> dict[str, list]:
    """Per function (named as ``no_diff_tensors`` names it), each of its definitions in
    ``source`` and the ``imported`` texts: ``(parameter names, those marked no_diff, line)``
    (the line in ``source``; 0 in an imported text). Overloads are told apart by their
    parameters (``marked_params``), not merged.

    >>> no_diff_definitions("void f(int i, no_diff IDiffTensor<float, 1> x) { }")
    {'f': [(('i', 'x'), frozenset({'x'}), 1)]}
    """
    defs: dict[str, list] = {}
    _scan_all(source, imported, defs)
    return defs


def marked_params(defs: dict, name: str, params: list[str]) -> tuple[set[str], set[str], int]:
    """For the function ``name`` whose reflected parameters are named ``params``: the names
    marked ``no_diff`` in its definition; those that definitions of as many parameters mark
    at other positions (overloads of one arity, which SlangPy picks between by the values'
    types while pydiff reads the first; or both branches of an ``#if`` the scan cannot
    decide: which definition runs is unknown); and the line of its definition. An overload
    of another arity is not this one (before break48 every definition's markings were
    merged: one overload's ``no_diff`` dropped another's gradient, silently). Where no
    definition has as many parameters (a name a macro builds), every marking counts.

    >>> defs = no_diff_definitions("void f(int i, no_diff T x) {} void f(T x) {}")
    >>> marked_params(defs, "f", ["x"])
    (set(), set(), 1)
    """
    entries = defs.get(name, [])
    same = [(names, marked, line) for names, marked, line in entries if len(names) == len(params)]
    if not same:
        return set().union(*(marked for _, marked, _ in entries)), set(), 0
    at = [{i for i, n in enumerate(names) if n in marked} for names, marked, _ in same]
    sure = set.intersection(*at)
    unsure = set.union(*at) - sure
    own = [line for names, _, line in same if names == tuple(params)]
    return {params[i] for i in sure}, {params[i] for i in unsure}, (own or [same[0][2]])[0]
