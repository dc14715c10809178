"""The generated ``inout`` wrappers: the plain one, and the one of a function with a
hand-written ``[BackwardDerivative]``, whose own backward calls the user's backward directly.

pydiff differentiates a function with ``inout`` parameters through a generated wrapper that
splits each into an input and an ``out`` (``inout_wrapper_source``). A generic function's
wrapper is generic too: it repeats the function's generic parameters (``<T : IFloat, let N :
int>`` and any ``where`` clause, read from the module's source) and calls ``f<T, N>(...)``,
so SlangPy specialises it from the arguments as it does the function. When the function
has a hand-written backward that reads an inout's primal (``v.p``, the value before the
call), Slang's autodiff of the wrapper's call builds a kernel that segfaults the process at
dispatch (SlangPy 0.43.1, lavapipe; reproduced in raw SlangPy). Giving the wrapper a
``[BackwardDerivative]`` of its own that calls the user's backward with the pairs it expects
(``diffPair(value before, upstream of the value after)``) runs the same math without
Slang's autodiff of the call, and does not crash.

    src = direct_inout_source(fn)    # None: not a case for it (the plain wrapper is used)
    src = inout_wrapper_source(fn)    # the plain wrapper
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import lint, lint_custom
from .lint_nodiff import generic_base, own_name
from .signature import FunctionTarget, stem

_BWD = re.compile(r"\[\s*BackwardDerivative\s*\(\s*([A-Za-z_]\w*)\s*\)\s*\]")
_BWD_OF = re.compile(r"\[\s*BackwardDerivativeOf\s*\(\s*([A-Za-z_]\w*)\s*\)\s*\]")
_NAME_BEFORE_PAREN = re.compile(r"([A-Za-z_]\w*)\s*(<[^<>()]*>)?\s*\($")
_PLAIN = re.compile(r"^(u?int(64_t)?|bool)([1-4])?$")


def _name_after(src: str, end: int) -> str | None:
    """The function declared right after offset ``end`` (attributes, return type skipped)."""
    paren = src.find("(", end)
    stop = min(i for i in (src.find(";", end), src.find("{", end), len(src)) if i >= 0)
    if paren < 0 or paren > stop:
        return None
    m = _NAME_BEFORE_PAREN.search(src[end : paren + 1])
    return m.group(1) if m else None


def backward_of(fn: FunctionTarget) -> str | None:
    """The name of ``fn``'s hand-written backward derivative, when its source says (once)."""
    src = lint.scanned_source(fn.module.file)
    if src is None:
        return None
    src = re.sub(r"//[^\n]*|/\*.*?\*/", " ", src, flags=re.S)
    base = own_name(fn.name)  # f<2>, A::f: the backward written on f (names as written)
    found = {m.group(1) for m in _BWD.finditer(src) if _name_after(src, m.end()) == base}
    found |= {
        name
        for m in _BWD_OF.finditer(src)
        if m.group(1) == base and (name := _name_after(src, m.end())) is not None
    }
    defined = len(re.findall(rf"\b{re.escape(base)}\s*(<[^<>()]*>)?\s*\([^;{{]*\)\s*\{{", src))
    if len(found) != 1 or defined > 1:
        return None
    scope = generic_base(fn.name).rpartition("::")[0]  # A::f's backward is A's, as written
    return f"{scope}::{found.pop()}" if scope else found.pop()


def direct_inout_source(fn: FunctionTarget) -> str | None:
    """The inout wrapper whose backward calls ``fn``'s hand-written backward directly, or
    None where that does not apply (no hand-written backward, tensors, structs,
    an ``out``/``inout`` value without a derivative): the plain wrapper serves then."""
    if not any(p.io == "inout" for p in fn.params):
        return None
    bwd = backward_of(fn)
    if bwd is None:
        src = lint.scanned_source(fn.module.file) or ""
        param = lint_custom.inout_primal_reads(src).get(own_name(fn.name))
        if param is not None:  # (the plain wrapper would crash the process, were it this one)
            raise TypeError(
                f"{fn.label}.bwds refused: a function named '{own_name(fn.name)}' in module "
                f"'{fn.module.name}' has a hand-written backward that reads the primal of inout "
                f"parameter '{param}', and the name is defined more than once (overloads, or "
                "functions of other namespaces or structs) or declared in a way pydiff does "
                "not read, so pydiff cannot tell whether it is this one: were it, Slang's "
                "autodiff of the call would crash the process (SlangPy 0.43). Give the "
                "function a name of its own"
            )
        return None
    source = _source(fn, bwd)
    if source is None:
        src = lint.scanned_source(fn.module.file) or ""
        param = lint_custom.inout_primal_reads(src).get(own_name(fn.name))
        if param is not None:  # the plain wrapper would crash the process
            raise TypeError(
                f"{fn.label}.bwds refused: its hand-written backward {bwd}() reads the primal "
                f"of inout parameter '{param}', which pydiff can run only for functions of "
                "float/vector/matrix and integer values, generic or not (no tensors or structs): "
                "Slang's autodiff of it crashes the process (SlangPy 0.43). Pass the value in "
                "and return the new one instead of inout"
            )
    return source


