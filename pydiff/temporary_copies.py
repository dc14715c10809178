"""In-place writes of a copy nothing else holds: ``x[1:3].fill(3.0)``. pydiff's indexing and
``x.T`` return copies (never views, unlike PyTorch), so such a write could never be seen:
``x`` keeps its values and the written copy dies with the call. The in-place methods refuse
it (``TypeError`` naming the method and ``x[key] = value``); a named copy (``y = x[1:3];
y.fill(0)``) is written as any tensor.

How a temporary is told from a named copy: ``mark`` notes, when the copy is made, how many
references it has (the tape's records of it, if any, and the one local and call that hold it
then); ``refuse``, called first thing in the in-place method, counts again from the same depth
of calls. A temporary has exactly as many (the caller's evaluation stack handed its reference
to the method's ``self``); a named copy has one more per name, list, ... holding it. The
holders pydiff adds later only add references (a named copy is never refused for them); a
tape that forgot its recording dropped its references, and its copies' producer changed, so
those are not compared. Calibrated on this interpreter at import (``ENABLED``): where a
temporary and a named object count alike (a Python that borrows references), nothing is
refused. The in-place methods return ``self``: where the caller uses the result (``t =
x[1:3].fill(3.0)``, ``f(x[1:3].zero_())``, ``x[1:3].fill(1).numpy()``) the written copy is
seen, so only a call whose result the caller's next instruction drops (``POP_TOP``, or the
REPL's ``PRINT_EXPR``, a store to ``_``) is refused (``_dropped``: read from the caller's bytecode).

Rows that iterating a tensor gives (``for row in x: row.fill(0)``, ``a, b = x``) are copies
too, but named, so counts cannot tell: ``mark_row`` notes their storage, and every in-place
write to it (the methods above, ``row += v``, a shader call writing it) is refused, views of
the row (``row.reshape(...)``, ``row.detach()``) included; ``row.clone()`` is a copy of its own.

    t = _Take.apply(x, where); mark(t, f"x[{key!r}]")      # in getitem
    refuse(self, "fill")                                    # first thing in Tensor.fill
    mark_row(row, i, x.shape)                               # in Tensor.__iter__
"""

from __future__ import annotations

import dis
import inspect
import sys
import weakref
from typing import Any

#: Marked copies by id: (weak reference, references at marking, id of the producer then, what
#: made it). By id, with the reference checked: tensors refuse ``==``.
_MARKS: dict[int, tuple[weakref.ref, int, int, str]] = {}
#: Whether this interpreter's reference counts tell a temporary from a named object.
ENABLED = True
#: References a slot call (``x[1:3][0] = v``: ``__setitem__`` called by the interpreter, the
#: arguments not handed over) adds to a method call's, measured at import.
SLOT_EXTRA = 0
#: References a shader function's call adds to a fresh mark's, for a positional argument
#: (``m.f(x[1:3])``) and a keyword one (``m.f(y=x[1:3])``: ``refuse_written``), measured at
#: import; None: not told apart here (nothing refused).
CALL_EXTRA: tuple[int, int] | None = None
#: Storages of rows iteration gave, by id: (weak reference, the row's index, the shape of the
#: iterated tensor). By id, with the reference checked.
_ROWS: dict[int, tuple[weakref.ref, int, tuple]] = {}


def mark(t: Any, what: str) -> None:
    """Note that ``t`` (a local of the caller, returned next) is a copy made by ``what``
    (``"x[1:3]"``, ``"x.T"``). Call it as ``mark(t, ...)`` with ``t`` held by one local."""
    if not ENABLED or _traced():
        return
    count = sys.getrefcount(t)  # (the caller's local, this parameter, getrefcount's argument)
    key = id(t)
    ref = weakref.ref(t, lambda r, k=key: _drop(k, r))
    _MARKS[key] = (ref, count, id(getattr(t, "producer", None)), what)


