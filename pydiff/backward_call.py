""".bwds of a shader function: bind each parameter's gradient buffers, apply the zeroing
policy, run SlangPy's backward kernel, then finish what SlangPy leaves undone.

Everything SlangPy 0.43 leaves to the user, or gets silently wrong, is handled here: which
gradient buffers each parameter needs, scratch buffers for inputs that need no gradient,
separate grad_in/grad_out for values a call both reads and writes, the ``inout`` backward
(through a generated wrapper), broadcast parameters summed in a fixed order, zeroing
policies and plain numbers as upstream gradients.

    backward_call(fn, (2.0, x), {"_result": y.with_grads(ones=True)})
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import slangpy as spy

from . import backward_failures, broadcast_grad, generated_calls, loop_bounds, written_mask
from . import capturing, generated_hold
from .grad_restore import GradSnapshot, may_count, may_overflow, resets
from .arguments import (
    MISSING,
    PLAIN,
    bind_arguments,
    prepare_arguments,
    check_device,
    deep_bind,
    fwd_tensor_struct,
    resolve_error,
    scratch,
)
from .call_plan import DECLINED
from .grid_plan import remember_bwds
from .plan_layout import layout_key
from .call_shape import refuse_struct_grads
from .bwds_checks import (
    bwds_arguments_checked,
    half_seed,
    maybe_broadcast,
    positional_result,
    primal_sink,
    refuse_shared_result_grad,
    refuse_stale,
    shared_grads,
    upstream_arg,
    values_read,
    warn_no_gradient,
)
from .backward_scope import BackwardScope, active_scope, backward_scope
from .determinism import is_deterministic, warn_nondeterministic
from .fixed_point_grad import FixedPointAccumulator
from .policy import ZeroPolicy, get_zero_policy
from .signature import FunctionTarget, ParamInfo, warn_struct_fields
from .bwds_binding import bind_all, dispatch, drop_held
from .tensor import Tensor
from .written_mask import WrittenMask as Mask

_SCALAR_RESULTS = {"float", "half", "double"}


class _Backward:
    """Builds the native arguments of one ``.bwds`` call and the work to do after it."""

    def __init__(self, fn: FunctionTarget, scope: BackwardScope, prior: frozenset = frozenset()):
        self.fn = fn
        self.prior = prior  # storages whose value before the call a tape's graph still needs
        self.cleared: list[tuple[Mask | None, Tensor]] = []  # (None: all) written grads
        self.scope = scope
        self.label = fn.label
        self.after: list[tuple[Tensor, Tensor]] = []  # (temp gradient, destination) copies
        self.no_grad: list[str] = []  # vectorised parameters bound without a gradient
        self.device = fn.module.device
        self.shape: tuple[int, ...] | None = None  # the call's shape, when pydiff can tell
        self.separate: set[int] = set()  # grad buffers several parameters add into
        self.reductions: list[tuple[spy.Tensor, Tensor]] = []  # (full-shape grad, parameter)
        self.fixed: list[tuple[FixedPointAccumulator, spy.Tensor]] = []  # (words, add into)
        self.untracked: list[str] = []  # deterministic mode: gradients left to float atomics
        self.masks: dict[str, Mask] = {}  # parameters bound through the masked wrapper
        self.passes: list[tuple[Mask, Tensor, Tensor]] = []  # (mask, upstream, grad)
        self.stored_once: frozenset = frozenset()  # written tensors needing no store counts
        self.wanted = False  # a direct .bwds where some argument wants a gradient
        self.kept: GradSnapshot | None = None  # a counted call's gradients before it

    def scratch_grads(self, t: Tensor, role: str) -> spy.Tensor:
        """Gradient buffers for a tensor whose gradient nobody asked for."""
        return scratch(self.device, t, role)

    def _desc(self, p: ParamInfo) -> str:
        return f"{self.label}: parameter '{p.name}'"

    def accumulating(self, t: Tensor, p: ParamInfo, desc: str | None = None) -> None:
        """The policy of ``t`` applied before this backward adds into its gradient."""
        grad, desc = t.grad_out, desc or self._desc(p)
        if grad.shape != t.shape:
            raise ValueError(f"{desc}: gradient shape {grad.shape} != primal {t.shape}")
        if self.kept is None and resets(self.scope, t, grad):  # (kept: a refusal puts back)
            self.kept = GradSnapshot(self.scope, self.device)
        if self.kept is not None:
            self.kept.keep(grad)  # (before the policy may zero it)
        self.scope.before_accumulate(t, grad, desc)

    def _needs_upstream(self, t: Tensor, p: ParamInfo, what: str) -> None:
        if not t.requires_grad and (what == "written" or self.wanted):
            raise ValueError(
                f"{self._desc(p)} is {what} by the call, so its backward reads the upstream "
                f"gradient from the tensor's grad buffer, but the tensor has none; pass "
                f"t.with_grads(...) holding dL/d{p.name} (or ones: .with_grads(ones=True))"
            )

    def own_primal(self, t: Tensor, bound: spy.Tensor, keep: bool) -> spy.Tensor:
        """``bound``'s gradient buffers on values of the backward's own. A backward kernel
        reruns the forward, which writes into written parameters: into ``t`` that would change
        the caller's values behind the version counters (a second backward over a recording
        would then read the wrong values). ``keep``: the call also reads them (a copy)."""
        primal = t.copy_values().native if keep else primal_sink(self.device, t)
        return primal.with_grads(grad_in=bound.grad_in, grad_out=bound.grad_out, zero=False)

    def separate_grads(self, t: Tensor, p: ParamInfo) -> spy.Tensor:
        """Bind a read-and-written tensor with distinct grad_in and grad_out buffers."""
        if not t.requires_grad:  # (bound unflushed: what SlangPy records comes after)
            return t.bind(False, False).with_grads(
                grad_in=self.scratch_grads(t, "zeros"),
                grad_out=self.scratch_grads(t, "sink"),
                zero=False,
            )
        if t.grad_in is not t.grad_out:
            self.accumulating(t, p)
            return t.bind(True)
        # One shared buffer: it holds the upstream gradient now and must hold the gradient
        # w.r.t. the value before the call afterwards.
        upstream = t.grad_in
        result = t.new_grad_buffer()
        self.after.append((result, upstream))
        values, gi, go = (u.bind(False, False) for u in (t, upstream, result))
        return values.with_grads(grad_in=gi, grad_out=go, zero=False)

    def tensor_arg(self, p: ParamInfo, t: Tensor) -> spy.Tensor:
        check_device(self.fn, t, f"parameter '{p.name}'")
        refuse_struct_grads(self.fn.label, p, t)
        if p.tensor_kind == "plain" or (p.tensor_kind is None and not p.differentiable):
            warn_no_gradient(self.fn, p, t)
            if p.writes_value:  # the backward reruns the forward: not into the caller's values
                return t.copy_values().native if p.reads_value else primal_sink(self.device, t)
            return t.native
        if p.tensor_kind == "diff" and not t.requires_grad and not p.no_diff_tensor:
            raise ValueError(
                f"{self._desc(p)} is a concrete {p.type_name}: it needs a tensor with gradient "
                f"buffers (requires_grad=True / .with_grads()); SlangPy would bind a null "
                f"descriptor. For data that needs no gradient use I{p.type_name}"
            )
        if p.no_diff_tensor and p.access in ("write", "read_write"):
            # no_diff: its stores' backward reads a zero upstream (the caller's would flow to
            # what was stored), its loads' adds go to a sink; its gradient stays as it was
            warn_no_gradient(self.fn, p, t)
            keep = p.access == "read_write"
            primal = t.copy_values().native if keep else primal_sink(self.device, t)
            zeros, sink = self.scratch_grads(t, "zeros"), self.scratch_grads(t, "sink")
            bound = primal.with_grads(grad_in=zeros, grad_out=sink, zero=False)
            if t.requires_grad and id(t.storage) in self.prior:  # (a tape: the value before
                return written_mask.bind_written(self, p, t, bound, True)  # gets none there)
            return bound
        if p.io == "out" or p.access == "write":
            self._needs_upstream(t, p, "written")
            bound = self.own_primal(t, t.bind(True), keep=False)
            return written_mask.bind_written(self, p, t, bound, id(t.storage) in self.prior)
        if p.access == "read_write":
            self._needs_upstream(t, p, "read and written")  # (others' gradients need it)
            masked = written_mask.needs_mask(p, t, self.label)
            bound = self.own_primal(t, self.separate_grads(t, p), keep=True)
            return written_mask.bind_in_place(self, p, t, bound, masked)
        if not t.requires_grad or p.no_diff_tensor and p.access == "read":
            if p.no_diff_tensor:
                warn_no_gradient(self.fn, p, t)  # (no_diff: the loads' adds go to a sink)
            if p.tensor_kind is None:
                # A vectorised value with no gradient wanted: bind the primal alone, and
                # make that part of the kernel's identity (SlangPy's call cache is blind to
                # gradients and would reuse the wrong kernel for a later call).
                self.no_grad.append(p.name)
                return t.bind(False, False)
            # Interface diff tensors need a gradient buffer on Vulkan/D3D12: a throwaway one.
            sink = self.scratch_grads(t, "sink")
            return t.native.with_grads(grad_in=sink, grad_out=sink, zero=False)
        self.accumulating(t, p)
        if p.tensor_kind is None and p.differentiable:
            return self._vectorised_grad(p, t)
        return t.bind(True)

    def _vectorised_grad(self, p: ParamInfo, t: Tensor) -> spy.Tensor:
        """Bind a vectorised input's gradient: a full-shape buffer summed after the call when
        the value is broadcast (or, in deterministic mode, shared with another parameter)."""
        broadcast = broadcast_grad.is_broadcast(t, self.shape, p)
        shared = id(t.grad_out.storage) in self.separate
        if not (broadcast or shared):
            return t.bind(True)
        if not broadcast_grad.expandable(t):
            self.untracked.append(
                f"the gradient of parameter '{p.name}' ({t.dtype}, broadcast or shared) is added "
                f"with float atomics: pydiff sums only {'/'.join(broadcast_grad.EXPANDABLE)} "
                "gradients itself; pass a full-shape tensor and sum it with pydiff.ops.sum"
            )
            return t.bind(True)
        native = broadcast_grad.expand(
            self.scope, self.device, t, self.shape if broadcast else None, len(self.reductions), p
        )
        self.reductions.append((native.grad_out, t))
        return native

    def fwd_arg(self, p: ParamInfo, t: Tensor) -> dict:
        """pydiff's FwdDiffTensor: gradients go to a fixed-point accumulator, added into the
        gradient buffer SlangPy would have used after the call."""
        bound = self.tensor_arg(p, t)
        acc = FixedPointAccumulator(
            self.scope, self.device, t.numel, self._desc(p), len(self.fixed), t.requires_grad
        )
        if t.requires_grad:
            self.fixed.append((acc, bound.grad_out))
        return fwd_tensor_struct(self.fn, p, t, None, bound.grad_in, acc.fields())

    def after_call(self) -> None:
        """Sum the full-shape and fixed-point gradients into their buffers (in order), and
        pass the upstream through the elements in-place calls did not write."""
        for name, mask in self.masks.items():
            mask.check_single_writes(self.scope, self.label, name, self.kept)
        if not self.fixed:
            self.kept = None  # (its copies back to the pool; kept for the overflow checks)
        for mask, upstream, grad in self.passes:
            mask.pass_unwritten(self.scope, upstream, grad)
        written_mask.clear_overwritten(self.scope, self.device, self.cleared)
        for acc, grad in self.fixed:
            acc.add_into(grad)
        for full, t in self.reductions:
            broadcast_grad.reduce_into(self.scope, self.device, full, t)

    def inout_args(self, p: ParamInfo, value: Any) -> dict[str, Any]:
        """The two wrapper arguments (value before, value after) for an ``inout`` parameter."""
        if not isinstance(value, Tensor):
            return {f"{p.name}__in": deep_bind(value), f"{p.name}__out": deep_bind(value)}
        check_device(self.fn, value, f"parameter '{p.name}'")
        self._needs_upstream(value, p, "read and written")
        both = self.separate_grads(value, p)
        return {
            f"{p.name}__in": value.bind(False, False).with_grads(
                grad_in=both.grad_out, grad_out=both.grad_out, zero=False
            ),
            f"{p.name}__out": primal_sink(self.device, value).with_grads(
                grad_in=both.grad_in, grad_out=both.grad_in, zero=False
            ),
        }

    def result_arg(self, result: Any, ret_name: str) -> Any:
        if type(result) is Tensor and result.grad_in is not None:
            if result.device is not self.device:
                check_device(self.fn, result, "_result")
            if id(result.storage) in self.prior:  # overwritten: its value before gets none
                self.cleared.append((None, result.grad_in))
            return upstream_arg(self.device, result, False)  # (unflushed: recorded in order)
        if result is MISSING:
            if ret_name == "void":
                return MISSING
            raise ValueError(
                f"{self.label}.bwds needs _result=: the upstream gradient of its {ret_name} "
                "result, as the result tensor with gradients (y.with_grads(ones=True)) or a number"
            )
        if isinstance(result, Tensor):
            check_device(self.fn, result, "_result")
            if not result.requires_grad:
                raise ValueError(
                    f"{self.label}.bwds: _result has no gradient buffer to read the upstream "
                    "gradient from; pass y.with_grads(...) holding dL/dy (or "
                    ".with_grads(ones=True))"
                )
            return upstream_arg(self.device, result, False)
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            if ret_name not in _SCALAR_RESULTS:
                raise TypeError(
                    f"{self.label}.bwds: a number as _result seeds a scalar result, but the "
                    f"result is {ret_name}; pass a tensor with gradients"
                )
            if ret_name == "half":
                return half_seed(self.label, self.device, self.shape, float(result))
            # SlangPy reads a plain float as the primal and seeds a zero gradient.
            return spy.diffPair(p=0.0, d=float(result))
        if isinstance(result, spy.DiffPair):
            return result
        # NumPy arrays and raw SlangPy tensors are silently read as zero gradients by SlangPy.
        raise TypeError(
            f"{self.label}.bwds: _result must be a pydiff.Tensor with gradients, a number or a "
            f"slangpy.diffPair, not {type(result).__name__}; e.g. "
            "pydiff.tensor(upstream).with_grads() and copy the upstream into its .grad"
        )

    def finish(self) -> None:
        for temp, dest in self.after:
            self.scope.keep(dest)
            self.scope.flush()
            dest.copy_(temp)
            self.scope.mark_result(dest)


def _fast_backward(fn: FunctionTarget, bound: list, options: dict, result: Any) -> bool:
    """The common case without the general machinery: gradients simply added under the
    ACCUMULATE policy, outside any larger backward. Returns False to take the general path."""
    if active_scope() is not None or get_zero_policy() is not ZeroPolicy.ACCUMULATE:
        return False
    if is_deterministic():
        return False
    dev = fn.module.device
    native_args = []
    written = []
    shape = result.shape if type(result) is Tensor else None
    for p, value in bound:
        if type(value) is Tensor:
            if value.device is not dev:
                return False
            if p.tensor_kind is None:
                if value.element_type.full_name != p.type_name:
                    return False  # a float tensor for a float3: maybe broadcast, summed apart
                if shape is None:
                    shape = value.shape
                elif value.shape != shape:
                    return False  # maybe broadcast: its gradient is summed apart
            if p.differentiable and p.io == "in" and p.tensor_kind is None:
                grad = value.grad_out
                if grad is None or value.zero_policy is not None:
                    return False
                written.append(grad)
                native_args.append(value.bind(True))
            elif p.writes_value and not p.differentiable:
                return False  # the general path binds a copy for the rerun forward to write
            elif p.tensor_kind == "plain" or (p.tensor_kind is None and not p.differentiable):
                warn_no_gradient(fn, p, value)
                native_args.append(value.native)
            else:
                return False
        elif type(value) in PLAIN:
            native_args.append(value)
        else:
            return False
    if generated_calls.call_backward(fn, bound, options, result):
        for grad in written:
            grad.storage.mark_result(fn.bwds_label)
        return True
    if type(result) is Tensor and result.grad_in is not None and result.device is dev:
        options["_result"] = upstream_arg(dev, result)
    elif not (result is MISSING and fn.signature.return_type == "void"):
        return False
    try:
        fn.native_bwds(*native_args, **options)
    except Exception as exc:
        raise backward_failures.kept(fn, resolve_error(fn, exc)) from None
    for grad in written:
        grad.storage.mark_result(fn.bwds_label)
    return True


def backward_call(
    fn: FunctionTarget,
    args: tuple,
    kwargs: dict,
    prior: frozenset = frozenset(),
    tried: bool = False,
) -> None:
    """``fn.bwds(*args, **kwargs)``. ``prior``: ids of the storages (``id(t.storage)``) that
    the call overwrites while a tape's graph still needs their values before it (their
    gradients are cleared where the call wrote them). ``tried``: its plan declined it."""
    key = layout_key(args, kwargs)  # (no plan with prior; the layout's backward ran: kept)
    plan = fn.bwds_plans.get(key) if not prior else None  # a layout run before: per-call work
    run = plan is not None and not tried
    if run and plan.run(fn, args, kwargs.get("_result", MISSING)) is not DECLINED:
        return
    capturing.refuse_full_path(fn.bwds_label, plan is not None, capturing.FIRST_BWDS)
    # Deferred kernels go first (a batch this joins is ordered by its own scope).
    generated_hold.flush_deferred(fn, kwargs.get("_result", MISSING))  # (a fusable one kept)
    label = fn.label
    if not fn.signature.differentiable:
        raise TypeError(
            f"{label} is not differentiable: mark it [Differentiable] in "
            f"{fn.module.file} to call .bwds"
        )
    if fn.module.traps:
        fn.check_traps()
    backward_failures.check(fn)  # (SlangPy crashes building a failed backward again)
    args, kwargs = positional_result(fn, args, kwargs)
    bound, options = bind_arguments(fn, args, kwargs)
    loop_bounds.check(fn, bound)
    bwds_arguments_checked(fn, bound, kwargs.get("_result"))
    bound = values_read(fn, bound)
    warn_struct_fields(fn, bound)
    refuse_shared_result_grad(fn, bound, kwargs.get("_result"))
    prepare_arguments(fn, bound, options)
    result = options.pop("_result", MISSING)
    if type(result) is Tensor:  # (a struct result: SlangPy's raw "RWDiffTensor<P, 1>")
        refuse_struct_grads(fn.label, SimpleNamespace(name="_result"), result)
    if not (fn.signature.has_diff_inout or prior) and _fast_backward(fn, bound, options, result):
        return remember_bwds(fn, key, args, bound, result, prior)
    deterministic = is_deterministic()
    if deterministic:
        warn_nondeterministic(fn)
    with backward_scope(fn.bwds_label) as scope:
        refuse_stale(scope, fn, bound)
        if generated_calls.call_backward_in_scope(fn, bound, options, result, scope, prior):
            return remember_bwds(fn, key, args, bound, result, prior)
        b = _Backward(fn, scope, prior)
        b.shape = broadcast_grad.call_shape(fn, bound, result)
        b.stored_once = written_mask.stored_once(fn, bound)
        b.wanted = scope.label == fn.bwds_label and any(
            type(v) is Tensor and v.requires_grad and not p.no_diff for p, v in bound
        )
        if scope.keeper is None and (may_count(bound, prior, b.stored_once) or may_overflow(fn)):
            b.kept = GradSnapshot(scope, b.device)  # (else the enclosing backward keeps them)
        if deterministic:
            b.separate = shared_grads(bound)
            if b.shape is None:
                b.untracked += maybe_broadcast(bound, result)
        use_wrapper = fn.signature.has_diff_inout
        native_kwargs: dict[str, Any] = {}
        clears = bind_all(b, bound, native_kwargs, use_wrapper, options, result)
        native_args = list(native_kwargs.values())
        try:
            if not use_wrapper and generated_calls.grid_backward(
                fn, bound, native_args, options, b
            ):
                pass  # (a call over a grid: the generated kernel, the same arguments)
            elif b.masks:
                node = written_mask.masked_wrapper(fn, set(b.masks)).bwds_kernel(tuple(b.no_grad))
                dispatch(scope, node, clears, (), {**native_kwargs, **options})
            elif use_wrapper:
                node = fn.bwds_kernel(tuple(b.no_grad), wrapper=True)
                dispatch(scope, node, clears, (), {**native_kwargs, **options})
            else:
                node = fn.bwds_kernel(tuple(b.no_grad)) if b.no_grad else fn.native_bwds
                dispatch(scope, node, clears, tuple(native_args), options)
        except Exception as exc:
            drop_held(scope, clears)  # (RESET's held-back zeroings: never done)
            if b.kept is not None:  # (a policy may have zeroed what it kept: put back)
                b.kept.restore()
            raise backward_failures.kept(fn, resolve_error(fn, exc)) from None
        b.after_call()
        if deterministic and b.untracked:
            warn_nondeterministic(fn, b.untracked)
        b.finish()
        if b.kept is not None:  # (fixed-point sums: their check refuses one out of range)
            try:
                scope.run_checks()
            except Exception:
                b.kept.restore()
                raise
    remember_bwds(fn, key, args, bound, result, prior, b)
