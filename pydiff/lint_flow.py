"""Control-flow and expression scans behind pydiff.lint: the loop a ``break`` leaves, implicit
scalar-to-vector promotion. Measured on SlangPy 0.43.1 (docs/traps.md, issue 15).

    own_breaks(body, body.index("{"))         # offsets of the loop's own breaks
    while_break(body, loop_start, header_close, {"k"})   # (offset, message) or None
    do_while_break(body, body.index("{", loop_start), {"k"})
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


def own_breaks(body: str, start: int) -> list[int]:
    """Offsets of the ``break``s of the loop whose body starts at ``start``, not those of a
    nested loop or switch."""
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
    return [i + b.start() for b in re.finditer(r"\bbreak\b", text)]


_LOOP_LOCAL = re.compile(r"\b([A-Za-z_]\w*)(?:\s*<[^<>;]*>)?\s+([A-Za-z_]\w*)\s*(?=[=;\[,])")
_ASSIGNED = re.compile(
    r"(?<![\w.])([A-Za-z_]\w*)\s*(?:\[[^\[\];]*\]|\.\s*\w+)*\s*(?:[-+*/%&|^]|<<|>>)?=(?!=)"
    r"|(?:\+\+|--)\s*([A-Za-z_]\w*)|(?<![\w.])([A-Za-z_]\w*)\s*(?:\+\+|--)"
)
_NOT_TYPES = {"return", "else", "break", "continue", "case", "goto", "do", "in", "out", "inout"}


def assigned_before_break(body: str, start: int, int_names: set[str]) -> tuple[int, str] | None:
    """(offset of the loop's own ``break``, a variable from outside the loop, not an integer,
    assigned before it in the iteration) for the loop body starting at ``start``; or None."""
    for brk in own_breaks(body, start):
        before = body[start:brk]
        local = {m.group(2) for m in _LOOP_LOCAL.finditer(before) if m.group(1) not in _NOT_TYPES}
        for m in _ASSIGNED.finditer(before):
            name = next(g for g in m.groups() if g)
            if name not in local and name not in int_names and name not in _NOT_TYPES:
                return brk, name
    return None


def while_break(body: str, loop: int, close: int, int_names: set[str]) -> tuple[int, str] | None:
    """The ``break`` of ``while (cond) {...}`` (starting at ``loop``, header closing at
    ``close``) that SlangPy 0.43 differentiates wrongly, with its message; None if right.

    Measured (tests/test_trap_oracle.py): the backward drops the breaking iteration's
    derivative when a variable from outside the loop (not an integer) is assigned before the
    ``break`` in that iteration. A guard first (``if (t > c) break; t = ...``), loop locals,
    integer counters, calls with ``inout`` arguments, ``for``, ``while (true)``,
    ``[ForceUnroll]``, ``continue`` and ``return`` are all right.
    """
    header = body[body.index("(", loop) + 1 : close].strip()
    attrs = body[max(0, loop - 80) : loop]
    if header in ("true", "1") or re.search(r"\[\s*ForceUnroll\s*\]\s*$", attrs):
        return None
    found = assigned_before_break(body, close + 1, int_names)
    if found is None:
        return None
    return found[0], (
        f"'break' inside 'while ({header})' after '{found[1]}' is assigned in the same "
        "iteration: SlangPy 0.43 bwds drops the breaking iteration's derivative (wrong "
        f"gradients, no error); write the loop as 'for (; {header}; )' (same body), or as "
        "'while (true)' with the condition as an 'if (...) break;'"
    )


def do_while_break(body: str, brace: int, int_names: set[str]) -> tuple[int, str] | None:
    """The ``break`` of ``do {...} while (cond);`` (body at ``brace``) that may crash SlangPy
    0.43, forward call included: measured on ``do { t = 1.5 * t + a; if (t > 5.3) break; }
    while (t < 100.0);``. Conservative: flagged whenever a variable from outside the loop is
    assigned before the ``break`` (some such variants, with an int counter, do build); a
    guard first and ``while (true)`` are right."""
    end = matching(body, brace, "{", "}")
    if end < 0 or re.match(r"\s*while\s*\(\s*(true|1)\s*\)", body[end + 1 :]):
        return None
    found = assigned_before_break(body, brace, int_names)
    if found is None:
        return None
    return found[0], (
        f"'break' inside a do {{ }} while loop after '{found[1]}' is assigned in the same "
        "iteration: SlangPy 0.43 can crash the process on it, even in a forward call (a "
        "segfault in the Slang compiler); write it as "
        "'[MaxIters(n)] for (;;) { ...; if (!(cond)) break; }' (same breaks)"
    )


_FLOAT_DECL = re.compile(r"\b(float|half|double)(\d?)\s+([A-Za-z_]\w*)\s*(?=[,;=)]|$)")
_LOCAL_INIT = re.compile(r"\b(?:float|half|double)1?\s+([A-Za-z_]\w*)\s*=\s*([^;,]*)[;,]")
_ONE = r"(?:[*/]\s*1(?:\.0*)?[fhl]?|[-+]\s*0(?:\.0*)?[fhl]?)"
_COPY = re.compile(rf"\(?\s*([A-Za-z_]\w*)\s*\)?\s*{_ONE}?\s*")
_LEFT = re.compile(  # lookaheads: 'a - s * v' must not consume 's'
    r"(?<![\w.])(\(\s*)?([A-Za-z_]\w*)(?=(\s*\))?\s*([-+*/])(?!=)\s*([A-Za-z_]\w*)\b(?!\s*[\[(.]))"
)
_RIGHT = re.compile(
    r"(?<![\w.])([A-Za-z_]\w*)(?=\s*([-+])(=)?(?!=)\s*(\(\s*)?([A-Za-z_]\w*)(\s*\))?(?![\w.\[(]))"
)


def _promoted(params: list[str], body: str) -> tuple[set[str], set[str]]:
    """(float scalars holding a parameter's value as it came, float vector names)."""
    scalars, vectors = set(), set()
    for p in params:
        m = _FLOAT_DECL.search(p)
        if m and "no_diff" not in p:
            (scalars if m.group(2) in ("", "1") else vectors).add(m.group(3))
    vectors |= {m.group(3) for m in _FLOAT_DECL.finditer(body) if m.group(2) not in ("", "1")}
    for m in _LOCAL_INIT.finditer(body):  # float t = s; float t = s * 1.0: still s itself
        copy = _COPY.fullmatch(m.group(2))
        if copy and copy.group(1) in scalars:
            scalars.add(m.group(1))
    return scalars, vectors


def _unary(body: str, at: int) -> bool:
    """Whether the + or - just before ``at`` is a unary sign."""
    prev = body[:at].rstrip()[:-1].rstrip()
    return not prev or prev[-1] in "=(,?:[{;" or re.search(r"\breturn$", prev) is not None


def promotions(params: list[str], body: str) -> list[tuple[int, str]]:
    """Implicit promotion of a float parameter (or a plain copy of it) to a vector: Slang's
    backward drops its derivative (issue 15). Measured: ``s op v`` for + - * /, ``v + s``,
    ``v - s``, ``v += s``, ``v -= s`` (``(s)`` too); ``v * s``, ``v / s``, ``*=``, ``/=``,
    ``floatN(s)``, ``float3 u = s;``, a float argument to a float3 parameter, and a computed
    scalar (``2.0 * s``, ``-s``, a value loaded from a tensor) are right."""
    body = fold_identities(body)
    scalars, vectors = _promoted(params, body)
    out = []
    for m in _LEFT.finditer(body):
        opened, s, closed, op, v = m.groups()
        if s not in scalars or v not in vectors or (closed and not opened):
            continue  # g(t, s) * v: not s alone
        # '(s * v)' (a parenthesis opened before s, not closed after it): s alone is promoted,
        # whatever stands before the parenthesis (2.0 * (s * v): ds = 0, measured)
        before = "(" if opened and not closed else body[: m.start()].rstrip()[-1:]
        if before and (
            before in "*/" or (before in "+-" and (op in "+-" or _unary(body, m.start())))
        ):
            continue  # (x * s) * v, -s * v: the scalar promoted is computed, not s itself
        out.append((m.start(), _message(f"{s} {op} {v}", s, v, f"floatN({s}) {op} {v}")))
    for m in _RIGHT.finditer(body):
        v, op, compound, opened, s, closed = m.groups()
        after = body[m.end(6) if closed else m.end(5) :].lstrip()[:1]
        if v not in vectors or s not in scalars or bool(opened) != bool(closed):
            continue
        if after and after in "*/" and not opened:
            continue  # v + s * 2.0: the scalar promoted is computed
        if compound and after != ";":
            continue  # v += s * 2.0
        shown = f"{v} {op}{'=' if compound else ''} {s}"
        fix = f"{v} {op}{'=' if compound else ''} floatN({s})"
        out.append((m.start(), _message(shown, s, v, fix)))
    return sorted(out)


def _message(shown: str, s: str, v: str, fix: str) -> str:
    return (
        f"'{shown}': the float '{s}' (a parameter, or a plain copy of one) is promoted "
        f"implicitly to the vector type of '{v}', and Slang's backward drops its derivative "
        f"(d{s} = 0, no error); write the splat explicitly: '{fix}'"
    )


def call_at(body: str, name: str, start: int = 0) -> int:
    """Offset of the first call of ``name`` in ``body`` from ``start`` (``name(``, with
    explicit generic arguments ``name<float>(`` or ``name<vector<float, 3>>(`` too, and
    the method forms ``a.name(``), or -1."""
    for m in re.finditer(rf"\b{re.escape(name)}\b", body[start:]):
        j = start + m.end()
        while j < len(body) and body[j] in " \t\r\n":
            j += 1
        if body.startswith("<", j):
            depth = 0
            for k in range(j, len(body)):
                ch = body[k]
                if ch in ";{}()&|=":  # a comparison, not generic arguments
                    break
                depth += (ch == "<") - (ch == ">")
                if depth == 0:
                    j = k + 1
                    break
            else:
                continue
            if depth:
                continue
            while j < len(body) and body[j] in " \t\r\n":
                j += 1
        if body.startswith("(", j):
            return start + m.start()
    return -1


_LIT = r"(?:(?:float|half|double)\s*\(\s*{v}\s*\)|{v}(?:[eE][-+]?0+)?[fFhHlL]?)(?![\w.])"
_L1 = _LIT.format(v=r"(?<![\w.])1(?:\.0*)?")
_L0 = _LIT.format(v=r"(?<![\w.])(?:0(?:\.0*)?|\.0+)")
_NAME = r"(?<![\w.])[A-Za-z_]\w*(?!\s*[\w.(\[])"
_FOLDS = [  # (pattern, group kept): identities Slang folds away before a promotion
    re.compile(rf"({_NAME})(\s*[*/]\s*{_L1})"),
    re.compile(rf"({_NAME})(\s*[-+]\s*{_L0})(?!\s*[*/])"),
    re.compile(rf"({_L1}\s*\*|{_L0}\s*\+)\s*(?={_NAME})"),
    re.compile(r"(?:(?<=[(=,?:])|(?<=\breturn))(\s*\+)(?=\s*[A-Za-z_(])"),  # unary plus
]


_PARENS = re.compile(r"\(\s*[A-Za-z_]\w*\s*\)")


def _unparen(m: re.Match) -> str:
    """``(s)`` -> `` s `` unless it is a call's argument list (``f(s)``)."""
    before = re.search(r"([\w)\]]*)\s*$", m.string[: m.start()]).group(1)
    if before and before not in ("return", "else", "if", "while", "switch"):
        return m.group(0)
    return " " + m.group(0)[1:-1] + " "


def _blank(m: re.Match, g: int) -> str:
    """The match with group ``g`` blanked, if removing it keeps the value."""
    if g == 1 and m.group(1)[-1] in "*+":  # '1.0 * s' or '0.0 + s': what is before it?
        prev = re.search(r"(?:(\w+)|(\S))?\s*$", m.string[: m.start()])
        word, ch = prev.group(1), prev.group(2)
        allowed = "(=,?:+{;[*-" if m.group(1)[-1] == "*" else "(=,?:+{;["
        if (word and word != "return") or (ch and not word and ch not in allowed):
            return m.group(0)  # 'a / 1.0 * s', 'a * 0.0 + s': not an identity
    start, end = m.start(g) - m.start(), m.end(g) - m.start()
    return m.group(0)[:start] + " " * (end - start) + m.group(0)[end:]


def fold_identities(body: str) -> str:
    """``body`` with the identities Slang folds away blanked out (offsets kept): ``s * 1.0``,
    ``s / 1.0``, ``s + 0.0``, ``s - 0.0``, ``1.0 * s``, ``0.0 + s``, a unary ``+s``; so that
    ``s * 1.0 * v`` or ``(s + 0.0) * v`` is seen as the promotion ``s * v`` it compiles to
    (issue 15: dS = 0 for both)."""
    for _ in range(8):
        new = _PARENS.sub(_unparen, body)
        for k, pat in enumerate(_FOLDS):
            group = 2 if k < 2 else 1
            new = pat.sub(lambda m, g=group: _blank(m, g), new)
        if new == body:
            return body
        body = new
    return body


def statement_end(body: str, i: int) -> int:
    """The offset just past the statement starting at ``i`` (a block, an ``if`` with its
    ``else``, a loop, or a simple statement up to its ``;``)."""
    i += len(body[i:]) - len(body[i:].lstrip())
    if body.startswith("{", i):
        end = matching(body, i, "{", "}")
        return end + 1 if end >= 0 else len(body)
    head = re.match(r"(if|for|while|switch)\s*\(", body[i:])
    if head:
        close = matching(body, i + head.end() - 1, "(", ")")
        if close < 0:
            return len(body)
        end = statement_end(body, close + 1)
        if head.group(1) == "if" and re.match(r"\s*else\b", body[end:]):
            end = statement_end(body, end + re.match(r"\s*else\b", body[end:]).end())
        return end
    depth = 0
    for k in range(i, len(body)):
        depth += body[k] in "([{"
        depth -= body[k] in ")]}"
        if depth < 0 or (body[k] == ";" and depth == 0):
            return k + 1
    return len(body)


def conditional_spans(body: str) -> list[tuple[int, int, str]]:
    """(start, end, what) of the parts of ``body`` that run only under a condition that is
    not a constant: the branches of ``if``/``else`` and ``switch``, the arms of ``?:``, the
    right operand of a short-circuit ``&&``/``||`` (to the end of its expression),
    everything after an ``if`` that can ``return``, and the rest of a loop's body after an
    ``if`` that can ``continue`` or ``break``. Loop bodies themselves are not counted."""
    spans = []
    loops = _loop_bodies(body)
    for m in re.finditer(r"\b(if|switch)\s*\(", body):
        close = matching(body, m.end() - 1, "(", ")")
        cond = body[m.end() : close].strip() if close > 0 else ""
        if close < 0 or cond in ("true", "1"):
            continue
        end = statement_end(body, m.start())
        spans.append((close + 1, end, f"'{m.group(1)} ({cond})'"))
        if m.group(1) == "if" and re.search(r"\breturn\b", body[close + 1 : end]):
            spans.append((end, len(body), f"the 'return' under 'if ({cond})'"))
        jump = re.search(r"\b(continue|break)\b", body[close + 1 : end])
        inside = [e for s, e in loops if s <= m.start() < e]
        if m.group(1) == "if" and jump and inside:
            spans.append((end, min(inside), f"the '{jump.group(1)}' under 'if ({cond})'"))
    for m in re.finditer(r"\?|&&|\|\|", body):
        depth, k = 0, m.end()
        while k < len(body):  # the arms (the right operand) end where the expression does
            depth += body[k] in "([{"
            depth -= body[k] in ")]}"
            if depth < 0 or (depth == 0 and body[k] in ";,"):
                break
            k += 1
        spans.append((m.end(), k, "a '?:'" if m.group(0) == "?" else f"a '{m.group(0)}'"))
    return spans


def _loop_bodies(body: str) -> list[tuple[int, int]]:
    """(start, end) of every ``for``/``while``/``do`` loop, its header included."""
    out = []
    for m in re.finditer(r"\b(for|while)\s*\(", body):
        close = matching(body, m.end() - 1, "(", ")")
        if m.group(1) == "while" and body[close + 1 :].lstrip().startswith(";"):
            continue  # the 'while' closing a do-loop: counted with its 'do'
        out.append((m.start(), statement_end(body, m.start())))
    for m in re.finditer(r"\bdo\s*\{", body):
        end = matching(body, m.end() - 1, "{", "}")
        out.append((m.start(), end + 1 if end >= 0 else len(body)))
    return out
