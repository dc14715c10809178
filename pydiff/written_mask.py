"""The gradient of an in-place tensor that a call wrote only in part.

A call on an ``IRWDiffTensor`` turns the values before it into the values after it. Its
``.bwds`` reads the upstream gradient (dL/d after) and must leave dL/d before. Where the call
stored, SlangPy's backward reads the upstream and adds the contributions of the reads; where
it did not store (one index, a conditional store), the value passed through unchanged, so
dL/d before is the upstream plus those reads, and SlangPy has no way to know which elements
those are. pydiff calls such a function through a generated wrapper whose tensor parameter
is a ``PydiffMaskedRWDiffTensor`` (shaders/pydiff_written_mask.slang): its store backward
marks each element it reads the upstream of, and pydiff adds the upstream wherever nothing
was marked. An element marked twice (threads raced on it in the forward) is recorded on the
device too, so the check reads back 8 bytes rather than the marks.

    mask = WrittenMask(device, t.shape)
    native = mask.bind(p, bound)              # the wrapper's argument for parameter p
    ... dispatch fn's masked wrapper ...; mask.pass_unwritten(scope, upstream, grad)
"""

from __future__ import annotations

import math
import re
from typing import Any, Protocol

import numpy as np
import slangpy as spy

from . import grid_args, single_store
from .device import Device
from .grad_restore import may_count
from .grid_args import is_grid
from .signature import ParamInfo, Signature, overloaded, stem
from .storage import allocate
from .tensor import Tensor

MODULE = "pydiff_written_mask"
_INTERFACE = re.compile(r"^I(RW|W)DiffTensor\s*<")


class GeneratingFunction(Protocol):
    """A shader function that compiles generated wrappers of itself (ShaderFunction)."""

    name: str
    label: str
    signature: Signature
    module: Any

    def generated(self, kind: str, source: str) -> Any: ...


def needs_mask(p: ParamInfo, t: Tensor, label: str) -> bool:
    """Whether ``t``, bound to ``p``, needs the written mask: an in-place tensor whose one
    gradient buffer holds the upstream now and must hold dL/d(value before) afterwards."""
    if p.access != "read_write" or not t.requires_grad or t.grad_in is not t.grad_out:
        return False
    if p.tensor_kind == "diff":
        raise ValueError(
            f"{label}: parameter '{p.name}' is a concrete {p.type_name}: with one gradient "
            "buffer pydiff cannot tell which elements the call wrote (an element it did not "
            "write passes its upstream gradient through). Declare it IRWDiffTensor, or pass "
            "separate buffers "
            "(t.with_grads(grad_in=upstream, grad_out=g)) and add the pass-through yourself"
        )
    return p.tensor_kind == "idiff"


def _masked_type(p: ParamInfo) -> str:
    return _INTERFACE.sub(r"PydiffMasked\1DiffTensor<", p.type_name.strip(), count=1)


def needs_clearing(p: ParamInfo, label: str) -> bool:
    """For a tensor the call only writes, whose value before the call is part of a tape's
    graph: whether its written elements must be told apart (an interface tensor, which may be
    written in part) rather than all cleared (a vectorised ``out`` value covers the call)."""
    if p.tensor_kind == "diff":
        raise ValueError(
            f"{label}: parameter '{p.name}' is a concrete {p.type_name} that overwrites a value "
            "an earlier call on the tape produced (or a leaf); pydiff cannot tell which "
            "elements it wrote. Declare it IWDiffTensor, or write to a new tensor"
        )
    return p.tensor_kind == "idiff"


def _kind(masked: set[str]) -> str:
    """The wrapper's name per set of parameters, one name per set: each name after its
    length (``{"a_b"}``: ``masked_3a_b``, ``{"a", "b"}``: ``masked_1a_1b``; joined plainly,
    both were ``masked_a_b``, and the second set got the first's wrapper: a call refused)."""
    return "masked_" + "_".join(f"{len(name)}{name}" for name in sorted(masked))


def wrapper_source(fn: GeneratingFunction, masked: set[str]) -> str:
    """Slang source of ``<name>__pydiff_masked_<params>``: ``fn`` with each parameter in
    ``masked`` typed as a PydiffMaskedRWDiffTensor (which is an IRWDiffTensor)."""
    params, names = [], []
    for p in fn.signature.params:
        mods = ("no_diff " if p.no_diff else "") + (
            {"out": "out ", "inout": "inout "}.get(p.io, "")
        )
        type_name = _masked_type(p) if p.name in masked else p.type_name
        params.append(f"{mods}{type_name} {p.name}")
        names.append(p.name)
    ret = fn.signature.return_type
    call = f"{fn.name}({', '.join(names)})"
    body = f"{call};" if ret == "void" else f"return {call};"
    return (
        f"import slangpy;\n__exported import {fn.module.import_spec};\n"
        f"__exported import {MODULE};\n"
        f"[Differentiable]\n{ret} {stem(fn.name)}__pydiff_{_kind(masked)}"
        f"({', '.join(params)})\n{{\n"
        f"    {body}\n}}\n"
    )


