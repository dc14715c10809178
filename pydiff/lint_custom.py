"""Trap scan of hand-written backward derivatives: a ``[BackwardDerivative(bw)]`` of a
function with an ``inout`` parameter whose ``bw`` reads that parameter's primal (``v.p``),
and a ``bw`` that never sets the derivative of one of its ``inout DifferentialPair``
parameters (``UNSET_KIND``: that gradient is then undefined, NaN through SlangPy's kernels
and 0 through pydiff's generated ones, so the function's ``.bwds`` is refused), and a
function with a hand-written backward but no forward derivative (``lint.BWD_ONLY_KIND``:
Slang's forward mode of a caller drops its calls, so forward mode is refused).

Called directly (``f.bwds``), pydiff runs such a backward through a wrapper that calls it
without Slang's autodiff (``custom_backward``), and it is right. Called from *another*
differentiable function, Slang's autodiff of the call builds a kernel that segfaults the
process at dispatch (SlangPy 0.43.1, lavapipe; reproduced in raw SlangPy): the callers'
``.bwds`` is refused, naming the call's file and line.

    findings = scan_source(open("ops.slang").read(), "ops.slang")   # lint.Finding list
"""

from __future__ import annotations

import re

from .lint import BWD_ONLY_KIND, DERIVED_BWD_KIND, DERIVED_FWD_KIND, FWD_DIFF_OF_WRONG_KIND
from .lint import FWD_NOT_REVERSE_KIND
from .lint import Finding
from .lint_flow import call_at, matching

KIND = "custom-bwd-inout-primal"
UNSET_KIND = "custom-bwd-unset-derivative"
READS_KIND = "custom-bwd-reads-derivative"  # the incoming .d is undefined too (NaN or 0)
_BWD = re.compile(r"\[\s*BackwardDerivative\s*\(\s*([A-Za-z_]\w*)\s*\)\s*\]")
_BWD_OF = re.compile(r"\[\s*BackwardDerivativeOf\s*\(\s*([A-Za-z_]\w*)\s*\)\s*\]")
# attributes that give the function they mark a forward derivative (Slang's own from its
# body, or a hand-written one), and the attribute naming the function it is the forward of
_FORWARD = re.compile(
    r"\[\s*(?:Differentiable|BackwardDifferentiable|ForwardDifferentiable|ForwardDerivative)\b"
    r"[^\]]*\]"
)
_FWD_OF = re.compile(r"\[\s*ForwardDerivativeOf\s*\(\s*([A-Za-z_]\w*)\s*\)\s*\]")
_DIFF = re.compile(r"\[\s*(Differentiable|BackwardDifferentiable)\s*(\([^)]*\))?\s*\]")
_BRACE = re.compile(r"\s*(?:where\b[^{};()]*)?\{")  # (a generic's where clause)
_HEAD = re.compile(r"([A-Za-z_]\w*)\s*(<(?:[^<>()]|<[^<>()]*>)*>)?\s*\($")


def _blank_comments(src: str) -> str:
    return re.sub(
        r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), src, flags=re.S
    )


def _definitions(src: str) -> dict[str, list[tuple[int, list[str], str, int]]]:
    """Function definitions: name -> [(offset of the name, parameters, body, body offset)]."""
    out: dict[str, list[tuple[int, list[str], str, int]]] = {}
    for m in re.finditer(r"([A-Za-z_]\w*)\s*(<(?:[^<>(){};]|<[^<>(){};]*>)*>)?\s*\(", src):
        if m.group(1) in ("if", "for", "while", "switch", "return", "do"):
            continue
        close = matching(src, m.end() - 1, "(", ")")
        if close < 0:
            continue
        opening = _BRACE.match(src, close + 1)
        if opening is None:
            continue
        brace = opening.end() - 1
        end = matching(src, brace, "{", "}")
        if end < 0:
            continue
        params = [p.strip() for p in _split(src[m.end() : close]) if p.strip()]
        out.setdefault(m.group(1), []).append((m.start(1), params, src[brace:end], brace))
    return out


