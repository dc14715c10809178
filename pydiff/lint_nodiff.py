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
    names = set()
    for param in _split_params(params):
        words = param.split()
        if "no_diff" in words and (m := _NAME.search(param.strip())) is not None:
            names.add(m.group(1))
    return names


def _scan(text: str, found: dict[str, set[str]], fields: dict[str, set[str]]) -> None:
    text = _COMMENTS.sub(" ", text)
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


def _scan_all(source: str, imported: Iterable[str]) -> tuple[dict, dict]:
    found: dict[str, set[str]] = {}
    fields: dict[str, set[str]] = {}
    for text in (source, *imported):
        _scan(text, found, fields)
    return found, fields