# The tensors each layout of a function stores once per thread, for a tape's record of each
# call: {(id(fn), layout key): (fn, names)} (a lookup, not stored_once's ~10 us; bounded).
_ONCE_BY_LAYOUT: dict[tuple, tuple] = {}


def may_be_counted(fn: GeneratingFunction, bound: list, prior: frozenset, key: Any) -> bool:
    """Whether ``.bwds`` of this forward call may count its stores (a tape keeps the gradient
    buffers its backward writes, to put them back if the counts refuse it); ``key``: the
    call's layout (``plan_layout.layout_key``, None: none)."""
    if not may_count(bound, prior, frozenset()):
        return False
    hit = _ONCE_BY_LAYOUT.get((id(fn), key)) if key is not None else None
    if hit is not None and hit[0] is fn:
        return may_count(bound, prior, hit[1])
    try:
        once = _stores_once(fn, bound)
    except (ValueError, TypeError):
        return True  # (.bwds refuses it before its kernel)
    if key is not None:
        if len(_ONCE_BY_LAYOUT) >= 1024:
            _ONCE_BY_LAYOUT.clear()
        _ONCE_BY_LAYOUT[(id(fn), key)] = (fn, once)
    return may_count(bound, prior, once)


def can_wrap(sig: Signature) -> bool:
    """Whether a masked wrapper of a function with this signature can be generated."""
    return not (sig.has_diff_inout or any(p.generic for p in sig.params))


def bind_written(call: Any, p: ParamInfo, t: Tensor, bound: Any, prior: bool) -> Any:
    """The argument of ``.bwds`` (``call``: backward_call's builder, its ``masks``, ``cleared``
    and ``fn``) for a tensor the call only writes. Interface tensors go through the masked
    wrapper where it can be made, so stores are counted (two to one element: refused);
    ``prior``: a tape still needs the value before the call, whose gradient is cleared
    where the call wrote (all of it for a vectorised ``out`` value, which covers the call)."""
    if prior and not needs_clearing(p, call.label):
        call.cleared.append((None, t.grad_out))
        return bound
    if not prior and not (p.tensor_kind == "idiff" and can_wrap(call.fn.signature)):
        return bound
    if not prior and p.name in call.stored_once:
        return bound  # one store per thread at its own grid element: nothing to count
    mask = _storage_mask(call, p, t)
    if prior:
        call.cleared.append((mask, t.grad_out))
    return mask.bind(p, bound)


def _storage_mask(call: Any, p: ParamInfo, t: Tensor) -> "WrittenMask":
    """The mask counting the stores into ``t``'s storage: one for the written parameters
    given one tensor (or views of its shape), so a store through each to one element counts
    twice (refused) while stores to elements of their own pass."""
    for mask in call.masks.values():
        if mask.storage is t.storage and mask.shape != tuple(t.shape):
            raise ValueError(
                f"{call.label}.bwds: parameters '{mask.names[0]}' and '{p.name}' are views of "
                f"one storage in shapes {mask.shape} and {tuple(t.shape)}, and the call writes "
                "both: pydiff cannot tell whether a store through each reached one element "
                "(the backward would add the gradients of both). Pass a tensor of its own to "
                "each written parameter"
            )
        if mask.storage is t.storage:
            mask.names.append(p.name)
            call.masks[p.name] = mask
            return mask
    mask = call.masks[p.name] = WrittenMask(call.device, t.shape)
    mask.storage, mask.names = t.storage, [p.name]
    return mask


def bind_in_place(call: Any, p: ParamInfo, t: Tensor, bound: Any, masked: bool) -> Any:
    """The same for an in-place tensor; ``masked``: its one gradient buffer needs the upstream
    passed through the elements the call does not write (``call.after[-1]`` holds the fresh
    gradient and the upstream)."""
    counted = p.tensor_kind == "idiff" and t.requires_grad and can_wrap(call.fn.signature)
    if not (masked or counted):
        return bound
    mask = call.masks[p.name] = WrittenMask(call.device, t.shape)
    if masked:
        grad, upstream = call.after[-1]
        call.passes.append((mask, upstream, grad))
    return mask.bind(p, bound)


