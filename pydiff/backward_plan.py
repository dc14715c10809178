"""The call plan of a repeated ``.bwds`` (see call_plan): a layout whose tensors are all
vectorised ``in`` parameters of the result's shape, each with a gradient buffer to add into
or none (data: bound without gradients, the kernel of that gradient layout), under
ACCUMULATE or inside a larger backward's scope. Per call: devices, policies, stale inputs,
aliasing of gradient buffers with the upstream, numbers; then pydiff's generated kernel or
SlangPy's, deferred.

    plan = BackwardPlan.make(fn, key, bound, result, prior)   # after the full path ran it
    plan.run(fn, args, result)                                  # None, or DECLINED
"""

from __future__ import annotations

from typing import Any

from . import capture_refusals, capturing, generated
from .arguments import resolve_error
from .backward_scope import active_scope
from .bwds_checks import upstream_arg
from .unrecorded import warn_made_off_tape
from .call_plan import (
    DECLINED,
    may_generate,
    deferrable,
    numbers_checked,
    plan_natives,
    plan_numbers,
    plannable,
    written_since,
)
from .determinism import REPLAY_ADVICE, is_deterministic, off_at_capture
from .planned_kernels import BackwardLaunch
from .policy import ZeroPolicy, get_zero_policy
from .signature import FunctionTarget
from .tensor import Tensor
from .unrecorded import MADE_OFF_TAPE

_ACCUMULATE = ZeroPolicy.ACCUMULATE


