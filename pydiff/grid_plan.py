"""Call plans for ``.bwds`` over a grid (``spy.grid``): the SlangPy differentiable-tensor
pattern, a function of a grid index and interface diff tensors it reads and writes.

After the full path (backward_call) ran a small call of one layout without error and needed
nothing after SlangPy's kernel (no store counts: ``written_mask.stored_once`` showed one store
per thread at its own element; no reductions, copies or clearing), a repeated call of that
layout checks per call only what a layout cannot fix (devices, policies, aliasing, stale
inputs, number ranges) and appends SlangPy's backward kernel to the deferred list. Whatever
it cannot decide it declines (``DECLINED``) before changing anything: the full path runs.

    remember_bwds(fn, key, args, bound, result, prior, call)   # after backward_call's full path
    plan = fn.bwds_plans.get(key); plan.run(fn, args, MISSING)  # None, or DECLINED
"""

from __future__ import annotations

import math
from typing import Any

from . import capturing, generated
from .arguments import MISSING, resolve_error, scratch
from .backward_failures import kept
from .backward_scope import active_scope
from .bwds_checks import primal_sink
from .backward_plan import BackwardPlan
from .call_plan import (
    DECLINED,
    deferrable,
    plan_natives,
    plan_numbers,
    plannable,
    written_since,
)
from .determinism import is_deterministic
from .grad_restore import backward_ran
from .grid_args import GRID
from .plan_layout import remember
from .policy import ZeroPolicy, get_zero_policy
from .signature import FunctionTarget
from .tensor import Tensor


def _kind(p: Any, t: Tensor, stored_once: frozenset) -> str | None:
    """How the full path bound tensor ``t`` at ``p`` (``BackwardArgs.tensor_arg``,
    backward_args), where a plan can do the same per call: 'read' (its gradient added into
    ``grad_out``), 'sink' (a read interface tensor wanting none: a throwaway buffer), 'plain'
    (values only), 'write' (its upstream read from ``grad_in``, stores not counted); None: a
    plan does not cover it."""
    if p.no_diff_tensor or p.io != "in":
        return None
    if p.tensor_kind == "plain":
        return "plain" if not p.writes_value and not t.requires_grad else None
    if p.tensor_kind not in ("idiff", "diff"):
        return None  # (a vectorised value: broadcast rules, its own reductions)
    if p.access == "read":
        if t.requires_grad:
            return "read"
        return "sink" if p.tensor_kind == "idiff" else None
    if p.access == "write" and t.requires_grad and p.name in stored_once:
        return "write"
    return None


