"""Control-flow and expression scans behind pydiff.lint: the loop a ``break`` leaves, implicit
scalar-to-vector promotion. Measured on SlangPy 0.43.1 (docs/traps.md, issue 15).

    own_break(body, body.index("{"))          # offset of the loop's own break, or -1
    promotions(["float s", "float3 v"], "{ return s * v; }")   # [(9, "'s * v': ...")]
"""

from __future__ import annotations

import re


def matching(src: str, start: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for i in range(start, len(src)):
        if src[i] == open_ch:
            depth += 1
        elif src[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    return -1


def own_break(body: str, start: int) -> int:
    """Offset of a ``break`` of the loop whose body starts at ``start``, not one of a nested
    loop or switch; -1 when none."""
    i = start + len(body[start:]) - len(body[start:].lstrip())
    block = body.startswith("{", i)
    text = body[i : matching(body, i, "{", "}") if block else body.find(";", i) + 1]
    nested = re.compile(r"\b(for|while|switch)\s*\(|\bdo\s*\{")
    pos = 1 if block else 0
    while (m := nested.search(text, pos)) is not None:
        end = matching(text, m.end() - 1, "(", ")") if m.group(1) else m.end() - 1
        rest = len(text) - len(text[end + 1 :].lstrip())  # the nested loop's own body
        stop = (
            matching(text, rest, "{", "}") if text.startswith("{", rest) else text.find(";", rest)
        )
        text = text[: m.start()] + " " * (stop + 1 - m.start()) + text[stop + 1 :]
        pos = stop + 1
    b = re.search(r"\bbreak\b", text)
    return i + b.start() if b else -1


_FLOAT_DECL = re.compile(r"\b(float|half|double)(\d?)\s+([A-Za-z_]\w*)\s*(?=[,;=)]|$)")
_PROMOTE = re.compile(r"\b([A-Za-z_]\w*)\s*(?=([-+*/])(?!=)\s*([A-Za-z_]\w*)\b(?!\s*[\[(.]))")


def promotions(params: list[str], body: str) -> list[tuple[int, str]]:
    """``s * v`` with a float scalar s left of a float vector v: Slang drops ds (issue 15)."""
    text = ", ".join(params) + ";\n" + body
    decl = {m.group(3): m.group(2) in ("", "1") for m in _FLOAT_DECL.finditer(text)}
    out = []
    for m in _PROMOTE.finditer(body):
        s, op, v = m.groups()
        if not decl.get(s) or decl.get(v) is not False:
            continue
        before = body[: m.start()].rstrip()[-1:]
        if before and (before in "*/" or (before in "+-" and op in "+-")):
            continue  # (x * s) * v: the left operand is not s alone
        out.append(
            (
                m.start(),
                f"'{s} {op} {v}': the float '{s}' is promoted implicitly to the vector type of "
                f"'{v}', and Slang's backward drops its derivative (d{s} = 0, no error); write "
                f"the splat explicitly: 'floatN({s}) {op} {v}' (or '{v} {op} {s}' where the "
                "order does not matter)",
            )
        )
    return out