def _split(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "<([{"
        depth -= ch in ">)]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _name_after(src: str, end: int) -> str | None:
    paren = src.find("(", end)
    stops = [i for i in (src.find(";", end), src.find("{", end)) if i >= 0]
    if paren < 0 or (stops and paren > min(stops)):
        return None
    m = _HEAD.search(src[end : paren + 1])
    return m.group(1) if m else None


def _crashing(src: str, defs: dict) -> dict[str, str]:
    """Functions whose hand-written backward reads an inout parameter's primal: name -> the
    parameter."""
    found: dict[str, str] = {}
    for f, bw in _pairs(src):
        if not f or not bw or f not in defs or bw not in defs:
            continue
        for _, params, _, _ in defs[f]:
            for k, p in enumerate(params):
                words = re.findall(r"[A-Za-z_]\w*", p)
                if "inout" not in words or "no_diff" in words:
                    continue
                for _, bparams, body, _ in defs[bw]:
                    if k >= len(bparams):
                        continue
                    bname = re.findall(r"[A-Za-z_]\w*", bparams[k])[-1]
                    # diffPair(v.p, ...) hands the primal back unchanged: not a read
                    kept = re.sub(rf"diffPair\s*\(\s*{bname}\s*\.\s*p\s*,", "", body)
                    if re.search(rf"\b{bname}\s*\.\s*(p\b|getPrimal\s*\()", kept):
                        found[f] = words[-1]
    return found


def _declared_after(src: str, end: int) -> str | None:
    """The function an attribute ending at ``end`` marks: the name after any further
    attributes (``[ForwardDerivative(f)][BackwardDerivative(b)] float g(...)``: g)."""
    while True:
        at = len(src) - len(src[end:].lstrip())
        if not src.startswith("[", at):
            return _name_after(src, at)
        close = matching(src, at, "[", "]")
        if close < 0:
            return None
        end = close + 1


def _backward_only(src: str, defs: dict, file: str) -> list[Finding]:
    """Functions with a hand-written backward (``[BackwardDerivative(bw)]``, or a
    ``[BackwardDerivativeOf(f)]`` naming them) and no forward derivative: not marked
    ``[Differentiable]`` (nor ``[ForwardDifferentiable]``) and without a
    ``[ForwardDerivative]``/``[ForwardDerivativeOf]``. Slang's forward mode of a function
    calling one drops the call: value and tangent come out as if it returned 0 (SlangPy
    0.43, no error), and its own ``.fwds`` fails to compile. Their ``.bwds`` is right."""
    forward = {_declared_after(src, m.end()) for m in _FORWARD.finditer(src)}
    forward |= {m.group(1) for m in _FWD_OF.finditer(src)}
    findings, seen = [], set()
    for f, bw in _pairs(src):
        if not f or f in forward or f in seen or f not in defs:
            continue
        seen.add(f)
        message = (
            f"{f}() has a hand-written backward ({bw}) but no forward derivative: Slang's "
            f"forward mode (.fwds, jvp, jacfwd, hvp) of a function calling it drops the call "
            "without an error (wrong values and tangents: 'cb(a, x) + x' gave x and 1; "
            f"SlangPy 0.43), and of {f}() itself fails to build; .bwds is right. Mark {f}() "
            "[Differentiable] "
            "(Slang then differentiates its body forward and keeps your backward), or give "
            "it a [ForwardDerivative]"
        )
        line = src.count("\n", 0, defs[f][0][0]) + 1
        findings.append(Finding(file, line, f, BWD_ONLY_KIND, message))
    return findings


_CUT = re.compile(r"\b(no_diff|detach)\s*\(")
_FWD = re.compile(r"\[\s*ForwardDerivative\s*\(\s*([A-Za-z_][\w.:]*)\s*\)\s*\]")  # (A.g, A::g)


def _derived_through_cut(src: str, defs: dict, file: str) -> list[Finding]:
    """[Differentiable] functions with a hand-written derivative one way only, whose body
    holds ``no_diff(...)`` or ``detach(...)`` (as the build rule for non-differentiable
    helpers asks): Slang derives the other way from that body, where the cut part has
    derivative 0 (SlangPy 0.43: ``no_diff(helper(x))`` with ``[ForwardDerivative]`` gave
    ``.bwds`` 0, with ``[BackwardDerivative]`` ``.fwds`` 0; 2x right). Conservative: a cut
    part that depends on no differentiable input would be right, and is refused too."""
    diff = {_declared_after(src, m.end()) for m in _DIFF.finditer(src)}
    bwd = {f for f, _ in _pairs(src)}
    fwd = {_declared_after(src, m.end()) for m in _FWD.finditer(src)}
    fwd |= {m.group(1) for m in _FWD_OF.finditer(src)}
    findings = []
    for f in sorted((bwd ^ fwd) & diff):
        for _, _, body, body_at in defs.get(f, ()):
            cut = _CUT.search(body)
            if cut is None:
                continue
            written, derived = ("backward", "forward") if f in bwd else ("forward", "backward")
            kind = DERIVED_FWD_KIND if f in bwd else DERIVED_BWD_KIND
            uses = ".fwds, jvp, hvp" if f in bwd else ".bwds, tapes"
            message = (
                f"'{cut.group(1)}(...)' in {f}(), which has a hand-written {written} "
                f"derivative only: Slang derives its {derived} derivative from this body, "
                f"where the part under {cut.group(1)} counts 0 ({uses} of {f}() and its "
                f"callers silently wrong: no_diff(helper(x)) gave 0 where 2x is right, "
                f"SlangPy 0.43); write the {derived} derivative by hand too "
                f"([{derived.capitalize()}Derivative]), or compute the part differentiably"
            )
            line = src.count("\n", 0, body_at + cut.start()) + 1
            findings.append(Finding(file, line, f, kind, message))
            break
    return findings


def _forward_not_reverse(src: str, defs: dict, file: str) -> list[Finding]:
    """Functions whose hand-written forward derivative (``[ForwardDerivative(g)]``, or a
    ``[ForwardDerivativeOf(f)]`` on g) is not ``[Differentiable]``: hvp, reverse mode of
    that forward derivative, fails to build for the function itself (E41022) and segfaults
    the compiler for a function calling it (SlangPy 0.43.1: hvp of ``2 * softplus(x)``).
    lint_sources keeps the finding of an imported file only where another function calls
    it; of the module's own file always (its load warns: before 2026-11-29 nothing did)."""
    diff = {_declared_after(src, m.end()) for m in _DIFF.finditer(src)}
    pairs = [(_declared_after(src, m.end()), m.group(1)) for m in _FWD.finditer(src)]
    pairs += [(m.group(1), _declared_after(src, m.end())) for m in _FWD_OF.finditer(src)]
    findings = []
    for f, fw in pairs:  # (diff-tensor parameters: hvp refuses them first, pydiff's fdt_load)
        tensors = f in defs and any(re.search(r"DiffTensor\b", p) for p in defs[f][0][1])
        own = re.split(r"\.|::", fw)[-1] if fw else fw  # (a namespace's A.g: g's mark)
        if f and fw and f in defs and own not in diff and not tensors:
            message = (
                f"{f}() has a hand-written forward derivative {fw}() that is not "
                f"[Differentiable]: hvp/hessian (reverse mode of forward mode) of {f}() "
                f"cannot be built (Slang: E41022, no reverse mode through {fw}()), and of a "
                f"function calling {f}() would crash the Slang compiler (SlangPy 0.43); mark "
                f"{fw}() [Differentiable] for second derivatives (.bwds, .fwds and jvp are "
                "unaffected)"
            )
            line = src.count("\n", 0, defs[f][0][0]) + 1
            findings.append(Finding(file, line, f, FWD_NOT_REVERSE_KIND, message))
    return findings


_FWD_DIFF_OF = re.compile(
    r"\bfwd_diff\s*\(\s*(?:[A-Za-z_]\w*\s*(?:::|\.)\s*)*([A-Za-z_]\w*)\s*[<)]"
)


def fwd_diff_users(texts: list[tuple[str, str]], traps: dict) -> list[Finding]:
    """Functions (of any kind) whose own Slang calls ``fwd_diff(f)`` of a function ``f`` whose
    forward derivative Slang gets wrong (``traps[f]`` holds a ``wrong_jvp`` finding): their
    values are wrong, so their forward call is refused (``texts``: (text, file) pairs)."""
    found = []
    for text, file in texts:
        src = _blank_comments(text)
        for name, defs in _definitions(src).items():
            for _, _, body, body_at in defs:
                for m in _FWD_DIFF_OF.finditer(body):
                    wrong = [f for f in traps.get(m.group(1)) or () if f.wrong_jvp]
                    if not wrong or m.group(1) == name:
                        continue
                    line = src.count("\n", 0, body_at + m.start()) + 1
                    message = (
                        f"'fwd_diff({m.group(1)})' in {name}(): Slang's forward derivative of "
                        f"{m.group(1)}() is wrong ({wrong[0].file}:{wrong[0].line}: "
                        f"{wrong[0].message})"
                    )
                    found.append(Finding(file, line, name, FWD_DIFF_OF_WRONG_KIND, message))
                    break
    return found


def called_by_others(texts: list[str], name: str) -> bool:
    """Whether a function other than ``name`` calls ``name`` in one of ``texts`` (a
    backward-only function no one calls keeps its finding out of the scan: its own forward
    mode fails to build, which forward_mode reports)."""
    for text in texts:
        for other, found in _definitions(_blank_comments(text)).items():
            if other != name and any(call_at(body, name) >= 0 for _, _, body, _ in found):
                return True
    return False


def _pairs(src: str) -> list[tuple[str | None, str | None]]:
    """(function, its hand-written backward) of every BackwardDerivative(Of) attribute."""
    pairs = [(_declared_after(src, m.end()), m.group(1)) for m in _BWD.finditer(src)]
    return pairs + [(m.group(1), _declared_after(src, m.end())) for m in _BWD_OF.finditer(src)]


def _sets(body: str, name: str) -> bool:
    """Whether ``body`` assigns the pair ``name`` (``name = diffPair(...)``, ``name.d = ``)
    or hands it whole to a call that may (``helper(name, ...)``, ``bwd_diff(g)(name, d)``)."""
    n = re.escape(name)
    return bool(
        re.search(rf"\b{n}\s*(\.\s*d\s*)?=(?!=)", body) or re.search(rf"[(,]\s*{n}\s*[,)]", body)
    )


def _unset_derivatives(src: str, defs: dict, file: str) -> list[Finding]:
    """Hand-written backwards leaving an inout DifferentialPair's derivative unset."""
    findings = []
    for f, bw in _pairs(src):
        if not f or not bw or bw not in defs:
            continue
        own = defs[f][0][1] if f in defs else []  # f's parameters: an inout one's d is read
        for at, params, body, _ in defs[bw]:
            for k, p in enumerate(params):
                words = re.findall(r"[A-Za-z_]\w*", p.split("=")[0])
                if "inout" not in words or "DifferentialPair" not in words:
                    continue
                if _sets(body, words[-1]):  # (f's inout parameter: .d is its upstream gradient)
                    if k < len(own) and "inout" not in re.findall(r"[A-Za-z_]\w*", own[k]):
                        findings += _reads_incoming(src, file, f, bw, at, body, words[-1])
                    continue
                name = words[-1]
                message = (
                    f"its hand-written backward {bw}() never sets the derivative of '{name}' "
                    f"(no '{name} = diffPair({name}.p, ...)'): that gradient would be undefined "
                    "(NaN through SlangPy's kernels, 0 through pydiff's generated ones); set it, "
                    f"to diffPair({name}.p, 0.0) where {f}() does not depend on it, or mark the "
                    "parameter no_diff"
                )
                line = src.count("\n", 0, at) + 1
                findings.append(Finding(file, line, f, UNSET_KIND, message))
    return findings


def _reads_incoming(src: str, file: str, f: str, bw: str, at: int, body: str, name: str) -> list:
    """A backward reading its pair's incoming derivative (``x = diffPair(x.p, x.d + g)``)
    before (or while) setting it: undefined, NaN through SlangPy's kernels, 0 through the
    generated ones (SlangPy 0.43.1): the two paths disagree, so its ``.bwds`` is refused."""
    n = re.escape(name)
    first = re.search(rf"\b{n}\s*(\.\s*d\s*)?=(?!=)|[(,]\s*{n}\s*[,)]", body)
    end = body.find(";", first.end()) if first else len(body)
    read = re.search(rf"\b{n}\s*\.\s*(d\b(?!\s*=(?!=))|getDifferential\s*\()", body)
    if read is None or read.start() > (end if end >= 0 else len(body)):
        return []
    message = (
        f"its hand-written backward {bw}() reads the incoming derivative of '{name}' "
        f"('{name}.d') before setting it: that value is undefined (NaN through SlangPy's "
        f"kernels, 0 through pydiff's generated ones); set {name} = diffPair({name}.p, "
        "gradient) from the upstream gradient alone: pydiff adds it into the buffer"
    )
    return [Finding(file, src.count("\n", 0, at) + 1, f, READS_KIND, message)]


def inout_primal_reads(source: str) -> dict[str, str]:
    """Functions whose hand-written backward reads an inout parameter's primal: name -> the
    parameter (``custom_backward`` must then not fall back to Slang's autodiff of a call)."""
    src = _blank_comments(source)
    return _crashing(src, _definitions(src))


def scan_source(source: str, file: str = "<source>") -> list[Finding]:
    """Calls, from differentiable functions, of a function whose hand-written backward
    reads an inout parameter's primal (the caller's ``.bwds`` would crash the process), and
    functions whose hand-written backward leaves a derivative unset."""
    src = _blank_comments(source)
    defs = _definitions(src)
    findings = _unset_derivatives(src, defs, file) + _backward_only(src, defs, file)
    findings += _derived_through_cut(src, defs, file) + _forward_not_reverse(src, defs, file)
    crashing = _crashing(src, defs)
    if not crashing:
        return findings
    for m in _DIFF.finditer(src):
        caller = _name_after(src, m.end())
        if caller is None or caller not in defs:
            continue
        for _, _, body, body_at in defs[caller]:
            for f, param in crashing.items():
                call = call_at(body, f)
                if f == caller or call < 0:
                    continue
                line = src.count("\n", 0, body_at + call) + 1
                message = (
                    f"calls {f}(), whose hand-written backward reads the primal of inout "
                    f"parameter '{param}' ({param}.p): Slang's autodiff of that call builds a "
                    f"kernel that crashes the process (SlangPy 0.43). {f}.bwds itself works; "
                    f"here pass the value in and return the new one (float {f}_value(...)) "
                    "with a backward of its own, or call the backward by hand"
                )
                findings.append(Finding(file, line, caller, KIND, message))
    return findings