class GridBackwardPlan:
    """A small ``.bwds`` over one grid of one layout, under ACCUMULATE or inside a larger
    backward (a tape's), SlangPy's kernel (large grids: the full path's generated kernel)."""

    __slots__ = ("tensors", "reads", "sinks", "plain", "writes", "floats", "numbers", "numel")
    __slots__ += ("descs",)

    def __init__(self, fn: FunctionTarget, key: tuple, bound: list, kinds: dict, numel: int):
        self.tensors = tuple(kinds)
        self.reads = tuple(i for i, k in kinds.items() if k == "read")
        self.sinks = tuple(i for i, k in kinds.items() if k == "sink")
        self.plain = tuple(i for i, k in kinds.items() if k == "plain")
        self.writes = tuple(i for i, k in kinds.items() if k == "write")
        self.floats, self.numbers = plan_numbers(key, bound)
        self.numel = numel
        # (as the full path names them to the zeroing policy's errors)
        self.descs = {i: f"{fn.label}: parameter '{bound[i][0].name}'" for i in self.reads}

    @staticmethod
    def make(fn: FunctionTarget, key: tuple, bound: list, result: Any, call: Any):
        """The plan for the layout ``key`` that the full path's builder ``call`` just ran
        (backward_args.BackwardArgs), or None."""
        if result is not MISSING or fn.signature.has_diff_inout or not plannable(fn):
            return None
        if call.masks or call.after or call.reductions or call.fixed or call.cleared:
            return None  # (work after SlangPy's kernel: the full path's)
        if call.no_grad or call.untracked or call.passes:
            return None
        grids = [v for _, v in bound if type(v) is GRID]
        if len(grids) != 1:
            return None
        numel = math.prod(grids[0].shape.as_tuple())
        if numel >= generated.MIN_ELEMENTS:
            return None  # (the full path generates its kernel)
        kinds = {}
        for i, (p, v) in enumerate(bound):
            if type(v) is Tensor:
                kinds[i] = _kind(p, v, call.stored_once)
                if kinds[i] is None:
                    return None
        if not any(k in ("read", "write") for k in kinds.values()):
            return None
        return GridBackwardPlan(fn, key, bound, kinds, numel)

    def _declines(self, fn: FunctionTarget, args: tuple, dev: Any, own_policy: bool) -> bool:
        """Whether this call needs the full path: another device, a tensor's own policy (off a
        larger backward), values an in-place call overwrote, aliasing, an input written since
        the forward call that made a written tensor."""
        for i in self.tensors:
            t = args[i]
            if t.device is not dev or own_policy and t.zero_policy is not None:
                return True
            if t.storage.before is not None:
                return True
        written = [args[i].storage for i in self.writes]
        upstream = [args[i].grad_in.storage for i in self.writes]
        if len({id(s) for s in written}) != len(written):
            return True  # (refuse_written_twice, written_mask.stored_once refuse it)
        grads = [args[i].grad_out.storage for i in self.reads]
        for i in self.reads + self.sinks + self.plain:
            st = args[i].storage
            if any(st is w for w in written) or any(st is g for g in grads):
                return True  # a tensor read and written (its gradient too): the full path's
            if i in self.reads and any(args[i].grad_out.storage is u for u in upstream):
                return True  # (refuse_shared_result_grad)
        for st in written:
            made = st.made_by
            if made is None or made[0] is not fn:
                continue
            if len(made) > 2 or written_since(args, made):
                return True  # (copies an in-place call kept: stale_reads compares them)
        return False

    def run(self, fn: FunctionTarget, args: tuple, result: Any) -> Any:
        """The backward, or DECLINED (nothing done) where the full path must decide. Inside a
        larger backward (a tape's) the kernel joins its batch, the zeroing policy acting once
        per gradient buffer through the scope, as on the full path."""
        if result is not MISSING or is_deterministic() or capturing.recording() is not None:
            return DECLINED
        scope = active_scope()
        if scope is None and get_zero_policy() is not ZeroPolicy.ACCUMULATE:
            return DECLINED
        if self.numel >= generated.MIN_ELEMENTS:
            return DECLINED
        generated.check_switch_planned()  # (the full path reads PYDIFF_GENERATED every call)
        dev = fn.module.device
        if scope is not None and scope.device is not dev and scope.device is not None:
            return DECLINED  # (None: a scope running SlangPy's kernels at once, as here)
        if self._declines(fn, args, dev, scope is None):
            return DECLINED
        native = plan_natives(fn, args, self.floats, self.numbers, dev)
        if scope is not None:
            for i in self.reads:  # (STRICT's refusals before any policy zeroes a buffer)
                scope.check_stale(args[i], args[i].grad_out, self.descs[i])
            for i in self.reads:
                scope.before_accumulate(args[i], args[i].grad_out, self.descs[i])
            self._bind(dev, args, native, True)
            try:
                scope.dispatch(fn.native_bwds, *native)
            except Exception as exc:
                raise kept(fn, resolve_error(fn, exc)) from None
            return None  # (the scope marks the gradients as its results)
        queue = dev.queue
        defer = deferrable(queue)
        if not defer:
            queue.flush_deferred()
        self._bind(dev, args, native, False)
        try:
            if defer:
                append = fn.native_bwds.append_to
                held = [native[i] for i in self.tensors]
                queue.defer(lambda enc: append(enc, *native), held)
            else:
                fn.native_bwds(*native)
        except Exception as exc:
            raise kept(fn, resolve_error(fn, exc)) from None
        label = fn.bwds_label
        for i in self.reads:
            args[i].grad_out.storage.mark_result(label)
        return None

    def _bind(self, dev: Any, args: tuple, native: list, flush: bool) -> None:
        """The SlangPy tensors the full path binds (``BackwardArgs.tensor_arg``),
        into ``native``."""
        for i in self.reads:
            native[i] = args[i].bind(True, flush)
        for i in self.plain:
            native[i] = args[i].bind(False, flush)
        for i in self.sinks:
            sink = scratch(dev, args[i], "sink")
            values = args[i].bind(False, flush)
            native[i] = values.with_grads(grad_in=sink, grad_out=sink, zero=False)
        for i in self.writes:
            t = args[i]
            native[i] = t.bind_upstream(lambda t=t: primal_sink(dev, t), flush)


def remember_bwds(
    fn: FunctionTarget,
    key: Any,
    args: tuple,
    bound: list,
    result: Any,
    prior: frozenset,
    call: Any = None,
) -> None:
    """Keep the plan for the ``.bwds`` layout ``key`` that the full path just ran (``call``:
    its builder, when it took the general path)."""
    backward_ran(fn, key)  # (a tape's backward of this layout: not expected to refuse)
    if key is None or prior or len(args) != len(fn.params) or key in fn.bwds_plans:
        return  # (a plan there declined this call: the same plan again)
    if len(key) != len(args) + 2 * (result is not MISSING):
        return  # the result given positionally (f.bwds(x, y)): the key does not mark it
    if call is not None and any(type(v) is GRID for _, v in bound):
        remember(fn, fn.bwds_plans, key, GridBackwardPlan.make(fn, key, bound, result, call))
    else:
        remember(fn, fn.bwds_plans, key, BackwardPlan.make(fn, key, bound, result, prior))