def stored_once(fn: GeneratingFunction, bound: list) -> frozenset:
    """The interface tensors a call over a grid stores once per thread at its own element
    (single_store), where the grid has the tensor's shape: their stores need no counting.
    Two such parameters given one storage are refused (``_refuse_stored_twice``)."""
    once = _stores_once(fn, bound)
    if once:
        _refuse_stored_twice(fn, bound, once)
    return once


def _stores_once(fn: GeneratingFunction, bound: list) -> frozenset:
    """``stored_once`` without the refusal."""
    grids = [(p, v) for p, v in bound if is_grid(v)]
    source = fn.module.source
    if len(grids) != 1 or source is None or overloaded(fn):
        return frozenset()  # (an overload, maybe an imported one, is not the text read)
    p, grid = grids[0]
    shape = tuple(int(n) for n in grid.shape)
    if not grid_args.plain(grid, grid_args.index_type(p.type_name)[1]):  # (int2: 2 axes)
        return frozenset()
    tensors = [
        q.name
        for q, v in bound
        if type(v) is Tensor
        and q.access == "write"
        and q.tensor_kind == "idiff"
        and v.shape == shape
    ]
    if not tensors:
        return frozenset()
    return single_store.stores_once(source, fn.name, p.name, len(shape), tensors)


def _refuse_stored_twice(fn: GeneratingFunction, bound: list, once: frozenset) -> None:
    """Two parameters each thread stores at its own element, given one storage: every
    element is stored twice, the forward keeps the last store, and the backward would read
    its upstream once for each (the gradients of both stores added: wrong, silently)."""
    seen: dict[int, str] = {}
    for q, v in sorted(bound, key=lambda pv: pv[0].name not in once):  # (the once ones first)
        if type(v) is not Tensor or not q.writes_value:
            continue
        other = (
            seen.setdefault(id(v.storage), q.name) if q.name in once else seen.get(id(v.storage))
        )
        if other is not None and other != q.name:
            raise ValueError(
                f"{fn.label}.bwds: parameters '{other}' and '{q.name}' are the same tensor (or "
                f"views of one storage, shape {v.shape}), and the call writes both, each thread "
                f"its own element through '{other}': the forward keeps only the last store of an "
                "element, while the backward would add the gradients of both stores. Pass a "
                "tensor of its own to each written parameter"
            )


def masked_wrapper(fn: GeneratingFunction, masked: set[str]) -> Any:
    """The ShaderFunction of ``fn``'s masked wrapper (compiled once per set of parameters)."""
    sig = fn.signature
    if not can_wrap(sig):
        what = "a generic parameter" if any(p.generic for p in sig.params) else "inout parameters"
        raise ValueError(
            f"{fn.label}.bwds: the in-place tensor parameter(s) {', '.join(sorted(masked))} need "
            f"to record which elements the call wrote, through a generated wrapper that functions "
            f"with {what} cannot have yet; for IRWDiffTensor pass separate buffers "
            "(t.with_grads(grad_in=upstream, grad_out=g)) and add the upstream of the elements "
            "the call does not write yourself; for IWDiffTensor write to a new tensor"
        )
    return fn.generated(_kind(masked), wrapper_source(fn, masked))


#: What every refusal of the counts adds: they are read after the kernel ran, which pydiff
#: undoes (grad_restore: the buffers it added into, copied before it, put back).
_RESTORED = (
    ". The stores are counted as the backward runs; pydiff put back the gradient buffers "
    "it had added into: the gradients were left as they were before the call"
)


