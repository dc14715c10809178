"""Calls over a grid that read elements of a tensor other threads write: races refused.

``void shift(int2 px, IRWDiffTensor<float, 2> x) { x[px.y, px.x] = x[px.y, px.x + 1]; }``
called as ``m.shift(spy.grid(shape), x)`` reads ``x[i, j + 1]`` while the thread of
(i, j + 1) stores it: whether the load sees the value before the call or after depends on
the device's order of threads (lavapipe happens to give the former, a GPU need not). One
read-and-written parameter cannot be given a copy to read (its loads and stores are one
SlangPy tensor, and an in-place function may mean to read its own stores), so such a call
is refused, naming the parameter and two threads that race, with the way out: read from a
parameter of its own (``ITensor``/``IDiffTensor``) given a copy, or the very tensor (then
pydiff reads a copy taken before the call: ``view_overlap.copy_racing_reads``).

The function's text says which elements each thread loads and stores: every mention of the
parameter is a subscript ``x[a, b]`` whose indices are integer expressions (``+ - * / %``,
``min``, ``max``, ``clamp``, ``abs``) of the grid index's components and of locals set once
from them, or the grid index itself (``x[px]``, beside no other form). Those are evaluated for
every thread of the grid (NumPy, once per function, grid and tensor shape) and compared: a
load of an element another thread stores, or an element two threads store, is a race. A
function pydiff cannot read that way (the tensor passed to a helper, an index it cannot
evaluate, an overload, an ``#include``) is refused too, saying so: its race cannot be ruled
out.

    refuse_grid_races(fn, bound, fn.label)     # ValueError naming the parameter
"""

from __future__ import annotations

import ast
import re
from typing import Any

import numpy as np

from .grid_args import index_type, is_grid
from .lint_atomics import ANY_FUNCTION, KEYWORDS
from .lint_flow import matching
from .lint_index import split_top
from .lint_macros import blank_comments_and_strings, preprocess
from .signature import FunctionTarget, overloaded

_CACHE: dict[tuple, str | None] = {}
_CACHE_MAX = 256
_MAX_THREADS = 1 << 24  # (larger grids are not enumerated: refused as unknown)
_AXES = "xyz"
_LOCAL = re.compile(r"\b(?:const\s+)?(?:u?int|let|var)\s+(\w+)\s*=\s*([^;{}]+);")
_ASSIGNED = r"\s*(?:[-+*/%&|^]|<<|>>)?=(?!=)|\s*\+\+|\s*--"
_CHAIN = r"(?:\s*\.\s*\w+|\s*\[[^\[\]]*\]|\s*\))*"  # (members, subscripts: px.x, px[0])
_FUNCS = {"min": np.minimum, "max": np.maximum, "abs": np.abs}


class _Unknown(Exception):
    """An index the scan cannot evaluate (the reason)."""


def refuse_grid_races(fn: FunctionTarget, bound: list, where: str) -> None:
    """Refuse a call over a grid of ``fn`` (``bound``: its (ParamInfo, value) pairs) that
    reads, at a read-and-written tensor parameter, an element another thread stores."""
    grids = [(p, v) for p, v in bound if is_grid(v)]
    if len(grids) != 1:
        return
    rw = [
        (p, v)
        for p, v in bound
        if p.tensor_kind is not None and p.access == "read_write" and hasattr(v, "storage")
    ]
    if not rw:
        return
    gp, grid = grids[0]
    # (as_tuple(): tuple(grid.stride) iterated the Shape through nanobind, ~1.7 us each of
    # the cached check's ~5 us per call)
    at = (grid.shape.as_tuple(), grid.stride.as_tuple(), grid.offset.as_tuple())
    for p, t in rw:
        key = (id(fn), fn.module.source, gp.name, at, p.name, tuple(t.shape))
        if key not in _CACHE:
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.clear()
            _CACHE[key] = _verdict(fn, gp, grid, p.name, tuple(t.shape))
        if (why := _CACHE[key]) is not None:
            raise ValueError(
                f"{where}: parameter '{p.name}' (shape {tuple(t.shape)}) is read and written "
                f"by the call over a grid of shape {tuple(grid.shape.as_tuple())}, and {why}. "
                "Read the values from a parameter of its own (ITensor/IDiffTensor) given a "
                f"copy ({p.name}.detach().clone()), or the very tensor (pydiff then reads a "
                "copy taken before the call), and write them at this one"
            )


def _verdict(fn: FunctionTarget, gp: Any, grid: Any, name: str, shape: tuple) -> str | None:
    """None where no thread loads an element another stores, else why (a race, or why the
    text cannot tell)."""
    try:
        return _races(fn, gp, grid, name, shape)
    except _Unknown as exc:
        return (
            f"pydiff cannot tell which of its elements each thread loads and stores ({exc}), "
            "so a load of an element another thread stores (a race) cannot be ruled out"
        )