def refuse_inout_name_clash(fn: FunctionTarget) -> None:
    """A ``ValueError`` where a parameter is named as pydiff names an ``inout`` parameter's
    halves in its wrappers (``o__in``, ``o__out`` beside ``inout float o``): the wrapper would
    declare one name twice (before: a raw compile error of the generated wrapper)."""
    names = {p.name for p in fn.params}
    for p in fn.params:
        for half in (f"{p.name}__in", f"{p.name}__out"):
            if p.io == "inout" and half in names:
                raise ValueError(
                    f"{fn.label}: parameter '{half}' has the name pydiff gives the "
                    f"{half.rsplit('__', 1)[1]} half of inout parameter '{p.name}' in the "
                    "wrapper its backward runs; rename one of them"
                )


def _source(fn: FunctionTarget, bwd: str) -> str | None:
    refuse_inout_name_clash(fn)
    ret = fn.signature.return_type
    generics, type_args, where = generic_header(fn)
    if ret != "void" and not _float_type(ret) and ret not in type_args[1:-1].split(", "):
        return None
    params, bparams, call_args, bwd_args, pre, post, bpre, bpost = ([] for _ in range(8))
    for p in fn.params:
        pair = p.differentiable and not p.no_diff
        plain = _PLAIN.match(p.type_name.strip()) is not None
        if p.tensor_kind is not None or not (pair or plain or p.no_diff):
            return None
        if p.io != "in" and not pair:
            return None
        mods = "no_diff " if p.no_diff else ""
        t, n = p.type_name, p.name
        if p.io == "inout":
            params += [f"{t} {n}__in", f"out {t} {n}__out"]
            pre.append(f"{t} {n} = {n}__in;")
            post.append(f"{n}__out = {n};")
            bparams += [f"inout DifferentialPair<{t}> {n}__in", f"{t}.Differential {n}__out"]
            bpre.append(f"var {n} = diffPair({n}__in.p, {n}__out);")
            bpost.append(f"{n}__in = diffPair({n}__in.p, {n}.d);")
        elif p.io == "out":
            params.append(f"out {t} {n}")
            bparams.append(f"{t}.Differential {n}")
        else:
            params.append(f"{mods}{t} {n}")
            bparams.append(f"inout DifferentialPair<{t}> {n}" if pair else f"{t} {n}")
        call_args.append(n)
        bwd_args.append(n)
    if ret != "void":
        bparams.append(f"{ret}.Differential __pydiff_dresult")
        bwd_args.append("__pydiff_dresult")
    call = f"{fn.name}{type_args}({', '.join(call_args)})"
    body = (
        [*pre, f"{call};", *post]
        if ret == "void"
        else [*pre, f"{ret} __pydiff_r = {call};", *post, "return __pydiff_r;"]
    )
    bbody = [*bpre, f"{bwd}({', '.join(bwd_args)});", *bpost]
    name = f"{stem(fn.name)}__pydiff_inout"
    return (
        f"import {fn.module.import_spec};\n"
        f"[Differentiable][BackwardDerivative({name}_bwd)]\n"
        f"{ret} {name}{generics}({', '.join(params)}){where}\n{{\n    "
        + "\n    ".join(body)
        + "\n}\n"
        f"void {name}_bwd{generics}({', '.join(bparams)}){where}\n{{\n    "
        + "\n    ".join(bbody)
        + "\n}\n"
    )


def _float_type(name: str) -> bool:
    return re.match(r"^(float|half|double)([1-4](x[1-4])?)?$", name.strip()) is not None


