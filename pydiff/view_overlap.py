"""Written views that meet what a forward call reads at other places of one storage, or
that hold an element more than once: races refused before the call (``bwds_checks``'s
``refuse_written_twice`` calls ``refuse_shifted_overlap`` for a forward call).

    refuse_shifted_overlap(fn, bound, result, fn.label)   # ValueError naming both

A whole-tensor parameter (``IDiffTensor``, ``Tensor``, ...) reads or writes any element, so
one that shares a storage with another parameter's writes races whatever the views: the
read side is then read from a copy taken before the call (``copy_racing_reads``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arguments import nested_tensors
from .signature import FunctionTarget
from .tape import active_tape
from .tensor import Tensor


def _element_offsets(t: Tensor) -> np.ndarray:
    """The storage offsets (in elements) of a tensor's elements, flattened."""
    offset, strides, shape, _ = t.geometry
    offsets = np.asarray(offset, np.int64)
    for d, s in zip(shape, strides):
        offsets = np.add.outer(offsets, np.arange(d, dtype=np.int64) * s)
    return offsets.ravel()


def holds_repeats(t: Tensor) -> bool:
    """Whether a view holds some element of its storage more than once (a stride of 0 over
    an axis longer than 1: an expanded view; overlapping axes). A contiguous view never does."""
    if t.geometry[3]:
        return False
    offsets = _element_offsets(t)
    return np.unique(offsets).size != offsets.size


def _same_places(w: Tensor, r: Tensor) -> bool:
    """Whether a written and a read view of one storage meet only where one call element
    reads and writes the same place (the same view; ``x`` and ``x.reshape(1, n)``; disjoint)."""
    if w.geometry[:3] == r.geometry[:3]:
        return True  # (in place through two handles of one view: no offsets to compute)
    wo, ro = _element_offsets(w), _element_offsets(r)
    try:
        both = np.broadcast_shapes(w.shape, r.shape)
        wb = np.broadcast_to(wo.reshape(w.shape), both)
        if np.array_equal(wb, np.broadcast_to(ro.reshape(r.shape), both)):
            return True
    except ValueError:  # (shapes that do not broadcast: the call refuses them itself)
        pass
    return not (wo.size and ro.size and np.intersect1d(wo, ro).size)


def refuse_shifted_overlap(fn: FunctionTarget, bound: list, result: Any, where: str) -> None:
    """A forward call writing ``_result`` (or a vectorised ``out``/``inout`` value) into
    elements of a storage that a vectorised argument reads through a view of other geometry
    (``out`` one element after ``x`` on one buffer): one thread's store overtakes another's
    load, a race whose values depend on the device's order (the same view, ``_result=x``, is
    kept: each thread reads and writes its own element). Refused naming both."""
    writes = [("_result", result)]
    for j in fn.signature.written:  # (an IWDiffTensor... writes at indices of its own: kept,
        p = bound[j][0]  # unless its view holds an element twice: two threads' own elements)
        if p.tensor_kind is None or (type(bound[j][1]) is Tensor and holds_repeats(bound[j][1])):
            writes.append((p.name, bound[j][1]))
    for name, w in writes:
        if type(w) is not Tensor:
            continue
        if holds_repeats(w):  # (several threads store to one element: the last one kept)
            what = "_result" if name == "_result" else f"parameter '{name}'"
            raise ValueError(
                f"{where}: {what} is a view that holds elements more than once (shape "
                f"{w.shape}, strides {tuple(w.geometry[1])}): several threads would store "
                "into one element, which keeps whichever came last. Write into a tensor of its "
                "own (expand the values afterwards, if needed)"
            )
        for p, value in bound:
            if type(value) is Tensor:
                reads = (value,)
            elif isinstance(value, (dict, list, tuple)):  # (a struct's fields: review43b)
                reads = nested_tensors(value)
            else:
                continue
            for r in reads:
                if r is w or r.storage is not w.storage:
                    continue  # (the very same tensor: each element read, written by one thread)
                if p.tensor_kind is not None or not p.reads_value or p.name == name:
                    continue
                if not _same_places(w, r):
                    what = "_result" if name == "_result" else f"parameter '{name}'"
                    raise ValueError(
                        f"{where}: {what} and parameter '{p.name}' are views of one storage "
                        f"that share elements at other places (shapes {r.shape} and {w.shape}, "
                        f"offsets {r.geometry[0]} and {w.geometry[0]}): threads would overwrite "
                        "elements other threads still read (a race). Write into a tensor of its "
                        "own, or pass the very same view for both (each element read and "
                        "written by one thread)"
                    )
    copy_racing_reads(fn, bound, result, where)


def copy_racing_reads(fn: FunctionTarget, bound: list, result: Any, where: str) -> None:
    """Where a parameter reads a storage that another parameter (or ``_result``) writes, and
    either of the two is a whole-tensor parameter (``blur(grid, img, img)``: neighbours read
    while results are stored), the reading parameter gets a copy of the values taken before
    the call (in ``bound``, in place): the values the math asks for, on any device order. A
    tensor with gradient buffers off a tape is refused instead (an explicit ``.bwds`` would
    need the copy's gradients); on a tape the forward call refuses the aliasing itself."""
    writers = [
        (j, bound[j][0].name, bound[j][0].tensor_kind, bound[j][1]) for j in fn.signature.written
    ]
    if type(result) is Tensor:  # (an elementwise writer, as a vectorised out parameter)
        writers.append((-1, "_result", None, result))
    for i, (p, value) in enumerate(bound):
        if type(value) is not Tensor or not p.reads_value or p.writes_value:
            continue
        for j, name, kind, w in writers:
            if j == i or type(w) is not Tensor or w.storage is not value.storage:
                continue
            if p.tensor_kind is None and kind is None:
                continue  # (elementwise on both sides: refuse_shifted_overlap's case)
            if not value.requires_grad:
                bound[i] = (p, value.copy_values())
            elif active_tape() is None:
                what = "_result" if j == -1 else f"parameter '{name}'"
                raise ValueError(
                    f"{where}: {what}, which the call writes, shares its storage with parameter "
                    f"'{p.name}', which it reads at any element: threads would overwrite values "
                    "others still read (a race). Pass a tensor of its own to write into, or a "
                    f"copy to read ({p.name}.detach().clone())"
                )
            break
