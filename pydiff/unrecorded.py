"""What a backward says of a tensor that no call recorded on its tape made, naming what did
make it: a call recorded on another tape, a ``Function`` run off a tape (``MADE_OFF_TAPE``,
kept here), a write from outside a call (``pydiff.tensor``, ``fill``, ``copy_``), or a call
no tape recorded (off a tape, or with no input that requires a gradient).

    raise RuntimeError(not_recorded("tape.backward", y, this_tape=tape))
"""

from __future__ import annotations

import weakref
from typing import Any

from . import tensor_methods
from .errors import StaleInputError, warn_once
from .handles import describe_with, grad_handle_of, handers_of, handle_note
from .storage import COPY_FROM_GRAPH
from .tensor import Tensor

# Outputs of Functions with a backward computed off a tape from inputs that require a
# gradient (x[1:], x.T): copies with no path back, which .bwds warns of (bwds_checks) and a
# backward from them names. {id: (weakref to the tensor, class name, storage version then)};
# by id: tensors refuse ==.
MADE_OFF_TAPE: dict[int, tuple] = {}


# Tensors a call wrote while a tape was recording, which it did not record because none of
# the call's inputs requires a gradient (constants to the tape). {id: (weakref, label,
# storage version then)}.
UNRECORDED_ON_TAPE: dict[int, tuple] = {}


# Tensors an unrecorded call (above) wrote from values copy_ took from a gradient path, or
# from such tensors in turn: constants to the tape that should have carried a gradient.
# {id: (weakref, label, storage version then)}.
FROM_COPIED: dict[int, tuple] = {}


#: What a call no tape recorded (none of its inputs requires a gradient) left in a tensor a
#: recorded call made, written through its result or an ``out`` value (every value: constants,
#: the gradient stops there) or a tensor parameter (``IWDiffTensor``: perhaps only some
#: values, so a backward that needs the earlier call's values refuses, ``tape._needed``).
WHOLE_UNRECORDED = "a call no tape recorded (none of its inputs requires a gradient)"
PARTLY_UNRECORDED = (
    "a call no tape recorded (none of its inputs requires a gradient), writing through a "
    "tensor parameter"
)


def overwritten_refusal(index: int, label: str, writer: str | None) -> RuntimeError | None:
    """The refusal of a backward that needs the values recorded call #``index`` (``label``)
    wrote, where ``writer`` replaced them: ``copy_`` of values with a gradient path (no
    gradient would reach their source), or a call no tape recorded writing through a tensor
    parameter (``PARTLY_UNRECORDED``: perhaps some values only); None for other writers."""
    if writer == COPY_FROM_GRAPH:
        return RuntimeError(
            f"tape.backward: the values call #{index} ({label}) wrote were replaced by "
            f"{writer}, so no gradient would reach what they were copied from; compute the "
            "value with pydiff calls (or ops) instead of copy_"
        )
    if writer is None or not writer.endswith(PARTLY_UNRECORDED):
        return None
    return RuntimeError(
        f"tape.backward: the values call #{index} ({label}) wrote were then written by "
        f"{writer}, perhaps in part: the gradient cannot stop just where it wrote. Give that "
        "call an input that requires a gradient (it is then recorded, and its backward clears "
        "the gradient where it wrote)"
    )


def note_unrecorded(tensors: Any, label: str, reads: Any = (), whole: Any = ()) -> None:
    """Remember that ``label`` wrote ``tensors`` on a tape that did not record it; where it
    read (``reads``: tensors) values ``copy_`` took from a gradient path (``copied_from``),
    its results hold such values too. ``whole``: those it wrote every value of (its result,
    ``out`` values): where a recorded call made them, they now hold constants, as after a
    host write (the gradient stops there: before, the backward sent it on to that call).

    >>> note_unrecorded([y], "m.f", [x], [y])   # in forward_call, no gradient to give
    """
    for t in tensors:  # (tensor parameters it writes may be written in part: refused later)
        if isinstance(t, Tensor) and t.producer is not None:
            whole_ = any(t is w for w in whole)
            why = WHOLE_UNRECORDED if whole_ else PARTLY_UNRECORDED
            t.storage.wrote(f"{label}, {why}", everything=True)
    copied = next((c for c in map(copied_from, reads) if c is not None), None)
    marks = [MARKED[id(m)][1] for r in reads for m in (r, r.base) if is_marked(m)] if MARKED else []
    if marks:  # (a backward from its result names the mark: "_Sum (of an output M ...)")
        label = f"{label} (of an output {marks[0]} marked non-differentiable)"
    for t in tensors:
        gone = lambda _, i=id(t): UNRECORDED_ON_TAPE.pop(i, None)  # noqa: E731
        UNRECORDED_ON_TAPE[id(t)] = (weakref.ref(t, gone), label, t.storage.version)
        if copied is not None:
            drop = lambda _, i=id(t): FROM_COPIED.pop(i, None)  # noqa: E731
            FROM_COPIED[id(t)] = (weakref.ref(t, drop), f"{label} of {copied}", t.storage.version)


