"""A forward call's record on the tape: the reads and writes a tape's backward follows, the
gradient buffers its outputs get, copies of values the call read and overwrote standing in for
them, and the closure that runs ``backward_call`` on the same arguments. A call of a function
without derivatives joins the tape as a cut, so a backward through it says no gradient flows.

    record(tape, fn, bound, options, out, snapshots, key)   # after forward_call ran fn
"""

from __future__ import annotations

from typing import Any

from . import written_mask
from .arguments import PLAIN, map_tensors, nested_tensors
from .backward_call import backward_call
from .bwds_checks import reads_a_gradient, with_values_of
from .errors import warn_once
from .grad_restore import unran
from .plan_layout import layout_key
from .signature import FunctionTarget
from .tape import Tape
from .tensor import Tensor
from .unrecorded import note_unrecorded


def record(
    tape: Tape, fn: FunctionTarget, bound: list, options: dict, out: Any, snapshots: dict, key: Any
) -> None:
    """Put a forward call on the tape, giving its outputs gradient buffers when needed
    (``key``: the call's layout, plan_layout's, or None)."""
    reads, writes, values, plain, views = [], [], [], [], []
    kept_in_place: list[Tensor] = []  # no_diff in-place: its gradient is cleared where written
    needs_grad = False
    for i, (p, value) in enumerate(bound):
        tensors = nested_tensors(value)  # the tensor itself, or those in a struct's fields
        if not tensors:
            values.append(value)
            continue
        desc = f"parameter '{p.name}' of {fn.label}"
        needs_grad = needs_grad or (p.reads_value and any_grad(value))
        if i in snapshots:
            # The backward reads the values before the call (the copies) and adds into the
            # gradient buffers of the tensors the caller holds.
            copies = nested_tensors(snapshots[i])
            pairs = [(with_values_of(t, c), t) for t, c in zip(tensors, copies)]
            views += pairs
            kept_in_place += [v for v, _ in pairs] if p.no_diff_tensor else []
            reads += [(desc, c) for c in copies]
            writes += tensors
            it = iter(v for v, _ in pairs)
            values.append(map_tensors(value, lambda t: next(it)))
        else:
            if p.reads_value:
                reads += [(desc, t) for t in tensors]
            if p.writes_value:
                writes += tensors
            values.append(value)
        if p.writes_value and (not (p.differentiable or p.is_diff_tensor) or p.no_diff_tensor):
            plain += tensors  # no gradient flows through them (RWTensor, no_diff, int)
    if type(out) is Tensor:
        writes.append(out)
    if not needs_grad:  # constants to gradients; its result, out and inout values: written whole
        whole = [out] + [v for p, v in bound if p.tensor_kind is None and p.io != "in"]
        note_unrecorded(writes, fn.label, [t for _, t in reads], whole)
        return
    # Tensors it only writes whose values before it are in the graph (a leaf wanting a gradient,
    # or an earlier call's result): no gradient reaches those where it wrote (cleared there).
    overwritten = [v for p, v in bound if p.writes_value and not p.reads_value]
    overwritten += [out] if type(out) is Tensor else []
    prior = frozenset(
        id(t.storage)
        for t in overwritten + kept_in_place
        if type(t) is Tensor and (t.requires_grad or t.producer is tape)
    )
    # Leaves (gradients of their own) this call overwrites, in place or as outputs.
    leaves = [t for t in overwritten if type(t) is Tensor and t.requires_grad]
    leaves += [t for _, t in views if t.requires_grad]
    if not fn.signature.differentiable:
        _record_cut(tape, fn, reads, writes, [t for _, t in views])
        return
    for t in writes:
        if not t.requires_grad and t.differentiable and all(t is not u for u in plain):
            t.requires_grad_(True, zero_later=True)  # the backward zeroes it (or a read)
    for view, t in views:  # in-place: the view shares the (maybe new) gradient buffers
        view.share_grads(t)
    bwd_values = tuple(values)
    extra = {k: v for k, v in options.items() if k != "_result"}
    if type(out) is Tensor:
        extra["_result"] = out

    def run_backward(entry: Any) -> None:
        backward_call(fn, bwd_values, dict(extra), prior)

    had = tuple(k for k, t in enumerate(writes) if t.requires_grad)  # (tape._check_versions)
    refuse = written_mask.may_be_counted(fn, bound, prior, key)  # (restoring)
    refuse = refuse or reads_a_gradient(bwd_values, out)  # (refusals of aliased buffers)
    refuse = refuse or unran(fn, layout_key(bwd_values, extra))  # (asked again at backward)
    tape.record(
        fn.label, reads, writes, run_backward, overwritten=leaves, with_grads=had, may_refuse=refuse
    )


def _record_cut(
    tape: Tape, fn: FunctionTarget, reads: list, writes: list, in_place: list[Tensor]
) -> None:
    """A function without derivatives read a tensor that wants a gradient: its float
    outputs join the tape, so a backward that needs a gradient through them says that none
    flows (once per call site) instead of leaving the inputs' gradients silently unchanged.
    An in-place argument's gradient buffer, which held the gradient of the value after the
    call, is zeroed: none flows to the value before it."""
    outs = [t for t in writes if t.differentiable]
    if not outs:
        return  # integer results (indices, masks): piecewise constant, no gradient to lose
    for t in outs:
        if not t.requires_grad:
            t.requires_grad_(True)
    wanting = ", ".join(
        [desc for desc, t in reads if t.requires_grad]
        + (["its in-place argument(s)"] if any(t.requires_grad for t in in_place) else [])
    )

    def run_backward(entry: Any) -> None:
        for t in in_place:
            if t.requires_grad:
                with t.device.queue.lock:  # in order with the batched backward
                    t.zero_grad(t.device.queue.encoder())
        warn_once(
            f"tape.backward: the gradient flows through {fn.label}, which is not "
            f"[Differentiable], so {wanting} get(s) no gradient through it. Mark it "
            f"[Differentiable] in {fn.module.file}, or pass t.detach() to say no gradient "
            "is wanted"
        )

    tape.record(fn.label, reads, writes, run_backward)


def any_grad(value: Any) -> bool:
    """Whether ``value`` is, or holds in its fields, a tensor that wants a gradient."""
    if type(value) is Tensor:
        return value.requires_grad
    return type(value) not in PLAIN and any(t.requires_grad for t in nested_tensors(value))
