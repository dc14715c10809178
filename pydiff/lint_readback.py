"""Reads of an ``IRWDiffTensor`` after a store that is not a subscript assignment: a
``t.store(i, v)``, or a store inside a helper the tensor is passed to (``put(t, i, v)``),
followed by ``t[j]``, ``t.load(j)`` or a helper that reads it. SlangPy 0.43.1 builds the
backward, and it is wrong: the gradient through the stored value is halved (measured:
dx = 0.5 where 1.0 is right, no error). A subscript store followed by any use hangs the
compile instead (``lint_index.store_then_access``).

    effects = helper_effects([(name, params, body), ...])     # helper -> per-parameter ops
    hit = store_then_read(body, ["y"], effects)               # (offset, store, read) or None
"""

from __future__ import annotations

import re

from .lint_flow import matching
from .lint_index import split_top, statement, statement_stop

KIND = "interface-store-then-read"
_ASSIGN = re.compile(r"\s*(?:(?:[-+*/%&|^]|<<|>>)?=(?!=)|\+\+|--)")
_NOT_CALLS = {"if", "for", "while", "switch", "return", "no_diff", "detach"}
_TENSOR_PARAM = re.compile(r"\bI?(?:RW|W)?(?:Diff)?Tensor\s*<")
_BOTH = frozenset(("read", "write"))


def _enclosing_call(body: str, at: int, end: int) -> tuple[str, int] | None:
    """(callee, argument index) when ``body[at:end]`` is a whole argument of a call."""
    if body[:at].rstrip()[-1:] not in ("(", ",") or body[end:].lstrip()[:1] not in (",", ")"):
        return None
    depth = 0
    for k in range(at - 1, -1, -1):
        ch = body[k]
        if ch in ")]}":
            depth += 1
        elif ch in "([{":
            if depth == 0:
                if ch != "(":
                    return None
                name = re.search(r"([A-Za-z_]\w*)\s*(?:<[^<>;()]*>)?\s*$", body[:k])
                if name is None or name.group(1) in _NOT_CALLS:
                    return None
                return name.group(1), len(split_top(body[k + 1 : at] + "x")) - 1
            depth -= 1
        elif ch == ";" and depth == 0:
            return None
    return None


def uses(body: str, name: str, effects: dict[str, list[frozenset]]) -> list[tuple[int, str]]:
    """(offset, 'read' / 'write' / 'subscript-write') of every use of the tensor ``name``; a
    call passing it counts as what the callee does with that parameter (an unknown callee as
    both)."""
    out = []
    for m in re.finditer(rf"(?<![\w.]){re.escape(name)}\b", body):
        rest = body[m.end() :]
        sub = re.match(r"\s*\[", rest)
        member = re.match(r"\s*\.\s*([A-Za-z_]\w*)\s*(\()?", rest)
        if sub:
            close = matching(body, m.end() + sub.end() - 1, "[", "]")
            written = close > 0 and _ASSIGN.match(body, close + 1)
            out.append((m.start(), "subscript-write" if written else "read"))
        elif member:
            op = member.group(1)
            if op in ("store", "load"):
                out.append((m.start(), "write" if op == "store" else "read"))
            elif member.group(2):  # another method: may read or write
                out += [(m.start(), "read"), (m.start(), "write")]
        else:
            call = _enclosing_call(body, m.start(), m.end())
            if call:
                per_param = effects.get(call[0])
                ops = per_param[call[1]] if per_param and call[1] < len(per_param) else _BOTH
                out += [(m.start(), op) for op in sorted(ops)]  # "read" before "write"
    return out


def helper_effects(functions: list[tuple[str, list[str], str]]) -> dict[str, list[frozenset]]:
    """Per function name, per parameter: which of 'read'/'write' it does to a tensor passed
    there (through the helpers it calls too). Overloads are merged."""
    effects: dict[str, list[frozenset]] = {}
    for _ in range(8):  # call chains deeper than that are rare; unknown stays 'both'
        new: dict[str, list[frozenset]] = {}
        for name, params, body in functions:
            row = []
            for p in params:
                words = re.findall(r"[A-Za-z_]\w*", p.split("=")[0])
                if not words or not _TENSOR_PARAM.search(p):
                    row.append(frozenset())
                    continue
                ops = {e[1].replace("subscript-", "") for e in uses(body, words[-1], effects)}
                row.append(frozenset(ops))
            old = new.get(name, [])
            merged = [a | b for a, b in zip(old, row)] + row[len(old) :] + old[len(row) :]
            new[name] = merged
        if new == effects:
            break
        effects = new
    return effects


def store_then_read(
    body: str, tensors: list[str], effects: dict[str, list[frozenset]]
) -> tuple[int, str, str, str] | None:
    """(offset, tensor, the storing statement, the reading statement) for the first read-write
    interface tensor read back after a ``.store`` or a helper's store, any element (an
    element another thread stored loses its path too: ``put(y, i, v); ... y[(i + 1) % 4]``);
    reads inside the storing statement run before it and are fine."""
    for name in tensors:
        events = uses(body, name, effects)
        first = next((e for e in events if e[1] == "write"), None)
        if first is None:
            continue
        stop = statement_stop(body, first[0])
        later = next((e for e in events if e[1] == "read" and e[0] > stop), None)
        if later:
            return first[0], name, statement(body, first[0]), statement(body, later[0])
    return None


def readback_message(name: str, store: str, read: str) -> str:
    return (
        f"'{store}' stores into the interface diff tensor '{name}' (a '.store' or a helper's "
        f"store), and '{read}' reads '{name}' back further down: SlangPy 0.43 bwds of that "
        "read-back gives wrong gradients (the path through the stored value is halved); keep "
        f"the value in a local and use it ('float w = ...; {name}[i] = w; ... w'), or declare "
        "the parameter as a concrete DiffTensor"
    )
