"""Slang derivative rules that are wrong on part of their domain, for pydiff.lint: ``pow``
with a negative base (derivative 0, SlangPy 0.43.1: ``pow(x, 3.0)`` at x = -2 gives 0 where
12 is right) and ``fmod`` (derivative 0 with respect to the divisor, where
-trunc(a / b) is right). Measured against float64 finite differences (docs/traps.md).

    for offset, kind, message in math_traps(body, int_names): ...
"""

from __future__ import annotations

import re

from .lint_flow import matching
from .lint_index import split_top

POW_KIND = "pow-negative-base"  # refuses .bwds: a whole exponent, so a negative base is valid
POW_WARN_KIND = "pow-base-sign"  # a warning: the exponent is not a literal
FMOD_KIND = "fmod-divisor"
_CALL = re.compile(r"(?<![\w.])(pow|fmod)\s*\(")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?[fFhHlL]?"
_LITERAL = re.compile(rf"\s*(?:(?:float|half|double)\s*\(\s*({_NUMBER})\s*\)|({_NUMBER}))\s*")
# a base that cannot be negative (the rule is then right)
_NON_NEGATIVE = re.compile(r"\s*(?:abs|exp|exp2|sqrt|rsqrt|saturate|length)\s*\(")


def _literal(text: str) -> float | None:
    m = _LITERAL.fullmatch(text)
    return float((m.group(1) or m.group(2)).rstrip("fFhHlL")) if m else None


def _power(base: str, n: int) -> str:
    b = base if re.fullmatch(r"\s*[A-Za-z_]\w*\s*", base) else f"({base})"
    b = b.strip()
    if 1 <= abs(n) <= 4:
        product = " * ".join([b] * abs(n))
        return product if n > 0 else f"1.0 / ({product})"
    odd = "sign(" + base + ") * " if n % 2 else ""
    return f"{odd}pow(abs({base}), {float(n)})"


def _constant(arg: str, int_names: set[str]) -> bool:
    """Whether ``arg`` carries no derivative: a literal, an integer name, a no_diff(...)."""
    arg = arg.strip()
    return (
        _literal(arg) is not None
        or arg in int_names
        or re.match(r"no_diff\b", arg) is not None
        or re.fullmatch(r"u?int\s*\(.*\)", arg) is not None
    )


def math_traps(body: str, int_names: set[str]) -> list[tuple[int, str, str]]:
    """(offset, kind, message) for each ``pow`` whose base may be negative and each ``fmod``
    whose divisor carries a derivative, in ``body``."""
    out = []
    for m in _CALL.finditer(body):
        close = matching(body, m.end() - 1, "(", ")")
        args = split_top(body[m.end() : close]) if close > 0 else []
        if len(args) != 2:
            continue
        a, b = (x.strip() for x in args)
        shown = f"{m.group(1)}({a}, {b})"
        if m.group(1) == "fmod":
            if not _constant(b, int_names):
                out.append((m.start(), FMOD_KIND, _fmod_message(shown, a, b)))
            continue
        if _literal(a) is not None or _NON_NEGATIVE.match(a) or a in int_names:
            continue
        n = _literal(b)
        if n is not None and n != int(n):
            continue  # a negative base has no real value: NaN, derivative and value alike
        if n is not None:
            if n != 0:
                out.append((m.start(), POW_KIND, _pow_message(shown, a, int(n))))
        else:
            out.append((m.start(), POW_WARN_KIND, _pow_warning(shown, a)))
    return out


def _pow_message(shown: str, base: str, n: int) -> str:
    return (
        f"'{shown}': Slang's derivative of pow is 0 wherever the base is negative (SlangPy "
        f"0.43: d/dx pow(x, 3.0) at x = -2 is 0, not 12), though the value is right; write "
        f"'{_power(base, n)}' (its derivative is right for every sign of the base)"
    )


def _pow_warning(shown: str, base: str) -> str:
    return (
        f"'{shown}': Slang's derivative of pow is 0 wherever the base is negative (the value "
        f"is right for a whole exponent); if '{base}' can be negative with a whole-number "
        "exponent, write the product out or give the function a [BackwardDerivative]"
    )


def _fmod_message(shown: str, a: str, b: str) -> str:
    return (
        f"'{shown}': Slang's derivative of fmod with respect to the divisor '{b}' is 0 "
        f"(SlangPy 0.43; it is -trunc({a} / {b})); write the remainder as "
        f"'{a} - {b} * no_diff(trunc({a} / {b}))' (trunc is piecewise constant, so both "
        f"derivatives come out right), pass the divisor as no_diff({b}) if it needs none, "
        "or give the function a [BackwardDerivative]"
    )