def _drop(key: int, ref: weakref.ref) -> None:
    if (held := _MARKS.get(key)) is not None and held[0] is ref:
        del _MARKS[key]


def mark_row(row: Any, index: int, shape: tuple) -> None:
    """Note that ``row`` is row ``index`` of a tensor of ``shape`` that iteration gave: every
    in-place write to its storage is refused (``refuse_row``)."""
    st = row.storage
    key = id(st)
    _ROWS[key] = (weakref.ref(st, lambda r, k=key: _drop_row(k, r)), index, shape)


def _drop_row(key: int, ref: weakref.ref) -> None:
    if (held := _ROWS.get(key)) is not None and held[0] is ref:
        del _ROWS[key]


def _row_of(t: Any) -> tuple | None:
    st = getattr(t, "storage", None)
    held = _ROWS.get(id(st)) if st is not None else None
    return held if held is not None and held[0]() is st else None


def _row_text(held: tuple) -> str:
    return (
        f"a row that iterating a tensor gave (row {held[1]} of a tensor of shape {held[2]}): "
        "pydiff's iteration yields copies, not views as NumPy's and PyTorch's do, so the write "
        "would never reach the tensor (it keeps its values)"
    )


def refuse_row(t: Any, call: str) -> None:
    """A ``TypeError`` if ``t`` (or a view of it) is a row iteration gave: ``call`` (``"row.fill
    (...)"``, ``"row += value"``) would write a copy of the tensor's row, never the tensor."""
    if _ROWS and (held := _row_of(t)) is not None:
        i = held[1]
        raise TypeError(
            f"{call} writes {_row_text(held)}. To change the tensor, write through it: "
            f"x[{i}] = value (for i, row in enumerate(x): x[i] = ...); to write a copy of the "
            f"row, take one first: r = row.clone(); then write r"
        )


def refuse_row_export(t: Any, where: str) -> None:
    """A ``TypeError`` if ``t`` (or a view of it) is a row iteration gave and ``where`` (the
    zero-copy export: ``torch.from_dlpack(row)``, ``pydiff.to_torch(row)`` on CUDA) would
    hand over its memory: the consumer's writes would reach the row's copy, never the tensor
    (whose own export shares its memory)."""
    if _ROWS and (held := _row_of(t)) is not None:
        i = held[1]
        raise TypeError(
            f"{where} of {_row_text(held)}. The export shares the row's memory, a copy of the "
            f"tensor's, so writes through it would be lost: export the tensor and index it "
            f"there (t = torch.from_dlpack(x)[{i}], a view of x's row), write through x "
            f"(x[{i}] = value), or export a copy on purpose: row.clone()"
        )


def refuse(t: Any, method: str) -> None:
    """A ``TypeError`` if ``t`` is a marked copy that nothing but this call of ``method`` holds
    (call it as ``refuse(self, "fill")`` first thing in the method), or a row iteration gave
    (``refuse_row``: however it is held)."""
    if _ROWS:
        refuse_row(t, "row[...] = value" if method == "__setitem__" else f"row.{method}(...)")
    held = _MARKS.get(id(t)) if _MARKS else None
    if held is None or held[0]() is not t or _traced():
        return
    count = sys.getrefcount(t)  # (the method's self, this parameter, getrefcount's argument)
    extra = SLOT_EXTRA if method.startswith("__") else 0  # (__setitem__: a slot's call)
    if count != held[1] + extra or id(getattr(t, "producer", None)) != held[2]:
        return
    if not method.startswith("__") and not _dropped(inspect.currentframe()):  # (t = x[1:3].fill(0))
        return
    what = held[3]
    if what.endswith(".T"):
        advice = f"{what[:-2]}.copy_(values.T)"
    else:
        advice = f"{what} = value (a number, a NumPy array or a tensor, broadcast as NumPy)"
    call = f"{what}[...] = value" if method == "__setitem__" else f"{what}.{method}(...)"
    named = "y[...] = value" if method == "__setitem__" else f"y.{method}(...)"
    raise TypeError(
        f"{call} writes a temporary copy: pydiff's indexing and .T return copies, not views, "
        "and nothing else holds this one, so the write would never be seen (the tensor keeps "
        f"its values). To change the tensor, write into it: {advice}. To write a copy, name "
        f"it first: y = {what}; {named}"
    )


