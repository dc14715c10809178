"""Which math intrinsics a device computes wrong on ``double`` values, measured once.

Vulkan's SPIR-V extended instructions (sin, exp, log, pow, ...) are defined for 16- and 32-bit
floats only; Slang emits them on doubles anyway, and what a driver does then is undefined:
Mesa's lavapipe returns 0 for sin, 1 for cos and denormal garbage for exp (sqrt and the
arithmetic are right; asin/atan/exp2 come out at float precision or worse). A module calling
one of them on a double is refused on such a device (``lint_double`` finds the calls). CUDA's
nvrtc computes them all in double but has no asinh, acosh or atanh of a double: a module
calling those is refused there too, instead of failing to compile with nvrtc's message.

    broken = broken_intrinsics(dev)       # frozenset({'sin', 'exp', ...}) on lavapipe
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import slangpy as spy

from .lint import Finding, TrapMap
from .lint_macros import Defines
from .lint_double import BINARY, OUT_PARAMS, UNARY, double_calls
from .lint_flow import matching
from .lint_atomics import ANY_FUNCTION, KEYWORDS
from .lint_index import split_top
from .lint_nodiff import own_name

#: Arguments measured at: away from special values, inside every domain (acosh: x + 1).
_X, _Y = 0.3741, 1.6180339887
_EXPECTED = {
    "sin": math.sin(_X), "cos": math.cos(_X), "tan": math.tan(_X), "asin": math.asin(_X),
    "acos": math.acos(_X), "atan": math.atan(_X), "exp": math.exp(_X), "exp2": 2.0**_X,
    "exp10": 10.0**_X, "sinpi": math.sin(math.pi * _X), "cospi": math.cos(math.pi * _X),
    "log": math.log(_X), "log2": math.log2(_X), "log10": math.log10(_X),
    "sinh": math.sinh(_X), "cosh": math.cosh(_X), "tanh": math.tanh(_X),
    "asinh": math.asinh(_X), "acosh": math.acosh(_X + 1.0), "atanh": math.atanh(_X),
    "sqrt": math.sqrt(_X), "rsqrt": 1.0 / math.sqrt(_X), "atan2": math.atan2(_X, _Y),
    "pow": _X**_Y, "powr": _X**_Y, "fmod": math.fmod(_Y, _X), "ldexp": _X * 2.0**_Y,
    "sincos": math.sin(_X) + 2.0 * math.cos(_X),  # both outs in one value: s + 2c
}  # fmt: skip
#: Relative error past which the result is not a double's: float precision is ~6e-8.
TOLERANCE = 1e-12


def _probe_source(names: list[str]) -> str:
    cases = []
    for i, n in enumerate(names):
        args = (
            "x + 1.0l"
            if n == "acosh"
            else "y, x"
            if n == "fmod"
            else "x, y"
            if n in BINARY
            else "x"
        )
        if n == "sincos":
            cases.append(f"case {i}: {{ double s, c; sincos(x, s, c); return s + 2.0l * c; }}")
        else:
            cases.append(f"case {i}: return {n}({args});")
    return (
        "double pydiff_double_probe(int k, double x, double y) {\n  switch (k) {\n  "
        + "\n  ".join(cases)
        + "\n  default: return 0.0l;\n  }\n}\n"
    )


def probe_intrinsics(device: Any, names: list[str]) -> dict[str, float | None]:
    """``names``' results, each None where the device's compiler has no double version of
    it (CUDA's nvrtc lacks asinh, acosh and atanh on doubles): a probe that fails to compile
    is split in halves until each failing name stands alone.

        probe_intrinsics(dev, ["sqrt", "asinh"])   # CUDA: {'sqrt': 0.6116..., 'asinh': None}
    """
    try:
        native = device.native.load_module_from_source(
            f"pydiff_double_probe_{'_'.join(names)}", _probe_source(names)
        )
        n = len(names)
        got = spy.Module(native).pydiff_double_probe(
            np.arange(n, dtype=np.int32), np.full(n, _X), np.full(n, _Y), _result="numpy"
        )
    except (spy.SlangCompileError, RuntimeError):  # (SlangPy compiles some at the first call)
        if len(names) == 1:
            return {names[0]: None}
        half = len(names) // 2
        return {**probe_intrinsics(device, names[:half]), **probe_intrinsics(device, names[half:])}
    return dict(zip(names, (float(v) for v in got)))


def measure(device: Any) -> dict[str, float | None]:
    """Each intrinsic's result on ``device`` (one kernel for all of them where it compiles),
    None for one the device cannot compile on doubles."""
    return probe_intrinsics(device, [*UNARY, *BINARY, *OUT_PARAMS])


def broken_intrinsics(device: Any) -> dict[str, float | None]:
    """The intrinsics ``device`` computes wrong on doubles, with what it returned (None: it
    does not compile them on doubles), measured once per device."""

    def probe() -> dict[str, float | None]:
        got = measure(device)
        return {
            name: value
            for name, value in got.items()
            if value is None or not abs(value - _EXPECTED[name]) <= TOLERANCE * abs(_EXPECTED[name])
        }

    return device.cached("pydiff.double_math.broken", probe)


def expected(name: str) -> float:
    return _EXPECTED[name]


def argument(name: str) -> str:
    """The probe's call of ``name`` (its arguments; sincos: what is compared)."""
    return {"acosh": f"{_X + 1.0}", "fmod": f"{_Y}, {_X}", "sincos": f"{_X}, s, c) -> (s + 2c"}.get(
        name, f"{_X}, {_Y}" if name in BINARY else f"{_X}"
    )


def findings(
    device: Any, source: str, file: str, defines: Defines | None = None, scan: Any = None
) -> list[Finding]:
    """A finding per function of ``source`` that calls (or reaches) an intrinsic ``device``
    computes wrong on doubles; the device is measured only when some function calls one.
    ``defines``: the device's macros (the source's ``#if`` branches follow them). A call of
    a generic with double arguments (``f<double>(x)``) counts as the calls of its definition
    written out for them. ``scan``: the module's ``lint_sources.ModuleScan``, whose imported
    files are read with it (a function of theirs it calls, a generic of theirs it calls with
    a double: ``import helpers; ... dsin(d)`` gave 0 on lavapipe, unseen)."""
    imported = list(zip(scan.files, scan.imported_texts)) if scan is not None else []
    if not any(_DOUBLE_ARGUMENT.search(text) for _, text in imported):
        imported = []  # (no double there: the module's own text decides, as fast as before)
    return _own_findings(device, source, file, defines, imported) + _specialised_calls(
        device, source, file, defines
    )


_SPECIALISED_CALL = re.compile(
    r"\b([A-Za-z_]\w*)\s*<([^<>;(){}]*\b(?:double[234]?(?:x[234])?|float64_t)\b[^<>;(){}]*)>\s*\("
)


def _specialised_calls(device: Any, source: str, file: str, defines: Any) -> list[Finding]:
    """Findings of the functions of ``source`` that call a generic with double arguments
    whose definition, written out for them, calls a broken intrinsic (direct callers)."""
    if not _SPECIALISED_CALL.search(source):
        return []
    found: list[Finding] = []
    seen: dict[str, list[Finding]] = {}
    for m in ANY_FUNCTION.finditer(source):
        if m.group(1) in KEYWORDS:
            continue
        brace = m.end() - 1
        end = matching(source, brace, "{", "}")
        for call in _SPECIALISED_CALL.finditer(source, brace, end if end > 0 else len(source)):
            name = f"{call.group(1)}<{call.group(2)}>"
            if name not in seen:
                text = _instantiated(source, name)
                own = _own_findings(device, text, file, defines) if text else []
                seen[name] = [f for f in own if f.function == call.group(1)]
            if seen[name]:
                line = source.count("\n", 0, call.start()) + 1
                message = f"calls {name}(), where {seen[name][0].message}"
                found.append(Finding(file, line, m.group(1), "double-intrinsic", message))
    return found


def _own_findings(
    device: Any, source: str, file: str, defines: Any, imported: list = ()
) -> list[Finding]:
    guessed: set[tuple[str, int]] = set()
    text, starts = source, [(1, file)]  # the files read together, from their first lines
    for name, other in imported:
        starts.append((text.count("\n") + 2, name))
        text += "\n" + other
    calls = double_calls(text, guessed, defines)
    if not calls:
        return []
    broken = broken_intrinsics(device)
    found = []
    for function, sites in calls.items():
        for line, name, origin in sites:
            if name not in broken:
                continue
            first, where = max(s for s in starts if s[0] <= line)
            via = "" if origin == function else f" (in {origin}(), which it calls)"
            guess = (
                "; the argument's type could not be inferred (a call of a generic or imported "
                "function, a let/var local set from one, a struct's member) and counts as a "
                "double in a function that uses doubles: if it is a float, give it its type "
                "(float y = ..., or float(...) around it)"
                if (origin, line) in guessed
                else ""
            )
            found.append(
                Finding(
                    where,
                    line - first + 1,
                    function,
                    "double-intrinsic",
                    (
                        f"{name}() of a double{via} does not compile on this device "
                        f"({device.adapter_name}: its compiler has no double {name}). "
                        if broken[name] is None
                        else f"{name}() of a double{via} returns wrong values on this device "
                        f"({device.adapter_name}: {name}({argument(name)}) gave "
                        f"{broken[name]!r}, not {expected(name)!r}; Vulkan defines it for "
                        "16/32-bit floats only). "
                    )
                    + f"Compute it in float (double({name}(float(x))), float precision) or with "
                    f"a series of your own in double{guess}",
                )  # fmt: skip
            )
    return found


def with_findings(traps: dict[str, list], found: list[Finding]) -> dict[str, list]:
    """A copy of ``traps`` (the trap scan's, shared through its cache) with ``found`` added."""
    merged = {name: list(fs) for name, fs in traps.items()}
    for f in found:
        merged.setdefault(f.function, []).append(f)
    return merged


_DOUBLE_ARGUMENT = re.compile(r"\b(?:double[234]?(?:x[234])?|float64_t)\b")


def _instantiated(source: str, name: str) -> str | None:
    """``source`` with the definition of the generic function a specialisation ``name``
    (``f<double>``, ``f<double, 3>``) calls written out for its arguments (each generic
    parameter's name replaced by its argument, in the definition's text): what the double
    scan reads to see the specialisation's double calls. None where it is not found once."""
    call = re.fullmatch(r"(?:.*::)?\s*([A-Za-z_]\w*)\s*<(.*)>\s*", name, re.S)
    if call is None:
        return None
    args = [a.strip() for a in split_top(call.group(2))]
    spans = []
    for m in re.finditer(rf"\b{re.escape(call.group(1))}\s*<", source):
        close = matching(source, m.end() - 1, "<", ">")
        paren = re.match(r"\s*\(", source[close + 1 :]) if close > 0 else None
        if paren is None:
            continue
        end = matching(source, close + paren.end(), "(", ")")
        body = re.match(r"\s*(?:where\b[^{};()]*)?\{", source[end + 1 :]) if end > 0 else None
        if body is None:
            continue  # a call, or a declaration without a body
        stop = matching(source, end + body.end(), "{", "}")
        start = max(source.rfind(c, 0, m.start()) for c in ";}]") + 1
        spans.append((start, m.end() - 1, close, stop))
    if len(spans) != 1 or spans[0][3] < 0:
        return None
    start, open_at, close, stop = spans[0]
    params = [
        re.match(r"\s*(?:let\s+)?([A-Za-z_]\w*)", p) for p in split_top(source[open_at + 1 : close])
    ]
    if len(params) != len(args) or None in params:
        return None
    text = source[start:open_at] + source[close + 1 : stop + 1]
    for p, a in zip(params, args):
        text = re.sub(rf"\b{p.group(1)}\b", a, text)
    return source[:start] + text + source[stop + 1 :]


class DoubleTraps(TrapMap):
    """The trap map of a module on ``device``, that also answers for a specialisation whose
    generic arguments are doubles (``f<double>``): the double scan cannot see, in the generic
    text, that ``sin(x)`` of a ``T x`` computes on a double there; here it reads the
    definition written out for the arguments (``_instantiated``), once per name."""

    def __init__(self, traps: dict, device: Any, source: str, file: str, defines: Any) -> None:
        super().__init__(traps)
        self.device, self.source, self.file, self.defines = device, source, file, defines
        self.specialised: dict[str, list[Finding]] = {}
        # (calls check ``if traps:`` first: a generic calling an intrinsic may have findings)
        self.generic = "<" in source and re.search(rf"\b({'|'.join(_EXPECTED)})\s*\(", source)

    def __bool__(self) -> bool:
        return len(self) > 0 or self.generic is not None

    def get(self, name: str, default: list[Finding] | None = None) -> list[Finding] | None:
        found = super().get(name, default)
        if "<" not in name or not _DOUBLE_ARGUMENT.search(name):
            return found
        if name not in self.specialised:
            text = _instantiated(self.source, name)
            own = own_name(name)
            extra = _own_findings(self.device, text, self.file, self.defines) if text else []
            known = {(f.line, f.message) for f in found or ()}
            self.specialised[name] = [
                f for f in extra if f.function == own and (f.line, f.message) not in known
            ]
        extra = self.specialised[name]
        return [*(found or []), *extra] if extra else found