class WrittenMask:
    """One uint per element of a tensor a call writes: how many stores its backward saw;
    after them, how many elements were stored more than once and the lowest flat index of
    one (complemented), which the store backward records (shaders/pydiff_written_mask.slang)."""

    def __init__(self, device: Device, shape: tuple[int, ...]):
        self.device = device
        self.shape = tuple(shape)
        numel = math.prod(self.shape)
        # In a pooled buffer of float4s: a new one of 2^22 uints took lavapipe 9 ms to zero
        # (its pages touched for the first time), a reused one 0.5 ms.
        whole = allocate(device, (numel + 2,), "float", what="a written mask")
        uint = device.dtype("uint")
        whole = spy.Tensor(whole.storage, uint, [numel + 2], [1], 0)
        # The SlangPy tensors are kept here and bound without the flush of Tensor.native: the
        # zeroing stays queued, in order, with the call.
        Tensor(whole, device).zero_()
        self.counts = spy.Tensor(whole.storage, uint, [numel], [1], 0).view(self.shape)
        self.races = Tensor(spy.Tensor(whole.storage, uint, [2], [1], numel), device)
        self.storage: Any = None  # the storage of the tensor(s) whose stores it counts
        self.names: list[str] = []  # the written parameters given it (bind_written)

    def check_single_writes(self, scope: Any, label: str, name: str, kept: Any) -> None:
        """Raise if two threads stored one element: the forward raced on it, and its upstream
        was read once per store (a gradient counted twice). Reads back 8 bytes (the whole
        counts only to name the element of a refused call). ``kept``: the gradient buffers
        as they were before the call (``grad_restore.GradSnapshot``), put back first (None:
        the enclosing backward's ``scope.keeper`` puts them back as the refusal leaves it)."""
        scope.flush()
        raced, complement = (int(v) for v in self.races.numpy())
        if raced == 0:
            return
        message = self._refusal(label, name, raced, ~complement & 0xFFFFFFFF)
        if kept is not None:  # (else an enclosing backward keeps them: a tape's)
            kept.restore()
        raise ValueError(message + _RESTORED)

    def _refusal(self, label: str, name: str, raced: int, flat: int) -> str:
        if flat >= (n := math.prod(self.shape)):
            return (
                f"{label}: parameter '{name}' (shape {tuple(self.shape)}): the call stored "
                f"at an index outside the tensor ({_outside(flat, self.shape, n)}): the "
                "forward wrote outside it (lost, or into other memory), and no gradient can be "
                "right there. "
                "Check the indices the function stores at (spy.grid gives the last axis as .x)"
            )
        at = tuple(int(i) for i in np.unravel_index(flat, self.shape))
        stored = int(Tensor(self.counts, self.device).numpy()[at])
        if len(self.names) > 1:
            return (
                f"{label}: parameters {' and '.join(repr(n) for n in self.names)} are one "
                f"tensor (or views of one storage, shape {tuple(self.shape)}) and element "
                f"{at} was stored {stored} times through them ({raced} element(s) stored more "
                "than once): the forward keeps the last store, while the backward would add "
                "the gradients of each. Pass a tensor of its own to each written parameter"
            )
        return (
            f"{label}: parameter '{name}': element {at} was stored {stored} times "
            f"by one call ({raced} element(s) stored more than once): "
            "threads raced on it in the forward and its upstream gradient was counted "
            "once per store. Give each thread elements of its own (distinct indices)"
        )

    def bind(self, p: ParamInfo, bound: spy.Tensor) -> dict:
        """The wrapper's argument for ``p``: the tensor SlangPy would have bound, plus the mask."""
        return {"_type": _masked_type(p), "inner": bound, "written": self.counts}

    def pass_unwritten(self, scope: Any, upstream: Tensor, grad: Tensor) -> None:
        """grad += upstream wherever the call wrote nothing (in order with the call)."""
        lib = _library(self.device)
        scope.dispatch(lib.pydiff_pass_unwritten, self.counts, upstream.native, grad.native)

    def clear_written(self, scope: Any, grad: Tensor) -> None:
        """grad = 0 wherever the call wrote (in order with the call)."""
        scope.dispatch(_library(self.device).pydiff_clear_written, self.counts, grad.native)


def clear_overwritten(scope: Any, device: Device, cleared: list) -> None:
    """Zero the gradients ``(mask, grad)`` where the call wrote (a mask of None: all of it)."""
    for written, grad in cleared:
        if written is None:
            scope.clear(device, grad.native)
        else:
            written.clear_written(scope, grad)


def _library(device: Device) -> Any:
    def load() -> Any:
        return spy.Module.load_from_file(device.native, f"{MODULE}.slang")

    return device.cached("pydiff.written_mask", load)


def _outside(flat: int, shape: tuple, n: int) -> str:
    """An index outside a tensor of ``shape`` (``n`` elements), as the mask recorded it (a
    uint: -2 comes as 4294967294), in words: its flat index and, for more than one axis, the
    index it is with only the first axis out of range."""
    flat = flat - 2**32 if flat >= 2**31 else flat
    where = f"row-major flat index {flat}, where 0 to {n - 1} are inside"
    if len(shape) < 2 or math.prod(shape[1:]) == 0:
        return where
    first, rest = divmod(flat, math.prod(shape[1:]))
    index = (first, *(int(i) for i in np.unravel_index(rest, shape[1:])))
    return f"{where}: index {index}, if only the first axis is out of range"