def _body(fn: FunctionTarget) -> str:
    """The one top-level definition's body of ``fn``, comments and strings blanked."""
    source = fn.module.source
    if overloaded(fn):
        raise _Unknown("its source is not one definition pydiff reads")
    pre = preprocess(source)
    if pre.includes or pre.uncertain or any(m.alternatives for m in pre.macros.values()):
        raise _Unknown("its source has an #include or a macro defined in several ways")
    text = blank_comments_and_strings(pre.text)
    bodies = []
    for m in ANY_FUNCTION.finditer(text):
        if m.group(1) == fn.name and m.group(1) not in KEYWORDS:
            if text.count("{", 0, m.start()) != text.count("}", 0, m.start()):
                raise _Unknown("it is defined inside a namespace or struct")
            end = matching(text, m.end() - 1, "{", "}")
            bodies.append(text[m.end() : end] if end > 0 else None)
    if len(bodies) != 1 or bodies[0] is None:
        raise _Unknown("its source is not one definition pydiff reads")
    return bodies[0]


def _races(fn: FunctionTarget, gp: Any, grid: Any, name: str, shape: tuple) -> str | None:
    if fn.module.source is None:
        return None  # (pydiff's own library, whose kernels its tests check; no text to read)
    body = _body(fn)
    array = re.fullmatch(r"u?int\s*\[\s*([1-3])\s*\]", gp.type_name.strip())
    dims = int(array.group(1)) if array else index_type(gp.type_name)[1]
    sizes = [int(n) for n in grid.shape.as_tuple()]
    if not 1 <= dims <= 3 or len(sizes) != dims or min(sizes, default=0) < 0:
        raise _Unknown("a grid whose sizes the call decides")
    if int(np.prod(sizes)) > _MAX_THREADS:
        raise _Unknown(f"a grid of more than {_MAX_THREADS} threads")
    loads, stores = _subscripts(body, name, len(shape), gp.name)
    if not loads or not stores:
        return None  # (only loaded, or only stored, by the call: no load races a store)
    # each thread's grid index: a grid (H, W) gives the thread of row i, column j (j, i)
    ids = np.indices(sizes).reshape(dims, -1).astype(np.int64)
    ids = ids * np.asarray(list(grid.stride), np.int64)[:, None]
    ids += np.asarray(list(grid.offset), np.int64)[:, None]
    names = [f"{gp.name}.{_AXES[dims - 1 - a]}" for a in range(dims)] if dims > 1 else [gp.name]
    names = [f"{gp.name}[{a}]" for a in range(dims)] if array else names  # (int[3]: in order)
    env = dict(zip(names, ids))
    env = _locals(body, gp.name, env)
    own = np.arange(ids.shape[1], dtype=np.int64)
    if {text for text, _ in loads} <= {text for text, _ in stores} and not _evaluable(stores, env):
        return None  # (each load at the very index of a store: the thread's own element)
    forms = {index is None for _, index in loads + stores}
    if forms == {True}:  # (x[px] alone: each thread its own element)
        return None
    if True in forms:
        raise _Unknown(f"'{name}' is indexed by the grid index and by components too")

    def flat(index: list) -> tuple[np.ndarray, np.ndarray]:
        parts = [np.broadcast_to(_evaluate(i, env), own.shape) for i in index]
        inside = np.all([(v >= 0) & (v < n) for v, n in zip(parts, shape)], axis=0)
        return np.ravel_multi_index([np.where(inside, v, 0) for v in parts], shape), inside

    owner = np.full(int(np.prod(shape)), -1, np.int64)
    for _, index in stores:
        elem, inside = flat(index)
        elem, thread = elem[inside], own[inside]
        other = owner[elem]
        clash = (other >= 0) & (other != thread)
        if clash.any():
            k = int(np.argmax(clash))
            return (
                f"threads {_thread(int(other[k]), sizes)} and {_thread(int(thread[k]), sizes)} "
                f"both store its element {tuple(int(v) for v in np.unravel_index(elem[k], shape))}"
                " (a race)"
            )
        pairs = np.unique(np.stack([elem, thread]), axis=1)  # (sorted by element)
        same = np.flatnonzero(pairs[0, 1:] == pairs[0, :-1])
        if same.size:
            (e, a), b = pairs[:, same[0]], pairs[1, same[0] + 1]
            return (
                f"threads {_thread(int(a), sizes)} and {_thread(int(b), sizes)} both store its "
                f"element {tuple(int(v) for v in np.unravel_index(e, shape))} (a race)"
            )
        owner[elem] = thread
    for text, index in loads:
        elem, inside = flat(index)
        writer = np.where(inside, owner[elem], -1)
        race = (writer >= 0) & (writer != own)
        if race.any():
            k = int(np.argmax(race))
            return (
                f"thread {_thread(k, sizes)} loads its element "
                f"{tuple(int(v) for v in np.unravel_index(elem[k], shape))} ({name}[{text}]), "
                f"which thread {_thread(int(writer[k]), sizes)} stores (a race: the value "
                "loaded depends on the device's order of threads)"
            )
    return None


def _evaluable(stores: list, env: dict) -> bool:
    """Whether every store's index evaluates (else which threads share one is not known:
    the loads at those very indices are each thread's own element, the only case kept)."""
    try:
        for _, index in stores:
            for i in index or ():
                _evaluate(i, env)
    except _Unknown:
        return False
    return True