def copied_from(t: Tensor) -> str | None:
    """What ``t`` holds when it holds values ``copy_`` took from a tensor with a gradient
    path, directly or through calls no tape recorded (its constants), so that no gradient
    reaches the source; None otherwise. A backward or transform reaching such values would
    give the source a silent 0 (``grad`` of ``y.copy_(x); (y * y).sum()`` was 0).

    >>> copied_from(y)     # 'values copy_ of values with a gradient path (...)'
    """
    if (storage := t.storage).producer is None and storage.last_writer == COPY_FROM_GRAPH:
        return f"values {COPY_FROM_GRAPH}"
    if not FROM_COPIED:
        return None  # (every read of every recorded call asks: nothing to look up)
    found = _still_holding(FROM_COPIED, t)
    if found is None and t.base is not None:
        found = _still_holding(FROM_COPIED, t.base)  # a reshape view of such a result
    return None if found is None else f"the result of {found}"


def refuse_copied(out: Tensor, what: str) -> None:
    """A RuntimeError for an output that no recorded call wrote since ``copy_`` brought in
    values with a gradient path (or computed from such by calls no tape recorded: their
    constants): no tape records ``copy_``, so its gradient would be 0."""
    if out.producer is None and (
        out.storage.replaced[1] == COPY_FROM_GRAPH or copied_from(out) is not None
    ):
        raise RuntimeError(
            f"{what}: fn's output holds values copied in by copy_ from values with a gradient "
            "path (or computed from such); no tape records copy_, so the gradient through it "
            "would be a silent 0. Return the value itself (or a pydiff call of it), or "
            "src.clone() (recorded) instead of copy_"
        )


def _still_holding(registry: dict, t: Tensor | None) -> str | None:
    found = registry.get(id(t)) if t is not None else None
    if found is None or found[0]() is not t or found[2] != t.storage.version:
        return None
    return found[1]


def made_off_tape(t: Tensor) -> str | None:
    """The ``Function`` (class name) that computed ``t`` off a tape from tensors that require
    a gradient, while ``t`` still holds those values; None otherwise (``t.detach()`` too).

    >>> made_off_tape(x[1:])     # '_Take' for an x that requires a gradient, off a tape
    """
    return _still_holding(MADE_OFF_TAPE, t)


describe_with(made_off_tape)  # (handles keeps the note with a handle such a tensor gives out)


# The outputs given to ``ctx.mark_non_differentiable``, and the detached views or copies
# ``Function.apply`` returned for them, while they live: {id: (weakref, Function name)}.
# ``gradcheck`` leaves them out (as torch's leaves out outputs without a gradient); a
# backward from one says it was marked (before 2026-11-29: "computed ... off a tape").
MARKED: dict[int, tuple] = {}  # (by id: a WeakSet would compare tensors with ==)


def note_marked(outputs: Any, name: str) -> None:
    """Remember ``outputs`` (the tensors among them) as marked non-differentiable by the
    Function ``name``."""
    for o in outputs:
        if isinstance(o, Tensor):
            MARKED[id(o)] = (weakref.ref(o, lambda _, i=id(o): MARKED.pop(i, None)), name)


def is_marked(t: Any) -> bool:
    """Whether ``t`` is an output marked non-differentiable (that object)."""
    found = MARKED.get(id(t))
    return found is not None and found[0]() is t


