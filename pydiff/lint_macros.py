"""The preprocessor pass of the trap scanner: ``#define`` macros expanded, ``#if`` branches
that can be decided dropped, line numbers kept, so that a loop condition or a ``break``
written through a macro is seen as the Slang compiler sees it (issue 15).

    pre = preprocess(source)              # Preprocessed: text, macros, uncertain, includes
    pre.text.count("\\n") == source.count("\\n")      # every line stays on its line

Object-like and function-like macros (``#x``, ``a ## b`` and ``__VA_ARGS__`` included) are
expanded with C's rules (a macro is not re-expanded inside its own expansion). An ``#if``
whose value depends only on macros the file (or the device) defines is decided; any other
keeps all its branches, as the Slang compiler might take either. A use the pass cannot expand
for certain (conflicting definitions in undecided branches, runaway expansion, an unclosed
argument list) whose definitions hold ``while``/``break``/``&&``/``||``/``?`` is listed in
``uncertain`` so the scanner can refuse conservatively.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*([A-Za-z_]\w*)?(.*)$")
_DEFINE = re.compile(r"([A-Za-z_]\w*)(\(([^)]*)\))?(.*)$", re.S)
_STRING = r'"(?:\\.|[^"\\\n])*"'


@functools.lru_cache(maxsize=64)
def _tokens(names: frozenset[str]) -> re.Pattern:
    """Strings (skipped) and the macro names ``names`` as words."""
    return re.compile(_STRING + r"|\b(?:" + "|".join(sorted(map(re.escape, names))) + r")\b")


_RISKY = re.compile(r"\b(while|break|do|for)\b|&&|\|\||\?")
_MAX_DEPTH = 64


@dataclass(frozen=True)
class Macro:
    """One ``#define``: ``params`` is None for an object-like macro."""

    body: str
    params: tuple[str, ...] | None = None
    alternatives: tuple[str, ...] = ()  # other bodies from branches that were not decided

    @property
    def risky(self) -> bool:
        """Whether a body could hide a loop condition or a ``break``."""
        return any(_RISKY.search(b) for b in (self.body, *self.alternatives))


@dataclass
class Preprocessed:
    """A source text after the pass: ``text`` has the same lines as the source."""

    text: str
    macros: dict[str, Macro]
    #: (offset in ``text``, macro name, why it could not be expanded for certain)
    uncertain: list[tuple[int, str, str]] = field(default_factory=list)
    #: (line, the file named) of each ``#include`` in a branch that may be compiled
    includes: list[tuple[int, str]] = field(default_factory=list)


#: Macros defined before a text's first line: a value, or a Macro
Defines = dict[str, "str | Macro"]
#: include(file named, macros defined so far) -> the macros defined after it, or None
IncludeMacros = Callable[[str, dict[str, Macro]], "dict[str, Macro] | None"]


def blank_comments(src: str) -> str:
    """Comments blanked out (newlines kept); strings kept, as ``#include "x"`` needs them."""

    def blank(m: re.Match) -> str:
        return m.group(0) if m.group(0).startswith('"') else re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', blank, src, flags=re.S)