class BackwardPlan:
    """A ``.bwds`` of one layout adding gradients under ACCUMULATE (or in a larger backward's
    scope): every tensor an ``in`` parameter of its own element type and the result's shape,
    with a gradient buffer to add into or none at all (data); the result a tensor with
    gradient buffers."""

    __slots__ = (
        "tensors", "floats", "numbers", "numel", "calls", "planned_after", "launch", "descs",
        "with_grads", "data", "node", "device",
    )  # fmt: skip

    def __init__(self, fn: FunctionTarget, key: tuple, bound: list, result: Tensor):
        self.tensors = tuple(i for i, (_, v) in enumerate(bound) if type(v) is Tensor)
        # those with a gradient buffer (the others: data, bound without gradients, as the
        # full path binds them, through the kernel of that gradient layout)
        self.with_grads = tuple(i for i in self.tensors if bound[i][1].grad_out is not None)
        self.data = tuple((i, bound[i][0].name) for i in self.tensors if i not in self.with_grads)
        no_grad = tuple(name for _, name in self.data)
        self.node = fn.bwds_kernel(no_grad) if no_grad else fn.native_bwds
        # (as the full path names them to the zeroing policy's errors)
        self.descs = {i: f"{fn.label}: parameter '{bound[i][0].name}'" for i in self.tensors}
        self.floats, self.numbers = plan_numbers(key, bound)
        self.numel = result.numel  # generated.call_backward decides by it (in the layout)
        self.calls = 0  # (as ForwardPlan's)
        self.planned_after = generated.planned_after(fn.module.device)
        self.launch = BackwardLaunch(len(bound), result.numel, fn.module.device.kernels)
        self.device = fn.module.device  # (a module's, fixed)

    @staticmethod
    def make(fn: FunctionTarget, key: tuple, bound: list, result: Any, prior: frozenset):
        """The plan for the ``.bwds`` of layout ``key`` that just ran through the fast case,
        or None."""
        sig = fn.signature
        if prior or sig.has_diff_inout or type(result) is not Tensor or not plannable(fn):
            return None
        if result.grad_in is None or result.grad_out is None:
            return None
        for p, v in bound:
            if type(v) is Tensor and not (
                p.tensor_kind is None
                and p.io == "in"
                and p.differentiable
                and (v.grad_out is not None or not v.requires_grad)
                and v.element_type.full_name == p.type_name
                and v.shape == result.shape
            ):
                return None
        return BackwardPlan(fn, key, bound, result)

    def _generated(self) -> Any:
        """This call's generated launch; None: SlangPy's call; DECLINED: the full path's."""
        large = self.numel >= generated.MIN_ELEMENTS
        if not may_generate(self, large) or not self.launch.covered:
            return DECLINED if large else None
        return self.launch

    def run(self, fn: FunctionTarget, args: tuple, result: Any) -> Any:
        """The backward, or DECLINED (nothing done) where the full path must decide. Inside
        a larger backward (a tape's) the kernel joins its batch, the zeroing policy acting
        once per gradient buffer through the scope, as on the full path."""
        scope = active_scope()
        if scope is None and get_zero_policy() is not _ACCUMULATE or is_deterministic():
            return DECLINED
        launch = self._generated()
        if launch is DECLINED:
            return DECLINED
        dev = self.device
        if result.device is not dev:
            return DECLINED
        if scope is not None and scope.device is not dev:
            return DECLINED  # (a scope running SlangPy's kernels at once)
        if capturing.recording() is not None:  # (a replay refuses deterministic mode)
            capture_refusals.planned_bwds(fn.bwds_label, self, launch, args, result)
            capturing.check_on_replay(fn.bwds_label, off_at_capture, REPLAY_ADVICE)
        made = result.storage.made_by
        if made is not None and made[0] is fn and written_since(args, made):
            return DECLINED  # (the full path refuses it, or uses a copy kept)
        grad_in = result.grad_in
        upstream = grad_in.storage
        for i in self.tensors:
            t = args[i]
            if t.device is not dev or t.storage.before is not None:
                return DECLINED  # (before: values an in-place call overwrote: bwds_checks)
        if MADE_OFF_TAPE:  # data computed off a tape (x[1:] of an x with a gradient): warned
            for i, name in self.data:  # that no gradient flows back through it (full path's)
                warn_made_off_tape(fn, name, args[i])
        grads = {}
        for i in self.with_grads:
            t = args[i]
            if scope is None and t.zero_policy is not None:
                return DECLINED
            g = t.grad_out
            if g.storage is upstream:
                return DECLINED  # refused by the full path
            grads[i] = g
        for i, _ in self.data if grads else ():  # a gradient buffer read as data (x.grad):
            if any(args[i].storage is g.storage for g in grads.values()):  # RESET would
                return DECLINED  # clear it first: the full path refuses it (bwds_checks)
        if launch is None:
            native = plan_natives(fn, args, self.floats, self.numbers, dev)
        else:  # (the kernel binds the numbers itself: their range checks only)
            numbers_checked(fn, args, self.floats, self.numbers, dev)
            native = None
        if scope is not None:
            return self._in_scope(fn, args, result, scope, native, grads, launch)
        label = fn.bwds_label
        if launch is not None and launch.run(fn, args, grad_in, grads):
            for g in grads.values():
                g.storage.mark_result(label)
            return None
        if launch is not None and self.numel >= generated.MIN_ELEMENTS:
            return DECLINED  # the full path counts why the kernel was declined
        capture_refusals.refuse_planned(fn.bwds_label, self, launch)  # (in a capture)
        if native is None:
            native = plan_natives(fn, args, self.floats, self.numbers, dev)
        queue = dev.queue
        if deferrable(queue):  # (as ForwardPlan._deferred)
            held = []  # (a loop, no comprehension: this runs on every call)
            for i in self.tensors:
                held.append(bound := args[i].bind(True, False))
                native[i] = bound
            held.append(upstream := upstream_arg(dev, result, False))
            append = self.node.append_to
            try:
                queue.defer(lambda enc: append(enc, *native, _result=upstream), held)
            except Exception as exc:
                raise resolve_error(fn, exc) from None
        else:
            queue.flush_deferred()  # (a batch this joins is ordered by its own scope)
            for i in self.tensors:
                native[i] = args[i].bind(True)
            try:
                self.node(*native, _result=upstream_arg(dev, result))
            except Exception as exc:
                raise resolve_error(fn, exc) from None
        for g in grads.values():
            g.storage.mark_result(label)
        return None

    def _in_scope(
        self, fn: Any, args: tuple, result: Any, scope: Any, native: Any, grads: dict, launch: Any
    ) -> Any:
        """``run`` inside ``scope`` (with a device): the policy first (STRICT's refusal before
        any buffer changes), then the kernel into the scope's batch."""
        large = launch is not None and self.numel >= generated.MIN_ELEMENTS
        if large and capturing.recording() is None:
            return DECLINED  # (a large one: the full path's generated kernel, in scope)
        for i, g in grads.items():
            scope.check_stale(args[i], g, self.descs[i])
        for i, g in grads.items():
            scope.before_accumulate(args[i], g, self.descs[i])
        if launch is not None and launch.run(fn, args, result.grad_in, grads):
            return None
        capture_refusals.refuse_planned(fn.bwds_label, self, launch)  # (in a capture)
        if native is None:
            native = plan_natives(fn, args, self.floats, self.numbers, fn.module.device)
        for i in self.tensors:
            native[i] = args[i].bind(True)
        try:
            scope.dispatch(self.node, *native, _result=upstream_arg(fn.module.device, result))
        except Exception as exc:
            raise resolve_error(fn, exc) from None
        return None