def inout_wrapper_source(fn: FunctionTarget) -> str:
    """A generated Slang function that turns each ``inout`` parameter into in + out.

    SlangPy 0.43's bwds never seeds the gradient of an ``inout`` value (it returns zeros);
    with the value split into an input and an ``out`` the generated backward is correct.
    """
    refuse_inout_name_clash(fn)
    generics, type_args, where = generic_header(fn)
    params, call_args, pre, post = [], [], [], []
    for p in fn.params:
        mods = "no_diff " if p.no_diff else ""
        if p.io == "inout":
            params += [f"{mods}{p.type_name} {p.name}__in", f"out {p.type_name} {p.name}__out"]
            pre.append(f"{p.type_name} {p.name} = {p.name}__in;")
            post.append(f"{p.name}__out = {p.name};")
        else:
            io = "out " if p.io == "out" else ""
            params.append(f"{io}{mods}{p.type_name} {p.name}")
        call_args.append(p.name)
    ret_name = fn.signature.return_type
    call = f"{fn.name}{type_args}({', '.join(call_args)})"
    body = [*pre]
    if ret_name == "void":
        body += [f"{call};", *post]
    else:
        body += [f"{ret_name} __pydiff_r = {call};", *post, "return __pydiff_r;"]
    return (
        f"import {fn.module.import_spec};\n"
        f"[Differentiable]\n{ret_name} {stem(fn.name)}__pydiff_inout{generics}({', '.join(params)})"
        f"{where}\n{{\n    " + "\n    ".join(body) + "\n}\n"
    )


def generic_header(fn: FunctionTarget) -> tuple[str, str, str]:
    """For a generic function, the text a wrapper of it repeats: its generic parameters
    (``'<T : IFloat, let N : int>'``), the type arguments of a call (``'<T, N>'``) and its
    ``where`` clause (``' where T : IFoo'``); three empty strings for a plain function.

    Raises TypeError when the declaration is not in the module's own source (an included
    file) or declares what a wrapper cannot repeat (a variadic ``each T``)."""
    if not any(p.generic for p in fn.params):
        return "", "", ""
    found = None
    for source in _sources(fn.module):
        found = _generic_declarations(re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S), fn)
        if found is not None:
            break
    if found is None:
        raise TypeError(
            f"{fn.label}.bwds: '{fn.name}' is generic and has an inout parameter, whose "
            "backward runs through a generated generic wrapper; pydiff could not find the "
            f"definition of {fn.name}<...>(...) in the source of module '{fn.module.name}' "
            "or the files it includes and imports. Define it there, or write a non-generic "
            "overload (float) to call"
        )
    generics, where = found
    names = []
    for entry in _split_top(generics):
        m = re.match(r"^(?:let\s+)?([A-Za-z_]\w*)\b", entry.strip())
        if m is None or re.match(r"^each\b", entry.strip()):
            raise TypeError(
                f"{fn.label}.bwds: pydiff cannot repeat the generic parameter '{entry.strip()}' "
                "of this function in the generated wrapper its inout backward needs (variadic "
                "or unrecognised); write a non-generic overload to call"
            )
        names.append(m.group(1))
    return f"<{generics}>", f"<{', '.join(names)}>", f" {where}" if where else ""


def _sources(module: Any) -> Iterator[str]:
    """The module's own source text, then the files it includes and imports."""
    yield getattr(module, "source", None) or lint.scanned_source(module.file) or ""
    for path in getattr(module, "source_files", ()):
        try:
            yield Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def _generic_declarations(src: str, fn: FunctionTarget) -> tuple[str, str] | None:
    """(generic parameter text, where clause) of the definition ``name<...>(...) {`` in
    ``src`` whose parameter names are ``fn``'s (the only one, failing that)."""
    want = [p.name for p in fn.params]
    hits: list[tuple[list[str], str, str]] = []
    for m in re.finditer(rf"\b{re.escape(fn.name)}\s*<", src):
        close = _matching(src, m.end() - 1, "<", ">")
        paren = close + 1 + (len(src[close + 1 :]) - len(src[close + 1 :].lstrip()))
        if close < 0 or src[paren : paren + 1] != "(":
            continue
        end = _matching(src, paren, "(", ")")
        brace = src.find("{", end + 1) if end >= 0 else -1
        tail = src[end + 1 : brace].strip() if brace >= 0 else ";"
        if tail and not tail.startswith("where"):
            continue  # a call (g<float>(a) + ...) or a declaration without a body
        names = [_param_name(p) for p in _split_top(src[paren + 1 : end])]
        hits.append((names, src[m.end() : close].strip(), " ".join(tail.split())))
    exact = [h for h in hits if h[0] == want]
    chosen = exact or (hits if len(hits) == 1 else [])
    return (chosen[0][1], chosen[0][2]) if len(chosen) == 1 else None


def _matching(src: str, start: int, open_: str, close: str) -> int:
    depth = 0
    for i in range(start, len(src)):
        depth += (src[i] == open_) - (src[i] == close)
        if depth == 0:
            return i
    return -1


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets; no entries for empty text."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "<([{") - (ch in ">)]}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [e for e in [*out, cur] if e.strip()]


def _param_name(decl: str) -> str:
    decl = decl.split("=")[0]
    m = re.search(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*(?::\s*\w+\s*)?$", decl.strip())
    return m.group(1) if m else ""
