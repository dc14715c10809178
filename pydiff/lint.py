"""Find Slang patterns that SlangPy 0.43 differentiates wrongly or crashes on, before dispatch.

Measured on SlangPy 0.43.1 (docs/traps.md). On the *interface* diff tensors (IDiffTensor,
IWDiffTensor, IRWDiffTensor) an index is either a list of integer scalars ("scalar":
``t[i]``, ``t[i, j]``, ``t.load(i, j)``) or one array/vector ("array": ``t[idx]`` with
``int[2] idx``, ``int2``, or a lone ``uint`` on a 1-D tensor). Inside one ``[Differentiable]``
function, using both kinds makes ``.bwds`` segfault in the Slang compiler; ``.load``/``.store``
with an index that is not integer scalars gives all-zero gradients; a loop condition reading
``t.shape`` hangs, and so does the compile of a backward that reads or writes one under a
condition (an ``if`` branch, a ``?:`` arm) or uses one again after a subscript store
(``t[i] = v; ... t[j]``), and a read back after a ``.store`` or a helper's store gives
wrong gradients (lint_readback). Concrete DiffTensor types have none of these problems.
``pow`` with a negative base and ``fmod``'s divisor get derivative 0 (lint_math).

    findings = pydiff.lint.scan_source(open("layer.slang").read(), "layer.slang")
    for f in findings: print(f)          # layer.slang:12: in dense(): ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .lint_atomics import ANY_FUNCTION as _ANY_FUNCTION
from .lint_atomics import KEYWORDS as _KEYWORDS
from .lint_flow import matching as _matching
from .lint_flow import call_at, conditional_spans, do_while_break, promotions, while_break
from .lint_generic import KIND as GENERIC_FOR
from .lint_generic import generic_for_access
from .lint_reach import interface_holders, reached_kinds
from .lint_math import FMOD_KIND, POW_KIND, POW_WARN_KIND, math_traps
from .lint_nodiff import generic_base, own_name
from .lint_readback import KIND as READBACK
from .lint_readback import helper_effects, readback_message, store_then_read
from .lint_macros import Defines, IncludeMacros, preprocess, unexpanded_message
from .lint_macros import blank_comments_and_strings as _strip_comments
from .lint_index import (
    VECTOR_ORDER,
    accesses,
    declared_index_types,
    field_index_types,
    load_store_problem,
    scalar_form,
    show,
    split_top,
    store_then_access,
)

_DIFF_ATTR = re.compile(r"\[\s*(Differentiable|BackwardDifferentiable)\s*(\([^)]*\))?\s*\]")
_IDENT_BEFORE_PAREN = re.compile(r"([A-Za-z_]\w*)\s*(<(?:[^<>()]|<[^<>()]*>)*>)?\s*\($")
_VECTOR_EXTENSION = re.compile(r"\bextension\s+((?:float|half|double)[2-4])\s*[^{;]*\{")
_INTERFACE_DIFF_TENSOR = re.compile(r"\bI(RW|W)?DiffTensor\s*<[^,<>]+,\s*(\d+)\s*>")
#: a function with a hand-written backward and no forward derivative (lint_custom): Slang's
#: forward mode drops its calls (value and tangent), its backward is right
BWD_ONLY_KIND = "custom-bwd-no-forward"
#: a [Differentiable] function with a hand-written derivative one way only, whose body cuts a
#: derivative (no_diff(...), detach(...)): the way Slang derives from the body is wrong
#: (lint_custom): the backward (hand-written forward only) or forward mode (backward only)
DERIVED_BWD_KIND = "custom-fwd-derived-backward"
DERIVED_FWD_KIND = "custom-bwd-derived-forward"
#: fwd_diff(f) written in a function's own Slang, f's forward derivative wrong (wrong_jvp):
#: the function's values are wrong, its forward call refused (lint_custom.fwd_diff_users)
FWD_DIFF_OF_WRONG_KIND = "fwd-diff-of-wrong-forward"
#: a [ForwardDerivative(g)] whose g is not [Differentiable], called by another function:
#: hvp (reverse of forward) of a caller segfaults the compiler (lint_custom), so it is refused
FWD_NOT_REVERSE_KIND = "custom-fwd-not-differentiable"


@dataclass(frozen=True)
class Finding:
    """One trap: where it is, what SlangPy does with it, and the fix."""

    file: str
    line: int
    function: str
    kind: str
    message: str

    @property
    def refuses_bwds(self) -> bool:
        """Whether .bwds must be refused (a crash or wrong gradient), not only warned about."""
        return self.kind not in (
            "vector-index-order",
            POW_WARN_KIND,
            BWD_ONLY_KIND,
            DERIVED_FWD_KIND,
            FWD_NOT_REVERSE_KIND,
        )

    @property
    def wrong_jvp(self) -> bool:
        """Whether forward mode (.fwds, jvp) gets the same wrong derivative rule."""
        return self.kind in (POW_KIND, FMOD_KIND, BWD_ONLY_KIND, DERIVED_FWD_KIND)

    @property
    def crashes_hvp(self) -> bool:
        """Whether hvp (reverse mode of forward mode) must be refused: its build crashes."""
        return self.kind == FWD_NOT_REVERSE_KIND

    @property
    def crashes_call(self) -> bool:
        """Whether even a forward call must be refused (the kernel's build crashes)."""
        return self.kind in (
            "do-while-break", "struct-interface-tensor", "double-intrinsic",
            FWD_DIFF_OF_WRONG_KIND,
        )  # fmt: skip

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: in {self.function}(): {self.message}"


@dataclass
class _Function:
    name: str
    params: list[str]
    body: str
    body_offset: int
    generic: bool = False  # name<...>(...): a generic's backward compiles differently


def _differentiable_functions(src: str) -> list[_Function]:
    found = []
    for attr in _DIFF_ATTR.finditer(src):
        paren = src.find("(", attr.end())
        brace = src.find("{", attr.end())
        semi = src.find(";", attr.end())
        if paren < 0 or brace < 0 or (0 <= semi < paren):
            continue
        head = _IDENT_BEFORE_PAREN.search(src[attr.end() : paren + 1])
        close = _matching(src, paren, "(", ")")
        if head is None or close < 0:
            continue
        brace = src.find("{", close)
        end = _matching(src, brace, "{", "}") if brace >= 0 else -1
        if end < 0 or src[close + 1 : brace].strip().startswith(";"):
            continue
        params = split_top(src[paren + 1 : close])
        found.append(_Function(head.group(1), params, src[brace:end], brace, bool(head.group(2))))
    return found


def _line_of(src: str, offset: int) -> int:
    return src.count("\n", 0, offset) + 1


def scan_source(
    source: str,
    file: str = "<source>",
    *,
    defines: Defines | None = None,
    include: IncludeMacros | None = None,
) -> list[Finding]:
    """All trap findings in one Slang source text, in source order, its macros expanded
    (``lint_macros.preprocess``); ``lint_sources.scan_module`` scans its imports too."""
    _scanned[file] = source
    pre = preprocess(source, defines, include)
    src = _strip_comments(pre.text)
    findings: list[Finding] = []
    fields = field_index_types(src)
    functions = _differentiable_functions(src)
    kinds: dict[str, dict[str, str]] = {}  # function -> index kind -> an access shown
    vector_extensions = [
        (m.end(), _matching(src, m.end() - 1, "{", "}") % (len(src) + 1), m.group(1))
        for m in _VECTOR_EXTENSION.finditer(src)
    ]
    effects = helper_effects([(fn.name, fn.params, fn.body) for fn in functions])
    for fn in functions:
        tensors: dict[str, int] = {}
        read_write = []
        for p in fn.params:
            t = _INTERFACE_DIFF_TENSOR.search(p)
            words = re.findall(r"[A-Za-z_]\w*", p.split("=")[0])
            if t and words:
                tensors[words[-1]] = int(t.group(2))
                if t.group(1) == "RW":
                    read_write.append(words[-1])
        types = declared_index_types(fn.params, fn.body)

        def add(offset: int, kind: str, message: str) -> None:
            line = _line_of(src, fn.body_offset + offset)
            findings.append(Finding(file, line, fn.name, kind, message))

        for at, name, why in pre.uncertain:  # a macro that may hide a loop's condition
            if 0 <= at - fn.body_offset < len(fn.body):
                add(at - fn.body_offset, "macro-unexpanded", unexpanded_message(name, why))
        indexed = accesses(fn.body, tensors, types)
        for a in indexed:
            why = load_store_problem(a, {**fields, **types}) if a.op in ("load", "store") else None
            if why:
                fix = f"{a.tensor}[{scalar_form(a)}]" + (" = value" if a.op == "store" else "")
                add(
                    a.offset,
                    "interface-load-store",
                    f"'{show(a)}': its index is {why}; '.{a.op}' on an interface diff tensor "
                    "with an index that is not integer scalars gives all-zero gradients in "
                    f"SlangPy 0.43 bwds; use the subscript '{fix}', or a concrete DiffTensor "
                    "parameter",
                )
        spans = conditional_spans(fn.body) if indexed else []
        for a in indexed:
            where = next((w for s, e, w in spans if s <= a.offset < e), None)
            if where:
                add(
                    a.offset,
                    "conditional-interface-access",
                    f"'{show(a)}' runs only under {where}: SlangPy 0.43 bwds of an interface "
                    "diff tensor read or written under a condition never finishes compiling "
                    "(the Slang compiler loops; the process hangs); take the access out of the "
                    "condition and choose with select(c, a, b) (both sides evaluated), or "
                    "declare the parameter as a concrete DiffTensor/WDiffTensor",
                )
                break
        twice = store_then_access(fn.body, indexed)
        if twice:
            a, store, later = twice
            add(
                a.offset,
                "interface-store-then-access",
                f"'{store}' stores into the interface diff tensor '{a.tensor}', and "
                f"'{later}' uses '{a.tensor}' again further down: SlangPy 0.43 bwds of a "
                "second store to (or a read back of) an interface diff tensor after a "
                "subscript store never finishes compiling (memory grows by GBs; the process "
                "hangs); read what you need first, compute in locals and store each element "
                f"once, as the last use of '{a.tensor}', or declare the parameter as a "
                "concrete DiffTensor/WDiffTensor",
            )
        hit = generic_for_access(fn.body, indexed) if fn.generic else None
        if hit:
            add(hit[0], GENERIC_FOR, hit[1])
        back = None if twice else store_then_read(fn.body, read_write, effects)
        if back:
            add(back[0], READBACK, readback_message(*back[1:]))
        for loop in re.finditer(r"\b(for|while)\s*\(", fn.body):
            close = _matching(fn.body, loop.end() - 1, "(", ")")
            header = fn.body[loop.end() : close]
            after = fn.body[close + 1 :].lstrip()
            if loop.group(1) == "while" and not after.startswith(";"):
                short = re.search(r"&&|\|\||\?", header)
                if short:
                    op = short.group(0)
                    fix = f"'{op[0]}'" if op != "?" else "'select(c, a, b)'"
                    add(
                        loop.start(),
                        "while-short-circuit",
                        f"a while loop whose condition uses '{op if op != '?' else '?:'}' makes "
                        "SlangPy 0.43 bwds crash the process (a segfault in the Slang compiler); "
                        f"write the condition with {fix} (no short-circuit: all operands are "
                        "evaluated), or as a for loop: 'for (; cond; )'",
                    )
            if loop.group(1) == "while" and not after.startswith(";"):
                found = while_break(fn.body, loop.start(), close, set(types))
                if found:
                    add(found[0], "while-break", found[1])
            for name in tensors:
                if re.search(rf"\b{name}\s*\.\s*shape\b", header):
                    add(
                        loop.start(),
                        "loop-bound-reads-shape",
                        f"a differentiable loop whose condition reads '{name}.shape' makes "
                        f"SlangPy 0.43 bwds hang (the kernel never finishes); read it into a "
                        f"local first: 'int n = {name}.shape[0];' and loop to n",
                    )
                    break
        for loop in re.finditer(r"\bdo\s*\{", fn.body):
            found = do_while_break(fn.body, loop.end() - 1, set(types))
            if found:
                add(found[0], "do-while-break", found[1])
        params = fn.params
        vector_this = next((v for s, e, v in vector_extensions if s <= fn.body_offset < e), "")
        if vector_this:  # 'k * this' inside 'extension float3' promotes k like 'k * v'
            params = [*params, f"{vector_this} this"]
        for offset, message in promotions(params, fn.body):
            add(offset, "scalar-vector-promotion", message)
        ints = {n for n, t in types.items() if t in ("int", "uint")}
        for offset, kind, message in math_traps(fn.body, ints):
            add(offset, kind, message)
        scalar = [a for a in indexed if a.kind == "scalar"]
        array = [a for a in indexed if a.kind == "array"]
        for a in reversed(indexed):
            if a.kind:
                kinds.setdefault(fn.name, {})[a.kind] = show(a)
        if scalar and array:
            first = array[0]
            uint_loop = any(
                types.get(x.args[0].strip()) == "uint" and tensors[x.tensor] == 1 for x in array
            )
            fix = (
                "declare the loop counter / index as 'int'"
                if uint_loop
                else "index every interface tensor the same way: integer scalars "
                "(t[i], t[i, j]) everywhere, or int[N] arrays everywhere; or use concrete "
                "DiffTensor parameters"
            )
            add(
                first.offset,
                "mixed-index-kinds",
                f"'{show(first)}' (array/vector/uint index) and '{show(scalar[0])}' (integer "
                f"scalar index) in one differentiable function crash SlangPy 0.43 bwds "
                f"(segfault in the Slang compiler); {fix}",
            )
        for a in indexed:
            arg = a.args[0].strip() if len(a.args) == 1 else ""
            if types.get(arg) == "vector" or VECTOR_ORDER.match(arg):
                add(
                    a.offset,
                    "vector-index-order",
                    f"'{show(a)}': a vector index is read in reversed order (.x = last "
                    f"dimension; spy.grid's int2 is (column, row)) while int[N] is natural; "
                    f"prefer 'int[N]'",
                )
                break
    findings += _mixed_through_calls(src, file, functions, kinds)
    findings += _struct_interface_tensors(src, file)
    return findings


def _mixed_through_calls(
    src: str, file: str, functions: list[_Function], kinds: dict[str, dict[str, str]]
) -> list[Finding]:
    """Both index kinds reached from one differentiable function, one of them only in a
    function it calls (``h(w, int2(1, i)) + w[i, 0]``): .bwds segfaults as when both are in
    one body, since the backward kernel compiles them together."""
    reach = reached_kinds([(fn.name, fn.body) for fn in functions], kinds)
    bodies = {fn.name: fn for fn in functions}
    found = []
    for name, k in reach.items():
        own = kinds.get(name, {})
        if "scalar" in k and "array" in k and not ("scalar" in own and "array" in own):
            fn = bodies[name]
            found.append(
                Finding(
                    file,
                    _line_of(src, fn.body_offset),
                    name,
                    "mixed-index-kinds",
                    f"'{k['array']}' (array/vector/uint index) and '{k['scalar']}' (integer "
                    "scalar index) are both reached from this differentiable function, one "
                    "through a function it calls: SlangPy 0.43 bwds crashes (segfault in the "
                    "Slang compiler); index every interface tensor the same way: integer "
                    "scalars (t[i], t[i, j]) everywhere, or int[N] arrays everywhere, in the "
                    "helpers too; or use concrete DiffTensor parameters",
                )
            )
    return found


def _struct_interface_tensors(src: str, file: str) -> list[Finding]:
    """Functions taking a struct with an interface tensor field (ITensor, IDiffTensor, ...):
    SlangPy 0.43 segfaults building any call of them, forward included."""
    holders = interface_holders(src)
    found = []
    for m in _ANY_FUNCTION.finditer(src) if holders else ():
        held = [h for h in holders if re.search(rf"\b{h}\b", m.group(3))]
        if held and m.group(1) not in _KEYWORDS:
            why = (
                f"struct {held[0]} has an interface tensor field (ITensor/IDiffTensor/...): "
                "SlangPy 0.43 crashes the process building any call that passes it, the forward "
                "call included; declare the field with a concrete type (Tensor<float, N>, "
                "DiffTensor<float, N>, ...)"
            )
            kind = "struct-interface-tensor"
            found.append(Finding(file, _line_of(src, m.start(1)), m.group(1), kind, why))
    return found


class TrapMap(dict):
    """Function name -> the refusing findings of its backward; a generic's specialisation
    (``f<4>``, as SlangPy names it) finds those of ``f``, and a function in a namespace or
    struct (``A::f``, ``A::f<4>``, ``S<2>.f``) those of ``f`` (the scan keys functions by their own
    names, overloads and same-named functions of other namespaces merged)."""

    def get(self, name: str, default: list[Finding] | None = None) -> list[Finding] | None:
        for key in (name, generic_base(name), own_name(name)):
            if key in self:
                return self[key]
        return default


def affected_functions(
    source: str,
    findings: list[Finding],
    imported: tuple[str, ...] = (),
    defines: Defines | None = None,
) -> dict[str, list[Finding]]:
    """Map each differentiable function to the refusing findings its backward would hit (and
    those its forward mode would: ``Finding.wrong_jvp``; ``refusing`` tells them apart).

    A function inherits the findings of the differentiable functions it calls, in
    ``source`` or in the ``imported`` texts (already preprocessed); calls are matched by
    name, so a function reaching none of a finding's functions does not inherit it.
    """
    own: dict[str, list[Finding]] = {}
    for f in (f for f in findings if f.refuses_bwds or f.wrong_jvp or f.crashes_hvp):
        own.setdefault(f.function, []).append(f)
    bodies: dict[str, str] = {}
    for text in (preprocess(source, defines).text, *imported):
        for fn in _differentiable_functions(_strip_comments(text)):
            bodies[fn.name] = bodies.get(fn.name, "") + fn.body  # overloads: merged
    result = {name: list(own.get(name, [])) for name in bodies}
    for name, fs in own.items():  # not differentiable (a hand-written backward's): callers too
        result.setdefault(name, list(fs))
    changed = True
    while changed:
        changed = False
        for name, body in bodies.items():
            for callee, callee_findings in list(result.items()):
                if callee == name or not callee_findings:
                    continue
                if call_at(body, callee) >= 0:
                    for f in callee_findings:
                        if f not in result[name]:
                            result[name].append(f)
                            changed = True
    return {k: v for k, v in result.items() if v}


def no_diff_undecided(traps: dict, file: str, line: int, function: str, params: set) -> None:
    """Add to ``traps`` the refusal of ``function``'s ``.bwds``: definitions of as many
    parameters mark ``params`` ``no_diff`` in some and not in others (same-arity overloads,
    or both branches of an ``#if`` the scan cannot decide), so which gradient is right is
    unknown (before break48 the markings were merged: a gradient silently dropped)."""
    names = ", ".join(f"'{p}'" for p in sorted(params))
    why = (
        f"parameter(s) {names} are no_diff in one definition of {function}() and not in "
        "another of as many parameters: overloads SlangPy picks between by the values' "
        "types, or both branches of a preprocessor condition pydiff cannot decide (a macro "
        "neither the source nor the device's defines set). Which one runs, and so which "
        "gradient is right, pydiff cannot tell. Give the overloads different names (or "
        "define the macro in the source or the device's compiler defines)"
    )
    found = Finding(file, line, function, "no-diff-undecided", why)
    if found not in traps.setdefault(function, []):
        traps[function].append(found)


def refusing(findings: list[Finding] | None) -> bool:
    """Whether ``findings`` (a trap map's entry) refuse the function's ``.bwds``: those that
    refuse forward mode only leave its forward calls and ``.bwds`` to the generated kernels."""
    return any(getattr(f, "refuses_bwds", True) for f in findings or ())  # (other: refusing)


_scanned: dict[str, str] = {}  # file label -> source text, for modules compiled from a string


def scanned_source(file: str) -> str | None:
    """The source text last scanned under ``file`` (modules compiled from a string)."""
    return _scanned.get(file)
