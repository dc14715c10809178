""".bwds of a shader function: bind each parameter's gradient buffers, apply the zeroing
policy, run SlangPy's backward kernel, then finish what SlangPy leaves undone.

Everything SlangPy 0.43 leaves to the user, or gets silently wrong, is handled here and in
``backward_args`` (what each parameter binds, ``BackwardArgs``): which gradient buffers each
parameter needs, scratch buffers for inputs that need no gradient,
separate grad_in/grad_out for values a call both reads and writes, the ``inout`` backward
(through a generated wrapper), broadcast parameters summed in a fixed order, zeroing
policies and plain numbers as upstream gradients.

    backward_call(fn, (2.0, x), {"_result": y.with_grads(ones=True)})
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import backward_failures, broadcast_grad, generated_calls, loop_bounds, written_mask
from . import capture_refusals, generated_hold
from .grad_restore import GradSnapshot, may_count, may_overflow
from .arguments import (
    MISSING,
    PLAIN,
    bind_arguments,
    prepare_arguments,
    resolve_error,
)
from .call_plan import DECLINED
from .grid_plan import remember_bwds
from .plan_layout import layout_key
from .call_shape import refuse_struct_grads
from .bwds_checks import (
    bwds_arguments_checked,
    maybe_broadcast,
    positional_result,
    refuse_shared_result_grad,
    refuse_stale,
    shared_grads,
    upstream_arg,
    values_read,
    warn_no_gradient,
)
from .backward_args import BackwardArgs
from .backward_scope import active_scope, backward_scope
from .determinism import is_deterministic, warn_nondeterministic
from .policy import ZeroPolicy, get_zero_policy
from .signature import FunctionTarget, warn_struct_fields
from .bwds_binding import bind_all, dispatch, drop_held
from .tensor import Tensor


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
    capture_refusals.refuse_full_path(fn.bwds_label, plan is not None, capture_refusals.FIRST_BWDS)
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
        b = BackwardArgs(fn, scope, prior)
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
