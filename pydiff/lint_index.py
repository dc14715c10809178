"""How a differentiable function indexes its *interface* diff tensors (IDiffTensor,
IWDiffTensor, IRWDiffTensor), for pydiff.lint: which index is a list of integer scalars
(``t[i]``, ``t[i, j]``, ``t.load(i, j)``) and which is one array/vector (``t[idx]`` with
``int[2] idx``, ``int2``, ``int1(i)``, a lone ``uint`` on a 1-D tensor). Measured on
SlangPy 0.43.1 (docs/traps.md).

    types = declared_index_types(["int i", "IRWDiffTensor<float, 1> t"], body)
    for a in accesses(body, {"t": 1}, types): print(show(a), a.kind, load_store_problem(a, types))
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .lint_flow import matching

_INT = r"(?:u?int|int32_t|uint32_t|int64_t|uint64_t|int16_t|uint16_t)"
_SCALAR_DECL = re.compile(rf"\b({_INT})\s+([A-Za-z_]\w*)\s*(\[\s*\w*\s*\])?")
_ARRAY_PARAM_DECL = re.compile(rf"\b{_INT}\s*\[\s*\w+\s*\]\s+([A-Za-z_]\w*)")
_VECTOR_DECL = re.compile(rf"\b({_INT}[1-4]|vector\s*<\s*{_INT}\s*,\s*\w+\s*>)\s+([A-Za-z_]\w*)")
_VECTOR_LET = re.compile(
    rf"\b(?:let|var)\s+([A-Za-z_]\w*)\s*(?::[^=;]*)?=\s*(?:{_INT}[1-4]\s*\(|vector\s*<|\{{)"
)
_VECTOR_CTOR = re.compile(rf"^\s*({_INT}[1-4]|vector\s*<[^>]*>|{_INT}\s*\[\s*\w*\s*\])\s*\(")
#: a vector index whose components are read in reversed order (int2 .. int4)
VECTOR_ORDER = re.compile(rf"^\s*({_INT}[2-4]|vector\s*<[^>]*>)\s*\(")
_IDENT = re.compile(r"^\s*([A-Za-z_]\w*)\s*$")
_ELEMENT = re.compile(r"^\s*[A-Za-z_]\w*\s*\[[^\[\],]*\]\s*$")  # idx[0]: one int element
_MEMBER = re.compile(r"[A-Za-z_][\w.\[\]]*\.\s*([A-Za-z_]\w*)\s*")
_SWIZZLE = re.compile(r"[xyzw]{1,4}|[rgba]{1,4}")
_STRUCT_BODY = re.compile(r"\bstruct\s+[A-Za-z_]\w*[^{;]*\{")
_INT_CALLS = {"int", "uint", "min", "max", "clamp", "abs", "select", "asint", "asuint"}


def split_top(text: str) -> list[str]:
    """``text`` split at its top-level commas (not inside <>, (), [] or {})."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "<([{":
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


def declared_index_types(params: list[str], body: str) -> dict[str, str]:
    """Variable name -> 'int', 'uint', 'array' or 'vector', from parameters and locals."""
    types: dict[str, str] = {}
    text = ", ".join(params) + "\n" + body
    for m in _SCALAR_DECL.finditer(text):
        unsigned = m.group(1).startswith("u")
        types[m.group(2)] = "array" if m.group(3) else ("uint" if unsigned else "int")
    for m in _ARRAY_PARAM_DECL.finditer(text):
        types[m.group(1)] = "array"
    for m in _VECTOR_DECL.finditer(text):
        types[m.group(2)] = "vector"
    for m in _VECTOR_LET.finditer(text):
        types[m.group(1)] = "vector"
    return types


def field_index_types(src: str) -> dict[str, str]:
    """'.field' -> 'int', 'uint', 'array' or 'vector', for the fields of the structs in
    ``src`` (a field name declared with two types counts as its non-scalar one)."""
    out: dict[str, str] = {}
    for m in _STRUCT_BODY.finditer(src):
        end = matching(src, m.end() - 1, "{", "}")
        fields = declared_index_types([], src[m.end() : end] if end > 0 else "")
        for name, kind in fields.items():
            if out.get("." + name, kind) == kind or kind in ("array", "vector"):
                out["." + name] = kind
    return out


def index_kind(args: list[str], dims: int, types: dict[str, str]) -> str | None:
    """'scalar', 'array' (one array/vector index), or None when it cannot be told."""
    if len(args) > 1:
        return "scalar"
    arg = args[0].strip()
    if arg.startswith("{") and arg.endswith("}"):  # {i} initialises an int; {i, j} an array
        inner = split_top(arg[1:-1])
        return index_kind(inner, dims, types) if len(inner) == 1 else "array"
    if _VECTOR_CTOR.match(arg):
        return "array"
    if re.fullmatch(r"\d+", arg) or re.match(r"^int\s*\(", arg) or _ELEMENT.match(arg):
        return "scalar"
    if re.match(r"^uint\s*\(", arg):
        return "array" if dims == 1 else "scalar"
    ident = _IDENT.match(arg)
    if ident:
        t = types.get(ident.group(1))
        if t == "int":
            return "scalar"
        if t == "uint":
            return "array" if dims == 1 else "scalar"
        if t in ("array", "vector"):
            return "array"
    return None


@dataclass
class Access:
    """One index of an interface diff tensor: ``t[...]``, ``t.load(...)``, ``t.store(..., v)``."""

    tensor: str
    op: str  # "[]", "load", "store"
    args: list[str]
    kind: str | None
    offset: int


def accesses(body: str, tensors: dict[str, int], types: dict[str, str]) -> list[Access]:
    """Every index of the ``tensors`` (name -> dimensions) in ``body``, in source order."""
    out = []
    for name, dims in tensors.items():
        for m in re.finditer(rf"\b{name}\s*(\[|\.\s*(load|store)\s*\()", body):
            if m.group(1) == "[":
                close = matching(body, m.end() - 1, "[", "]")
                op, args = "[]", split_top(body[m.end() : close])
            else:
                close = matching(body, m.end() - 1, "(", ")")
                op, args = m.group(2), split_top(body[m.end() : close])
                if op == "store":
                    args = args[:-1]
            if close < 0 or not args:
                continue
            out.append(Access(name, op, args, index_kind(args, dims, types), m.start()))
    return sorted(out, key=lambda a: a.offset)


def show(a: Access) -> str:
    """The access as written: ``t[i, j]``, ``t.load(k)``, ``t.store(k, ...)``."""
    inner = ", ".join(x.strip() for x in a.args)
    if a.op == "[]":
        return f"{a.tensor}[{inner}]"
    return f"{a.tensor}.load({inner})" if a.op == "load" else f"{a.tensor}.store({inner}, ...)"


def load_store_problem(a: Access, types: dict[str, str]) -> str | None:
    """Why the index of a ``.load``/``.store`` is not a list of integer scalars (SlangPy 0.43
    then gives all-zero gradients), or None. Refused: an array/vector variable, a vector or
    array constructor (``int1(i)``, ``int2(i, j)``), an initializer list ``{i, j}``, a name whose
    type the scanner cannot tell, a call of a function other than an integer built-in, and
    arithmetic on an array/vector variable. Integer expressions (``i + 1``, ``idx[0]``,
    ``id.x``) are fine."""
    if a.op == "[]" or a.kind == "scalar":
        return None
    if a.kind == "array":
        return "an array/vector index"
    arg = a.args[0].strip()
    if arg.startswith("{") and arg.endswith("}"):
        arg = arg[1:-1].strip()  # {i}: the scalar i
    if _IDENT.match(arg):
        return f"'{arg}', whose type the trap scanner cannot tell (not a declared int)"
    member = _MEMBER.fullmatch(arg)
    if member:  # idx.xy, s.idx: a swizzle or a field, scalar only where provably so
        name = member.group(1)
        if _SWIZZLE.fullmatch(name):
            return None if len(name) == 1 else f"the vector swizzle '{arg}'"
        if types.get("." + name) not in ("int", "uint"):
            return f"the field '{arg}', which is not declared as an integer scalar"
        return None
    for m in re.finditer(r"(?<![\w.])([A-Za-z_]\w*)\s*(\(|<)?", arg):
        name, call = m.group(1), m.group(2)
        if call and name not in _INT_CALLS:
            return f"a call of '{name}', which may build a vector/array index"
        after = arg[m.end(1) :].lstrip()[:1]
        if not call and after not in (".", "[") and types.get(name) in ("array", "vector"):
            return f"an expression on the array/vector '{name}'"
    return None


def scalar_form(a: Access) -> str:
    """The index of ``a`` as integer scalars where it is written as a constructor or an
    initializer list (``int1(i)``, ``{i, j}`` -> ``i``, ``i, j``; ``int2(i, j)`` -> ``j, i``,
    as a vector index's .x is the last dimension), else as written."""
    arg = ", ".join(x.strip() for x in a.args)
    m = _VECTOR_CTOR.match(arg)
    if m and arg.endswith(")"):
        parts = [x.strip() for x in split_top(arg[m.end() : -1])]
        if VECTOR_ORDER.match(arg):
            parts.reverse()  # a vector index's .x is the last dimension
        return ", ".join(parts)
    if arg.startswith("{") and arg.endswith("}"):
        return ", ".join(x.strip() for x in split_top(arg[1:-1]))
    return arg


_ASSIGN_AFTER = re.compile(r"\s*(?:(?:[-+*/%&|^]|<<|>>)?=(?!=)|\+\+|--)")


def statement_stop(body: str, i: int) -> int:
    """The offset of the ``;`` (or the closing brace) ending the statement around ``i``."""
    depth = 0
    for k in range(i, len(body)):
        depth += body[k] in "([{"
        depth -= body[k] in ")]}"
        if depth < 0 or (body[k] == ";" and depth == 0):
            return k
    return len(body)


def statement(body: str, at: int) -> str:
    """The statement around offset ``at``, whitespace collapsed, at most 60 characters."""
    start = max(body.rfind(c, 0, at) for c in ";{}") + 1
    text = " ".join(body[start : statement_stop(body, start)].split())
    return text if len(text) <= 60 else text[:57] + "..."


def store_then_access(body: str, indexed: list[Access]) -> tuple[Access, str, str] | None:
    """(the subscript store, its statement, the statement of the later use) where an
    interface diff tensor is stored by subscript assignment (``t[i] = v``, ``t[i] += v``) and
    then used again further down the function: read (``t[j]``, ``t.load(j)``), stored again
    (``t[j] = w``, ``t.store(j, w)``) or passed to a function (``g(t, j)``). SlangPy 0.43
    bwds never finishes compiling it (memory grows by GBs). Measured right, so not reported:
    reads in the store's own statement (``t[i] = t[i] * t[i]``), ``t.shape``, a
    ``t.store(...)`` or a helper's store followed by other stores (a read back after one is
    ``lint_readback``'s), and one subscript store
    as the tensor's last use."""
    for a in indexed:
        if a.op != "[]":
            continue
        close = matching(body, body.index("[", a.offset), "[", "]")
        if close < 0 or not _ASSIGN_AFTER.match(body, close + 1):
            continue
        use = re.compile(rf"(?<![\w.]){a.tensor}\b(?!\s*\.\s*(?!load\b|store\b)\w)")
        later = use.search(body, statement_stop(body, close + 1))
        if later:
            return a, statement(body, a.offset), statement(body, later.start())
    return None