def marked_refusal(where: str, output: Tensor) -> str | None:
    """The refusal of a backward from ``output`` (or a view of one) when it is an output a
    Function marked non-differentiable; None otherwise.

    >>> marked_refusal("tape.backward", z)   # '...: the output is an output of the Function ...'
    """
    t = output if is_marked(output) else output.base if is_marked(output.base) else None
    if t is None:
        return None
    name = MARKED[id(t)][1]
    return (
        f"{where}: the output is an output of the Function {name} that {name}.forward marked "
        f"non-differentiable (ctx.mark_non_differentiable): it carries no gradient, so no "
        f"backward can start from it. Call backward on an output {name} did not mark (or "
        "leave it unmarked and give it a gradient in backward)"
    )


def not_recorded(
    where: str, output: Tensor, this_tape: Any = None, recorded: int = 1, overwritten: bool = False
) -> str:
    """Why no call recorded on ``this_tape`` (None: on any tape) produced ``output``, as the
    message of ``where``'s refusal. ``recorded``: how many calls the tape holds;
    ``overwritten``: one of them wrote the output's storage, replaced since from outside.

    >>> not_recorded("tape.backward", x, tape)   # '...: its values were written by a host ...'
    """
    head = (
        f"{where}: the output was not produced by any call recorded on this tape"
        if this_tape is not None
        else f"{where}: this tensor was not produced by a call recorded on a pydiff.Tape"
    )
    producer, storage = output.producer, output.storage
    if (marked := marked_refusal(where, output)) is not None:
        return marked
    if overwritten:
        return (
            f"{head} (its values were overwritten by {storage.replaced[1]} after a recorded "
            "call wrote them: they are constants to the tape)"
        )
    made_by = made_off_tape(output)
    if made_by is None and output.base is not None:
        made_by = made_off_tape(output.base)  # a reshape view of such a copy
    if producer is not None and producer is not this_tape and type(producer).__name__ == "Tape":
        return (
            f"{head}: it was produced by a call recorded on another pydiff.Tape. Call that "
            "tape's backward (output.backward() finds it), or record the calls on one tape"
        )
    constant_by = _still_holding(UNRECORDED_ON_TAPE, output)
    if constant_by is None and output.base is not None:
        constant_by = _still_holding(UNRECORDED_ON_TAPE, output.base)
    if constant_by is not None:
        return (
            f"{head}: {constant_by} computed it while a tape was recording, but none of the "
            "call's inputs requires a gradient, so the tape did not record it (a constant to "
            "the tape). Create the inputs the gradient is for with requires_grad=True"
        )
    if made_by is not None:
        return (
            f"{head}: {made_by} computed it off a tape (no pydiff.Tape was recording), from "
            "tensors that require a gradient, so it is a copy with no path back. Compute it "
            "inside 'with pydiff.Tape() as tape:'"
        )
    outside = storage.replaced[0] > 0 and storage.last_writer in (
        storage.replaced[1],
        "a snapshot (copy_values)",
    )
    if outside and storage.replaced[1] == COPY_FROM_GRAPH:
        return (
            f"{head}: its values are a copy (clone() or copy_ off a tape) of values with a "
            "gradient path, and no tape records such a copy. Make it on the tape (clone() "
            "there is recorded) or compute it with recorded calls"
        )
    if outside:
        return (
            f"{head}: its values were written by {storage.last_writer}, not computed by a "
            "call (a leaf, or a constant: no gradient flows through such a write). Call "
            "backward on a result of calls recorded on the tape"
        )
    empty = " (this tape recorded no call)" if this_tape is not None and not recorded else ""
    how = (
        "computed off a tape (no pydiff.Tape was recording), or made by pydiff.zeros/empty"
        if storage.last_writer == "nothing"
        else f"computed by {storage.last_writer} off a tape (no pydiff.Tape was recording)"
    )
    return (
        f"{head}{empty}: it was {how}. Compute it inside 'with pydiff.Tape() as tape:' from "
        "tensors that require a gradient (or call .bwds yourself)"
    )


tensor_methods.provide("not_recorded", not_recorded)
tensor_methods.provide("copied_from", copied_from)  # (Tensor.copy_ keeps the mark)