def _thread(k: int, sizes: list) -> tuple:
    return tuple(int(v) for v in np.unravel_index(k, sizes))


def _subscripts(body: str, name: str, dims: int, grid: str) -> tuple[list, list]:
    """The loads and stores of ``name`` in ``body`` (``x[i, j]``, ``x.load({i, j})``,
    ``x.store({i, j}, v)``): (index text, [index expressions]) each, the expressions None for
    the grid index itself (``x[px]``). Its sizes (``x.dim(0)``, ``x.shape``) are neither."""
    loads, stores = [], []
    for m in re.finditer(rf"(?<![\w.])\b{re.escape(name)}\b", body):
        after = body[m.end() :]
        method = re.match(r"\s*\.\s*(\w+)\s*(\()?", after)
        if method and method.group(1) in ("dim", "shape", "dims"):
            continue
        if method and method.group(1) in ("load", "store") and method.group(2):
            at = m.end() + method.end() - 1
            end = matching(body, at, "(", ")")
            args = split_top(body[at + 1 : end]) if end > 0 else []
            if not args:
                raise _Unknown(f"a {method.group(1)} of '{name}' pydiff cannot read")
            text = re.sub(r"\s+", "", args[0])
            parts = split_top(text[1:-1]) if text[:1] == "{" and text[-1:] == "}" else [text]
            kind = method.group(1)
        else:
            at = m.end() + len(after) - len(after.lstrip())
            if at >= len(body) or body[at] != "[":
                raise _Unknown(f"'{name}' is used other than by subscripts (x[i, j])")
            end = matching(body, at, "[", "]")
            if end < 0:
                raise _Unknown(f"a subscript of '{name}' pydiff cannot read")
            text = re.sub(r"\s+", "", body[at + 1 : end])
            parts = split_top(text)
            rest = body[end + 1 :]
            kind = (
                "store"
                if re.match(r"\s*=(?!=)", rest)
                else "both"
                if re.match(_ASSIGNED, rest)
                else "load"
            )
        index = parts if len(parts) == dims else None
        if index is None and (len(parts) != 1 or text != grid):
            raise _Unknown(f"'{name}' indexed by '{text}', which pydiff does not evaluate")
        entry = (text, index)
        if kind in ("store", "both"):
            stores.append(entry)
        if kind in ("load", "both"):
            loads.append(entry)
    return loads, stores


def _locals(body: str, grid: str, env: dict) -> dict:
    """``env`` with the locals set once (and never again) from evaluable expressions; the
    grid index itself must never be assigned."""
    if re.search(rf"(?<![\w.])(?:\+\+|--)[\s(]*{grid}\b|\b{grid}\b{_CHAIN}(?:{_ASSIGNED})", body):
        raise _Unknown(f"the grid index '{grid}' is assigned")
    env = dict(env)
    for m in _LOCAL.finditer(body):
        local = m.group(1)
        writes = re.findall(
            rf"(?<![\w.])(?:\+\+|--)[\s(]*{local}\b|\b{local}\b{_CHAIN}(?:{_ASSIGNED})", body
        )
        decls = [d for d in re.findall(rf"(?<![\w.])(\w+)\s+{local}\b", body) if d not in KEYWORDS]
        if len(writes) != 1 or len(decls) != 1 or local in env:
            env[local] = None  # (set more than once: not one value per thread)
            continue
        try:
            env[local] = _evaluate(m.group(2), env)
        except _Unknown:
            env[local] = None
    return env


def _evaluate(text: str, env: dict) -> np.ndarray:
    """An integer index expression over every thread (C's ``/`` and ``%``: toward zero)."""
    try:
        tree = ast.parse(text.replace("&&", " and ").replace("||", " or "), mode="eval").body
    except SyntaxError:
        raise _Unknown(f"the index '{text}'") from None

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return np.int64(node.value)
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            key = ast.unparse(node)
            if env.get(key) is None:
                raise _Unknown(f"'{key}' in the index '{text}'")
            return env[key]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            op = type(node.op)
            if op in (ast.Add, ast.Sub, ast.Mult):
                return a + b if op is ast.Add else a - b if op is ast.Sub else a * b
            if op in (ast.Div, ast.Mod) and np.all(b != 0):
                q = np.trunc(np.asarray(a, np.float64) / b).astype(np.int64)
                return q if op is ast.Div else a - q * b
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            args = [ev(a) for a in node.args]
            if node.func.id in ("min", "max") and len(args) == 2:
                return _FUNCS[node.func.id](*args)
            if node.func.id in ("int", "uint") and len(args) == 1:
                return args[0]
            if node.func.id == "abs" and len(args) == 1:
                return np.abs(args[0])
            if node.func.id == "clamp" and len(args) == 3:
                return np.minimum(np.maximum(args[0], args[1]), args[2])
        raise _Unknown(f"the index '{text}'")

    return np.asarray(ev(tree), np.int64)
