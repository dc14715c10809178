"""The ``inout`` wrapper of a function with a hand-written ``[BackwardDerivative]``: its own
backward calls the user's backward directly.

pydiff differentiates a function with ``inout`` parameters through a generated wrapper that
splits each into an input and an ``out`` (``module.inout_wrapper_source``). When the function
has a hand-written backward that reads an inout's primal (``v.p``, the value before the
call), Slang's autodiff of the wrapper's call builds a kernel that segfaults the process at
dispatch (SlangPy 0.43.1, lavapipe; reproduced in raw SlangPy). Giving the wrapper a
``[BackwardDerivative]`` of its own that calls the user's backward with the pairs it expects
(``diffPair(value before, upstream of the value after)``) runs the same math without
Slang's autodiff of the call, and does not crash.

    src = direct_inout_source(fn)    # None: not a case for it (the plain wrapper is used)
"""

from __future__ import annotations

import re

from . import lint, lint_custom
from .signature import FunctionTarget

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
    found = {m.group(1) for m in _BWD.finditer(src) if _name_after(src, m.end()) == fn.name}
    found |= {
        name
        for m in _BWD_OF.finditer(src)
        if m.group(1) == fn.name and (name := _name_after(src, m.end())) is not None
    }
    defined = len(re.findall(rf"\b{re.escape(fn.name)}\s*(<[^<>()]*>)?\s*\([^;{{]*\)\s*\{{", src))
    return found.pop() if len(found) == 1 and defined <= 1 else None


def direct_inout_source(fn: FunctionTarget) -> str | None:
    """The inout wrapper whose backward calls ``fn``'s hand-written backward directly, or
    None where that does not apply (no hand-written backward, tensors, generics, structs,
    an ``out``/``inout`` value without a derivative): the plain wrapper serves then."""
    bwd = backward_of(fn)
    if bwd is None or not any(p.io == "inout" for p in fn.params):
        return None
    source = _source(fn, bwd)
    if source is None:
        src = lint.scanned_source(fn.module.file) or ""
        param = lint_custom.inout_primal_reads(src).get(fn.name)
        if param is not None:  # the plain wrapper would crash the process
            raise TypeError(
                f"{fn.label}.bwds refused: its hand-written backward {bwd}() reads the primal "
                f"of inout parameter '{param}', which pydiff can run only for functions of "
                "float/vector/matrix and integer values (no tensors, structs or generics): "
                "Slang's autodiff of it crashes the process (SlangPy 0.43). Pass the value in "
                "and return the new one instead of inout"
            )
    return source


def _source(fn: FunctionTarget, bwd: str) -> str | None:
    ret = fn.signature.return_type
    if ret != "void" and not _float_type(ret):
        return None
    params, bparams, call_args, bwd_args, pre, post, bpre, bpost = ([] for _ in range(8))
    for p in fn.params:
        pair = p.differentiable and not p.no_diff
        plain = _PLAIN.match(p.type_name.strip()) is not None
        if p.tensor_kind is not None or p.generic or not (pair or plain or p.no_diff):
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
    call = f"{fn.name}({', '.join(call_args)})"
    body = (
        [*pre, f"{call};", *post]
        if ret == "void"
        else [*pre, f"{ret} __r = {call};", *post, "return __r;"]
    )
    bbody = [*bpre, f"{bwd}({', '.join(bwd_args)});", *bpost]
    name = f"{fn.name}__pydiff_inout"
    return (
        f"import {fn.module.import_spec};\n"
        f"[Differentiable][BackwardDerivative({name}_bwd)]\n"
        f"{ret} {name}({', '.join(params)})\n{{\n    " + "\n    ".join(body) + "\n}\n"
        f"void {name}_bwd({', '.join(bparams)})\n{{\n    " + "\n    ".join(bbody) + "\n}\n"
    )


def _float_type(name: str) -> bool:
    return re.match(r"^(float|half|double)([1-4](x[1-4])?)?$", name.strip()) is not None