def _dropped(frame: Any) -> bool:
    """Whether the in-place method's caller (``frame``: ``refuse``'s) drops the value of the
    call it is in: its next instruction is ``POP_TOP`` (a statement ``x[1:3].fill(0)``),
    ``PRINT_EXPR`` or a store to ``_``."""
    frame = frame.f_back.f_back
    if frame is None:  # (called from C: nothing to read)
        return False
    for ins in dis.get_instructions(frame.f_code):  # (f_lasti: the call's, or its cache's)
        if ins.offset > frame.f_lasti:
            named_ = ins.opname.startswith("STORE_") and ins.argval == "_"  # (_ = ...: dropped)
            return ins.opname in ("POP_TOP", "PRINT_EXPR") or named_
    return False


def _traced() -> bool:
    """Whether a tracer or profiler runs (a debugger, coverage): Python then calls functions
    another way, with other reference counts (a named copy could count as a temporary)."""
    return sys.gettrace() is not None or sys.getprofile() is not None


def _star_call(frame: Any) -> bool:
    """Whether ``refuse_written``'s caller was called as ``f(*args)`` / ``f(**kwargs)``: the
    caller's tuple is passed on, so a named copy counts as a temporary (``m.f(*[y])``)."""
    frame = frame.f_back.f_back
    if frame is None:
        return True  # (called from C: not told apart, nothing refused)
    op = ""
    for ins in dis.get_instructions(frame.f_code):
        if ins.offset > frame.f_lasti:
            break
        op = ins.opname
    return op == "CALL_FUNCTION_EX"


def refuse_written(fn: Any, args: tuple, kwargs: dict) -> None:
    """A ``TypeError`` if this call of ``fn`` (a shader function: ``params`` with
    ``writes_value``) writes a marked copy nothing but the call holds, through an
    ``out``/``inout`` parameter, a writable tensor parameter (``RWTensor``) or ``_result=``:
    ``m.scale(x[1:3])`` would write the copy and drop it (``x`` unchanged). Call it as
    ``refuse_written(self, args, kwargs)`` first thing in ``__call__(self, *args, **kwargs)``:
    the counts are calibrated on that shape of call (``CALL_EXTRA``). A row iteration gave is
    refused there however it is held."""
    if _ROWS:
        _refuse_rows(fn, args, kwargs)
    if not _MARKS or CALL_EXTRA is None:
        return
    params = fn.params
    for i, value in enumerate(args):
        if id(value) in _MARKS and i < len(params) and params[i].writes_value:
            _refuse_argument(value, sys.getrefcount(value) - CALL_EXTRA[0], params[i].name, fn)
    for name, value in kwargs.items():
        if id(value) in _MARKS:
            if name == "_result" or next((p.writes_value for p in params if p.name == name), False):
                _refuse_argument(value, sys.getrefcount(value) - CALL_EXTRA[1], name, fn)


def _refuse_rows(fn: Any, args: tuple, kwargs: dict) -> None:
    params = fn.params
    written = [(p.name, v) for p, v in zip(params, args) if p.writes_value]
    for name, value in kwargs.items():
        if name == "_result" or next((p.writes_value for p in params if p.name == name), False):
            written.append((name, value))
    for name, value in written:
        if (held := _row_of(value)) is not None:
            i = held[1]
            raise TypeError(
                f"{getattr(fn, 'label', fn)}: parameter '{name}' would write {_row_text(held)}. "
                f"Call with a copy and write it back: r = row.clone(); f(..., r); x[{i}] = r"
            )