def blank_comments_and_strings(src: str) -> str:
    """Comments and string contents blanked out, offsets and newlines kept."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', blank, src, flags=re.S)


def unexpanded_message(name: str, why: str) -> str:
    """What a finding of kind ``macro-unexpanded`` says."""
    return (
        f"macro '{name}' may hold a loop condition or a 'break', but the trap scanner cannot "
        f"expand it ({why}), so it cannot tell whether SlangPy 0.43 differentiates this "
        "function right (a while loop with '&&' or a 'break' can crash or give wrong "
        "gradients); write the loop without the macro, or define the macro once"
    )


def _logical_lines(src: str) -> list[tuple[str, int]]:
    """Lines with backslash-newline splices removed, as the compiler's first phase does
    (``whi\\<newline>le`` is ``while``): (text, how many source lines it spans)."""
    out, pending, span = [], "", 0
    for line in src.split("\n"):
        span += 1
        if line.rstrip(" \t\r").endswith("\\"):
            pending += line.rstrip(" \t\r")[:-1]
            continue
        out.append((pending + line, span))
        pending, span = "", 0
    if span:
        out.append((pending, span))
    return out


def _args(text: str, open_at: int) -> tuple[list[str], int] | None:
    """Arguments of a macro call whose '(' is at ``open_at``: (args, offset after ')')."""
    depth, start, args = 0, open_at + 1, []
    for i in range(open_at, len(text)):
        ch = text[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append(text[start:i])
                return args, i + 1
        elif ch == "," and depth == 1:
            args.append(text[start:i])
            start = i + 1
    return None


class _Expander:
    def __init__(self, macros: dict[str, Macro]):
        self.macros = macros
        self.uncertain: list[tuple[int, str, str]] = []
        self._why: list[tuple[str, str]] = []  # found below the top level of an expansion

    def top(self, text: str) -> str:
        """``text`` expanded; uses that cannot be expanded for certain go to ``uncertain``."""
        out, pos, length = [], 0, 0
        if not self.macros:
            return text
        token = _tokens(frozenset(self.macros))
        while (m := token.search(text, pos)) is not None:
            out.append(text[pos : m.start()])
            length += m.start() - pos
            piece, pos = self._one(text, m, frozenset(), 0)
            out.append(piece)
            self.uncertain += [(length, n, why) for n, why in self._why]
            self._why = []
            length += len(piece)
        out.append(text[pos:])
        return "".join(out)

    def expand(self, text: str, hidden: frozenset, depth: int) -> str:
        out, pos = [], 0
        token = _tokens(frozenset(self.macros))
        while (m := token.search(text, pos)) is not None:
            out.append(text[pos : m.start()])
            piece, pos = self._one(text, m, hidden, depth)
            out.append(piece)
        out.append(text[pos:])
        return "".join(out)

    def _one(self, text: str, m: re.Match, hidden: frozenset, depth: int) -> tuple[str, int]:
        """The expansion of the token ``m`` of ``text`` and the offset after what it used."""
        name, pos = m.group(0), m.end()
        macro = self.macros.get(name)
        if macro is None or name in hidden:
            return name, pos
        if macro.alternatives and macro.risky:
            self._unsure(name, "it is defined differently in #if branches that cannot be told")
        if depth >= _MAX_DEPTH:
            self._unsure(name, "its expansion does not end")
            return name, pos
        if macro.params is None:
            return self.expand(macro.body, hidden | {name}, depth + 1), pos
        after = len(text) - len(text[pos:].lstrip())
        if not text.startswith("(", after):
            return name, pos  # a function-like macro's name alone is not a call
        call = _args(text, after)
        if call is None:
            self._unsure(name, "its argument list does not close")
            return name, pos
        args, end = call
        body = self._substitute(macro, args, hidden, depth)
        lines = "\n" * text.count("\n", pos, end)  # keep the text after it on its line
        return self.expand(body, hidden | {name}, depth + 1) + lines, end

    def _unsure(self, name: str, why: str) -> None:
        if self.macros[name].risky:
            self._why.append((name, why))

    def _substitute(self, macro: Macro, args: list[str], hidden: frozenset, depth: int) -> str:
        params = list(macro.params or ())
        if params and params[-1] == "...":
            params[-1] = "__VA_ARGS__"
            args = args[: len(params) - 1] + [",".join(args[len(params) - 1 :])]
        values = {p: a.strip() for p, a in zip(params, args)}
        body = macro.body
        if not values:
            return body
        names = "|".join(re.escape(p) for p in values)

        def stringize(m: re.Match) -> str:
            return '"' + values[m.group(1)].replace("\\", "\\\\").replace('"', '\\"') + '"'

        body = re.sub(rf"(?<!#)#\s*\b({names})\b", stringize, body)

        def put(m: re.Match) -> str:
            pasted = body[: m.start()].rstrip().endswith("##") or body[
                m.end() :
            ].lstrip().startswith("##")
            value = values[m.group(1)]
            return value if pasted else self.expand(value, hidden, depth + 1)

        body = re.sub(rf"\b({names})\b", put, body)
        return re.sub(r"\s*##\s*", "", body)


def _eval_condition(expr: str, macros: dict[str, Macro], known: set[str]) -> bool | None:
    """The value of an ``#if`` expression, or None when it depends on a name not known."""

    def defined(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return ("1" if name in macros else "0") if name in known else "UNKNOWN"

    expr = re.sub(r"\bdefined\s*(?:\(\s*([A-Za-z_]\w*)\s*\)|([A-Za-z_]\w*))", defined, expr)
    for _ in range(8):  # object-like macros used as values
        new = re.sub(
            r"\b([A-Za-z_]\w*)\b",
            lambda m: (
                macros[m.group(1)].body
                if m.group(1) in macros
                and macros[m.group(1)].params is None
                and not macros[m.group(1)].alternatives
                else m.group(1)
            ),
            expr,
        )
        if new == expr:
            break
        expr = new
    expr = re.sub(r"\b(\d+)[uUlL]*\b", r"\1", expr)
    if re.search(r"[A-Za-z_]", expr):
        return None  # a name nobody defines here: the compiler may know it
    expr = expr.replace("&&", " and ").replace("||", " or ").replace("/", "//")
    expr = re.sub(r"!(?!=)", " not ", expr)
    if not re.fullmatch(r"[\d\s()+\-*/%<>=!andort]*", expr):
        return None
    try:
        return bool(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - digits and operators
    except Exception:  # noqa: BLE001 - an expression the pass cannot read: undecided
        return None


def preprocess(
    source: str, defines: Defines | None = None, include: IncludeMacros | None = None
) -> Preprocessed:
    """Run the pass over ``source``. ``defines``: macros defined before its first line (the
    device's ``-D`` values, or what an includer defined); ``include(name, macros)`` gives
    the macros an ``#include``d file leaves defined (None: it cannot be read)."""
    key = tuple(sorted((defines or {}).items()))
    if include is None:
        return _cached(source, key)
    hit = _recent.get((source, key, include))  # the same file, scanned and read for imports
    if hit is None:
        if len(_recent) >= 8:
            _recent.clear()
        hit = _recent[(source, key, include)] = _preprocess(source, defines, include)
    return hit


_recent: dict[tuple, Preprocessed] = {}


@functools.lru_cache(maxsize=256)
def _cached(source: str, defines: tuple) -> Preprocessed:
    return _preprocess(source, dict(defines), None)


def _preprocess(
    source: str, defines: Defines | None, include: IncludeMacros | None
) -> Preprocessed:
    table = {k: v if isinstance(v, Macro) else Macro(str(v)) for k, v in (defines or {}).items()}
    known = set(table)
    stack: list[tuple[bool | None, bool | None]] = []  # (this branch, an earlier one taken)
    result = Preprocessed("", table)
    out: list[str] = []
    chunk: list[str] = []
    expander = _Expander(table)

    def flush() -> None:
        if chunk:
            base = sum(len(s) for s in out)
            text = expander.top("\n".join(chunk) + "\n")
            result.uncertain += [(base + o, n, w) for o, n, w in expander.uncertain]
            expander.uncertain = []
            out.append(text)
            chunk.clear()

    def state() -> bool | None:
        if any(s is False for s, _ in stack):
            return False
        return None if any(s is None for s, _ in stack) else True

    line_no = 1
    for text, span in _logical_lines(blank_comments(source)):
        d = _DIRECTIVE.match(text)
        if d is None:
            chunk.append(text if state() is not False else "")
            chunk.extend([""] * (span - 1))
            line_no += span
            continue
        flush()
        kind, rest = d.group(1) or "", d.group(2).strip()
        if kind in ("if", "ifdef", "ifndef"):
            if kind == "if":
                value = _eval_condition(rest, table, known)
            else:
                name = rest.split()[0] if rest.split() else ""
                value = None if name not in known else ((name in table) == (kind == "ifdef"))
            stack.append((value, value))
        elif kind in ("elif", "else") and stack:
            _, taken = stack.pop()  # taken: True, False, or None (an undecided one before)
            value = _eval_condition(rest, table, known) if kind == "elif" else True
            if taken is True:
                value = False
            elif taken is None and value is True:
                value = None
            either = None if None in (taken, value) else False
            stack.append((value, True if True in (taken, value) else either))
        elif kind == "endif" and stack:
            stack.pop()
        elif kind == "define" and state() is not False:
            _define(rest, table, known, undecided=state() is None)
        elif kind == "undef" and state() is not False and rest:
            name = rest.split()[0]
            if state() is True:
                table.pop(name, None)
                known.add(name)
        elif kind == "include" and state() is not False:
            target = re.match(r'["<]([^">]+)[">]', rest)
            if target:
                result.includes.append((line_no, target.group(1)))
                defined = include(target.group(1), dict(table)) if include else None
                if defined is not None:
                    table.update(defined)
                    known.update(defined)
        out.append("\n" * span)
        line_no += span
    flush()
    result.text = "".join(out)[:-1]  # one newline per line: none after the last
    return result


def _define(rest: str, table: dict[str, Macro], known: set[str], undecided: bool) -> None:
    m = _DEFINE.match(rest)
    if m is None:
        return
    name, params = m.group(1), m.group(3)
    params_t = tuple(p.strip() for p in params.split(",") if p.strip()) if m.group(2) else None
    macro = Macro(m.group(4).strip(), params_t)
    old = table.get(name)
    if undecided and old is not None and old.body != macro.body:
        others = tuple(dict.fromkeys((*old.alternatives, old.body)))
        macro = Macro(macro.body, params_t, tuple(b for b in others if b != macro.body))
    table[name] = macro
    if not undecided:
        known.add(name)