def check_versions(entries: list, path: set[int]) -> None:
    """What a tape's backward refuses of its recording (``entries``, those it runs; ``path``:
    the storages on the way): an output that lost its gradient buffers since it was recorded,
    an input overwritten since a call read it."""
    for entry in entries:  # a Function's outputs all get gradient buffers; a call's:
        had = range(len(entry.writes)) if "ctx" in entry.payload else ()  # (with_grads)
        for k in entry.payload.get("with_grads", had):
            if not (t := entry.writes[k]).requires_grad and id(t.storage) in path:
                raise RuntimeError(
                    f"tape.backward: output {k} of call #{entry.index} ({entry.label}) "
                    "lost its gradient buffers (requires_grad_(False)) after the call "
                    "was recorded, so no gradient can pass through it; to mean a "
                    "constant, record the calls that read it on t.detach()"
                )
        for desc, t, version in entry.reads:
            if t.storage.version != version:
                raise StaleInputError(
                    f"tape.backward: {desc} was read by call #{entry.index} "
                    f"({entry.label}) and later overwritten by {t.storage.last_writer}; "
                    "its backward needs the value it read. Write the new values to "
                    "another tensor, or run backward before overwriting."
                )
    _refuse_gradients_read(entries)


def _refuse_gradients_read(entries: list) -> None:
    """Refuse a recorded call that read a gradient buffer (``m.f(x, x.grad)``) which this
    backward writes before the call's backward reads it again: the results' buffers are
    zeroed first, and the calls recorded after it (their backwards run first) add into their
    inputs' buffers. Its backward would read those gradients, not the values the call read
    (ACCUMULATE: a silent wrong gradient; RESET: a refusal part-way). Checked before
    anything is written. (A buffer only the call itself adds into is read and added by one
    thread per element, as an eager ``.bwds`` does: kept.)"""
    written: dict[int, tuple] = {}  # id(storage): (entry, whose gradient buffer it is)
    for e in entries:  # (grad_storages: a buffer to be zeroed later is not zeroed here)
        for t in e.writes:
            if (g := t.grad_storages()[0]) is not None:
                written[id(g)] = (e, "result")
    for entry in reversed(entries):  # (the backward's order)
        for desc, t, _ in entry.reads:
            if id(t.storage) in written:
                by, owner = written[id(t.storage)]
                raise ValueError(
                    f"tape.backward: {desc} (read by call #{entry.index}, {entry.label}) is "
                    f"the gradient buffer of the {owner} of call #{by.index} ({by.label}), "
                    f"which this backward writes before the backward of call #{entry.index} "
                    "reads it again: that would read gradients, not the values the call read. "
                    "Pass the call a copy (x.grad.copy_values())"
                )
        for desc, t, _ in entry.reads:
            if (g := t.grad_storages()[1]) is not None:
                written.setdefault(id(g), (entry, desc))


def warn_made_off_tape(fn: Any, name: str, value: Tensor) -> None:
    """Warn (once per call site) when the data tensor ``value`` given to parameter ``name``
    of ``.bwds`` was computed off a tape from a tensor that requires a gradient (``x[1:]``):
    or made from the handle of one (``pydiff.Tensor(x.native.view(...), dev)``); also at a
    call plan's calls (backward_plan), which skip ``bwds_arguments_checked``."""
    made_by = made_off_tape(value)
    hander = grad_handle_of(value) if made_by is None else None
    if made_by is None and hander is None:  # (the handle of x[1:], itself made off a tape;
        made_by = next(filter(None, map(made_off_tape, handers_of(value))), handle_note(value))
        # handle_note: of a temporary x[2:5] too, dead by the time its handle was wrapped)
    if hander is not None:
        warn_once(
            f"{fn.bwds_label}: parameter '{name}' is given a tensor made from the SlangPy "
            f"handle of a tensor of shape {hander.shape} that requires a gradient "
            "(pydiff.Tensor(x.native.view(...), device)): it shares that tensor's values, not "
            "its gradient buffers, so .bwds gives it no gradient. Index the tensor itself "
            "(x[::2], x.T) on a pydiff.Tape, or pass .detach() to say no gradient is wanted"
        )
    elif made_by is not None:
        warn_once(
            f"{fn.bwds_label}: parameter '{name}' is given a tensor that {made_by} "
            "(indexing, .T, transpose, astype) computed off a tape from a tensor that "
            "requires a gradient: a copy without gradient buffers or a path back, so "
            ".bwds gives the tensor it came from no gradient. Compute it and call the "
            "function on a pydiff.Tape (tape.backward carries the gradient back), or "
            "pass .detach() of it to say no gradient is wanted"
        )