def _refuse_argument(value: Any, count: int, name: str, fn: Any) -> None:
    held = _MARKS.get(id(value))
    if held is None or held[0]() is not value or count != held[1]:
        return
    if id(getattr(value, "producer", None)) != held[2]:
        return
    if _traced() or _star_call(inspect.currentframe().f_back):  # (refuse_written's frame;
        return  # asked only here: reading the caller's bytecode costs, every call would pay)
    what = held[3]
    back = f"{what[:-2]}.copy_(c.T)" if what.endswith(".T") else f"{what} = c"
    raise TypeError(
        f"{getattr(fn, 'label', fn)}: parameter '{name}' would write {what}, a temporary copy: "
        "pydiff's indexing and .T return copies, not views, and nothing else holds this one, "
        "so the values the call writes would never be seen (the tensor keeps its values). Name "
        f"the copy, call, then write it back: c = {what}; f(..., c); {back}"
    )


def key_text(key: Any) -> str:
    """An index as written between brackets: ``slice(1, 3)`` -> ``"1:3"``, ``(0, ...)`` ->
    ``"0, ..."``."""
    if isinstance(key, tuple):
        return ", ".join(key_text(k) for k in key) if key else "()"
    if isinstance(key, slice):
        parts = ["" if v is None else repr(v) for v in (key.start, key.stop, key.step)]
        return ":".join(parts if key.step is not None else parts[:2])
    return "..." if key is Ellipsis else repr(key)


class _Probe:
    def write(self, seen: list) -> "_Probe":
        try:
            refuse(self, "write")
        except TypeError:
            seen.append(True)
        return self

    def __setitem__(self, key: Any, value: list) -> None:
        try:
            refuse(self, "__setitem__")
        except TypeError:
            value.append(True)


def _made() -> _Probe:
    p = _Probe()
    mark(p, "probe")
    return p


def _slot_refused(named: bool) -> bool:
    seen: list = []
    if named:
        p = _made()
        p[0] = seen
    else:
        _made()[0] = seen
    return bool(seen)


class _CallProbe:
    params = (type("P", (), {"writes_value": True, "name": "x"})(),)

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        try:
            refuse_written(self, args, kwargs)
        except TypeError:
            return True
        return False


def _call_extra() -> tuple[int, int] | None:
    """The references a call ``f(t)`` / ``f(x=t)`` of a ``__call__(self, *args, **kwargs)``
    adds over a fresh mark's, where a temporary and a named argument are told apart."""
    global CALL_EXTRA
    probe, found = _CallProbe(), {}
    for extra in range(8):  # (each call as written, no helper frame: it would hold one more)
        CALL_EXTRA = (extra, extra)
        named = _made()
        if "args" not in found and probe(_made()) and not probe(named):
            found["args"] = extra
        if "kwargs" not in found and probe(x=_made()) and not probe(x=named):
            found["kwargs"] = extra
    CALL_EXTRA = (found["args"], found["kwargs"]) if len(found) == 2 else None
    return CALL_EXTRA


def _calibrate() -> bool:
    """Whether a temporary is refused and a named object (a local, a list's) is not here, by
    a method and by ``__setitem__`` (``SLOT_EXTRA`` found)."""
    global SLOT_EXTRA
    temporary: list = []
    _made().write(temporary)  # (a statement: its result dropped)
    named, kept, used = _made(), [_made()], []
    named.write(used)
    kept[0].write(used)
    kept.append(_made().write(used))  # (the result used: the copy is kept)
    ok = bool(temporary) and not used
    for SLOT_EXTRA in (0, 1, 2, None):  # noqa: B007 (the global kept)
        if SLOT_EXTRA is None or (_slot_refused(False) and not _slot_refused(True)):
            break
    _call_extra()
    _MARKS.clear()
    return ok and SLOT_EXTRA is not None


ENABLED = _calibrate()
