"""Find Slang patterns that SlangPy 0.43 differentiates wrongly or crashes on, before dispatch.

Each pattern was measured on SlangPy 0.43.1 (see docs/traps.md). Findings warn when a module
loads and make ``.bwds`` of an affected function raise ShaderTrapError instead of returning
zeros or taking the Python process down.

    findings = pydiff.lint.scan_source(open("layer.slang").read(), "layer.slang")
    for f in findings: print(f)          # layer.slang:12: in dense(): ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DIFF_ATTR = re.compile(r"\[\s*(Differentiable|BackwardDifferentiable)\s*(\([^)]*\))?\s*\]")
_IDENT_BEFORE_PAREN = re.compile(r"([A-Za-z_]\w*)\s*(<[^<>()]*>)?\s*\($")
_INTERFACE_DIFF_TENSOR = re.compile(r"\bI(RW|W)?DiffTensor\s*<")
_MULTI_DIM_INDEX = re.compile(r"\b(u?int\s*\[\s*[2-9]\s*\]|u?int[2-4])\s+[A-Za-z_]\w*")
_UINT_LOOP = re.compile(r"\bfor\s*\(\s*(uint|uint32_t)\s+[A-Za-z_]\w*")


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
        return self.kind != "vector-index-order"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: in {self.function}(): {self.message}"


def _strip_comments(src: str) -> str:
    """Blank out comments and string contents, keeping offsets and newlines."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', blank, src, flags=re.S)


def _matching(src: str, start: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for i in range(start, len(src)):
        if src[i] == open_ch:
            depth += 1
        elif src[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    return -1


def _split_params(params: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in params:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


@dataclass
class _Function:
    name: str
    params: list[str]
    body: str
    body_offset: int


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
        found.append(
            _Function(head.group(1), _split_params(src[paren + 1 : close]), src[brace:end], brace)
        )
    return found


def _line_of(src: str, offset: int) -> int:
    return src.count("\n", 0, offset) + 1


def scan_source(source: str, file: str = "<source>") -> list[Finding]:
    """All trap findings in one Slang source text, in source order."""
    src = _strip_comments(source)
    findings: list[Finding] = []
    for fn in _differentiable_functions(src):
        iface = []
        multi_dim_call = any(_MULTI_DIM_INDEX.search(p) for p in fn.params)
        for p in fn.params:
            words = re.findall(r"[A-Za-z_]\w*", p.split("=")[0])
            if _INTERFACE_DIFF_TENSOR.search(p) and words:
                iface.append(words[-1])

        def add(match_start: int, kind: str, message: str) -> None:
            line = _line_of(src, fn.body_offset + match_start)
            findings.append(Finding(file, line, fn.name, kind, message))

        for name in iface:
            for m in re.finditer(rf"\b{name}\s*\.\s*(load|store)\s*\(", fn.body):
                op = m.group(1)
                sub = f"{name}[idx]" if op == "load" else f"{name}[idx] = value"
                add(
                    m.start(),
                    "interface-load-store",
                    f"'{name}.{op}(...)' on an interface diff tensor gives all-zero gradients in "
                    f"SlangPy 0.43 bwds; use the subscript '{sub}' (or a concrete DiffTensor)",
                )
            for m in re.finditer(rf"\b{name}\s*\[([^\[\]]*)\]", fn.body):
                # Measured: fine in a 1-D call (the seed's linear layer), a segfault in bwds
                # when the call is batched over a multi-dimensional index (int[2], int2 ...).
                if "," in m.group(1) and multi_dim_call:
                    idx = m.group(1).strip()
                    add(
                        m.start(),
                        "multi-index-subscript",
                        f"'{name}[{idx}]' (several indices in one subscript) in a call over a "
                        f"multi-dimensional index crashed SlangPy 0.43 bwds (segfault); write "
                        f"'int at[{idx.count(',') + 1}] = {{{idx}}}; {name}[at]' instead",
                    )
        for p in fn.params:
            vec = re.search(r"\b(u?int[2-4])\s+([A-Za-z_]\w*)", p)
            if vec and re.search(rf"\[\s*{vec.group(2)}\s*[\].]", fn.body):
                add(
                    0,
                    "vector-index-order",
                    f"'{vec.group(1)} {vec.group(2)}' from spy.grid is in reversed order "
                    f"(.x = last dimension) while 'int[N]' is natural; a mix-up gave "
                    f"out-of-bounds atomic writes and a segfault in bwds. Prefer 'int[N] "
                    f"{vec.group(2)}'",
                )
        for m in _UINT_LOOP.finditer(fn.body):
            add(
                m.start(),
                "uint-loop-counter",
                "a 'uint' loop counter in a differentiable loop crashes SlangPy 0.43 bwds "
                "(segfault); declare the counter as 'int'",
            )
    return findings


def affected_functions(source: str, findings: list[Finding]) -> dict[str, list[Finding]]:
    """Map each differentiable function to the findings its backward would hit.

    A function inherits the findings of the differentiable functions it calls.
    """
    src = _strip_comments(source)
    own: dict[str, list[Finding]] = {}
    for f in (f for f in findings if f.refuses_bwds):
        own.setdefault(f.function, []).append(f)
    bodies = {fn.name: fn.body for fn in _differentiable_functions(src)}
    result = {name: list(own.get(name, [])) for name in bodies}
    changed = True
    while changed:
        changed = False
        for name, body in bodies.items():
            for callee, callee_findings in list(result.items()):
                if callee == name or not callee_findings:
                    continue
                if re.search(rf"\b{callee}\s*\(", body):
                    for f in callee_findings:
                        if f not in result[name]:
                            result[name].append(f)
                            changed = True
    return {k: v for k, v in result.items() if v}
