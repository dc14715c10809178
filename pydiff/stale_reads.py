"""Which forward call made a tensor, and what it read: an explicit ``.bwds`` of that call
refuses an input written since (its backward would differentiate at the new values).

A forward call that writes a tensor (its result, ``_result``, an ``out``/``inout``
parameter) marks the written storage (``Storage.made_by``) with the function and, for each
tensor it read, ``(parameter index, parameter or 'p.field', storage serial, version)``.
A later ``.bwds`` of the same function given that tensor (as ``_result`` or at the written
parameter whose upstream gradient it reads) refuses a tensor at one of those parameters that
is the storage the call read there, written since, unless the copy pydiff kept for an
in-place call holds the very values the call read (``bwds_checks.values_read`` uses it).

    mark_made(fn, bound, out)                   # after a forward call's writes
    refuse_stale_reads(fn, bound, result)       # StaleInputError (a ValueError) before .bwds
"""

from __future__ import annotations

from typing import Any

from .arguments import PLAIN, nested_tensors
from .errors import StaleInputError
from .signature import FunctionTarget
from .struct_values import read_tensors
from .tensor import Tensor


def _written(fn: FunctionTarget, bound: list, out: Any) -> list[Tensor]:
    """The tensors a call of ``fn`` with ``bound`` writes (those in written structs' fields
    too), and ``out``, its result (or ``_result``), when a tensor."""
    found = [t for j in fn.signature.written for t in nested_tensors(bound[j][1])]
    return found + [out] if type(out) is Tensor else found


def mark_made(fn: FunctionTarget, bound: list, out: Any) -> None:
    """Record on each storage the forward call of ``fn`` with ``bound`` wrote (``out``: the
    result tensor, or None) the tensors it read at which versions (after the call's writes).
    A storage read and written in place is recorded as the call left it, with the copy of
    the values it read where pydiff kept one (``Storage.before``): a write since is refused,
    unless it restored exactly those values (the SlangPy idiom: put the primal back, then
    ``.bwds``)."""
    written = _written(fn, bound, out)
    if not written:
        return
    ids = {id(t.storage) for t in written}
    entries, kept = [], {}
    for i, (p, value) in enumerate(bound):
        if not p.reads_value or type(value) in PLAIN:
            continue
        for key, t, _ in read_tensors(p, value, None):
            st = t.storage
            entries.append((i, key, st.serial, st.version))
            if id(st) in ids and st.before is not None and st.before[1] is not None:
                kept[(i, key)] = st.before[1]  # (held while this record is the storage's)
    made = (fn, tuple(entries), kept) if kept else (fn, tuple(entries))
    for t in written:
        t.storage.made_by = made


def refuse_stale_reads(fn: FunctionTarget, bound: list, result: Any) -> None:
    """``.bwds`` of ``fn`` with ``bound`` and ``result``: refuse an argument that is the
    storage the forward call that made ``result`` (or a written parameter's tensor) read at
    that parameter, written since, naming the parameter and the writer."""
    seen: Any = None
    for j, w in [(j, bound[j][1]) for j in fn.signature.written] + [(-1, result)]:
        for t in nested_tensors(w) if type(w) is not Tensor else (w,):
            made = t.storage.made_by
            if made is None or made[0] is not fn or made is seen:
                continue
            seen = made
            what = "_result" if j < 0 else f"parameter '{bound[j][0].name}'"
            restored = made[2] if len(made) > 2 else {}
            for i, key, serial, version in made[1]:
                _check(fn, bound, i, key, serial, version, what, restored.get((i, key)))


def _same_values(t: Tensor, copy: Any) -> bool:
    """Whether ``t`` holds exactly ``copy``'s values (bit for bit: NaNs alike)."""
    a, b = t.numpy(), copy.numpy()
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _check(
    fn: FunctionTarget,
    bound: list,
    i: int,
    key: str,
    serial: int,
    version: int,
    what: str,
    copy: Any = None,
) -> None:
    if i >= len(bound):
        return
    p, value = bound[i]
    if type(value) in PLAIN or not p.reads_value:
        return
    for k, t, _ in read_tensors(p, value, None):
        st = t.storage
        if k != key or st.serial != serial or st.version == version or _kept(fn, st, key, version):
            continue
        if copy is not None and _same_values(t, copy):
            continue  # (an in-place call's tensor put back to the values it read)
        name = key if "." not in key else f"(the tensor in field {key})"
        raise StaleInputError(
            f"{fn.bwds_label}: parameter '{key}' is the tensor (or a view of the storage) that "
            f"{fn.call_label} read when it made the tensor passed as {what}, but "
            f"{st.last_writer} wrote it since (version {version}, now {st.version}): .bwds "
            "would differentiate at the new values, not at those the call read. Rerun the "
            f"forward call ({fn.label}(...) writing {what}) before .bwds, record the calls on "
            f"a pydiff.Tape, or keep a copy before the write (kept = {name}.clone()"
            ".with_grads()) and pass that to .bwds (its gradient goes to kept.grad)"
        )


def _kept(fn: FunctionTarget, st: Any, key: str, version: int) -> bool:
    """Whether a later in-place call of ``fn`` overwrote the values right after reading them
    at ``key`` with a copy kept (``Storage.before``): the copy holds the values read at
    ``version``, which ``bwds_checks.values_read`` passes on (or refuses itself)."""
    kept = st.before
    return (
        kept is not None
        and kept[0] == st.version == version + 1
        and st.last_writer == fn.call_label
        and key in st.read_by_writer
    )
