"""The call layer's ways into pydiff's generated kernels (pydiff.generated): a forward call,
a ``.bwds`` on its own or inside a larger backward (a tape's, or one that broadcasts a
parameter), and ``.fwds``. Each returns None/False for SlangPy's path, which then runs
unchanged with all its checks; each leaves calls under ``generated.MIN_ELEMENTS`` elements
to SlangPy (cheaper there per call), and each reads ``PYDIFF_GENERATED`` first, whatever the
call's size (a mistyped value raises).

    out = call_forward(fn, bound, options, result)            # None: SlangPy's path
    done = call_backward_in_scope(fn, bound, options, result, scope, prior)
    pair = call_fwds(fn, bound, call_args, "tensor")           # (value, tangent) or None
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import capturing, generated, generated_grid, generated_hold, generated_vector, written_mask
from .arguments import MISSING
from .grid_args import is_grid
from .bwds_checks import warn_no_gradient
from .call_shape import zero_d_call
from .determinism import is_deterministic
from .forward_args import NO_TANGENT
from .signature import FunctionTarget
from .tape import active_tape
from .tensor import Tensor

#: ``call_forward``'s answer where the generated kernel ran a function returning nothing (a
#: call over a grid, writing its tensors): SlangPy's call returns None there.
RAN = object()


def _large(values: list) -> bool:
    return generated.call_size(values) >= generated.MIN_ELEMENTS


def _declined(kind: str, reason: str, values: list) -> None:
    """Count, for ``stats()``, a call the generator never looks at (a NumPy array, a SlangPy
    option, a number as the upstream) when it is large: its largest tensor or NumPy array
    (smaller calls are not counted, as the generator's own declines)."""
    arrays = [v.size for v in values if isinstance(v, np.ndarray)]
    if max([generated.call_size(values), *arrays]) >= generated.MIN_ELEMENTS:
        generated.decline(kind, reason)


def _declined_bwds(bound: list, options: dict, result: Any) -> None:
    """``_declined`` for a ``.bwds`` whose options or upstream the generator never takes
    (counted once: in ``call_backward_in_scope``, which a ``.bwds`` reaches after
    ``call_backward`` declined)."""
    if (options or type(result) is not Tensor) and result is not MISSING:
        what = "a number" if isinstance(result, (int, float, np.generic)) else "not a tensor"
        reason = "SlangPy options" if options else f"the upstream gradient {what}"
        _declined("backward", reason, [*(v for _, v in bound), result])


def _host_reason(bound: list, options: dict, result: Any) -> str:
    """Why a forward call is not the generator's before it looks (``_declined``'s reason)."""
    if options.keys() > {"_result"}:
        return "SlangPy options"
    if isinstance(result, np.ndarray):
        return "_result a NumPy array"
    if type(result) is str and result != "tensor":
        return f"_result={result!r}"
    arrays = [p.name for p, v in bound if isinstance(v, np.ndarray)]
    if arrays:
        return f"parameter '{arrays[0]}': ndarray argument"
    return "a call of numbers, 0-d tensors or whole vectors: SlangPy's result is one value"


def call_forward(fn: FunctionTarget, bound: list, options: dict, result: Any) -> Tensor | None:
    """A forward call (``(param, value)`` pairs) as a generated kernel when it is large and
    covered: a tensor result (given, ``_result="tensor"``, or none given where SlangPy's
    would be a new tensor), no SlangPy options; None: SlangPy's path."""
    generated.check_switch()
    if result is MISSING and not options and any(is_grid(v) for _, v in bound):
        return _grid_forward(fn, bound)
    if options.keys() > {"_result"} or not (
        type(result) is Tensor
        or type(result) is str
        and result == "tensor"
        or result is MISSING
        and _new_tensor_by_default(bound)
    ):
        _declined("forward", _host_reason(bound, options, result), [*(v for _, v in bound), result])
        return None
    args = [v for _, v in bound]
    if not _large(args):
        _declined("forward", _host_reason(bound, options, result), args)
        return None
    given = result if type(result) is Tensor else None
    if generated_vector.involves(fn):
        return generated_vector.forward(fn, args, out=given)
    if given is None:  # (on a tape: held back for a backward to fuse, generated_hold)
        return generated_hold.forward(fn, args)
    return generated.forward(fn, args, given.shape, out=given)


def _grid_forward(fn: FunctionTarget, bound: list) -> Any:
    """A call over a grid (``generated_grid``), large, off a tape: RAN, or None."""
    if active_tape() is not None or not generated.enabled():
        return None
    if generated_grid.call_size(bound) < generated.MIN_ELEMENTS:
        return None
    if not generated_grid.forward(fn, bound):
        generated.decline("forward", "a grid call the generator does not cover")
        return None
    generated.count("forward: grid")
    return RAN


def grid_backward(fn: FunctionTarget, bound: list, natives: list, options: dict, call: Any) -> bool:
    """A ``.bwds`` over a grid (``generated_grid``), large, binding ``natives`` (what the
    backward chose for each parameter) where ``call.scope`` dispatches, through the masked
    wrapper where ``call.masks`` counts stores; False: SlangPy's kernel."""
    if options or call.no_grad or not any(is_grid(v) for _, v in bound):
        return False
    if not generated.enabled() or is_deterministic() or capturing.recording() is not None:
        return False
    if generated_grid.call_size(bound) < generated.MIN_ELEMENTS:
        return False
    target = written_mask.masked_wrapper(fn, set(call.masks)) if call.masks else fn
    if not generated_grid.backward(fn, bound, natives, target):
        generated.decline("backward", "a grid call the generator does not cover")
        return False
    if call.scope.device is None:  # (a scope that runs SlangPy's kernels at once: in order)
        fn.module.device.queue.flush()
    generated.count("backward: grid")
    return True


def _new_tensor_by_default(bound: list) -> bool:
    """Whether SlangPy's call without ``_result`` returns a new tensor of the call's shape
    (what ``_result="tensor"`` asks for): some argument is a tensor and the call shape is not
    the () of 0-d tensors (a 0-d result there: forward_call's)."""
    return any(type(v) is Tensor for _, v in bound) and not zero_d_call(bound)


def call_backward(fn: FunctionTarget, bound: list, options: dict, result: Any) -> bool:
    """A ``.bwds`` adding gradients under ACCUMULATE as a generated kernel, when it is large
    and covered (fused with its held-back forward, generated_hold); False: SlangPy's path
    (that forward recorded and submitted first)."""
    if _backward(fn, bound, options, result):
        return True
    generated_hold.release(fn, result)
    return False


def _backward(fn: FunctionTarget, bound: list, options: dict, result: Any) -> bool:
    generated.check_switch()
    if options or type(result) is not Tensor or result.grad_in is None:
        return False
    if result.numel < generated.MIN_ELEMENTS:
        return False
    grads = {
        i: v.grad_out for i, (p, v) in enumerate(bound) if type(v) is Tensor and p.differentiable
    }
    args = [v for _, v in bound]
    if generated_hold.fused_backward(fn, args, result, grads, None):
        return True
    backward = generated_vector.backward if generated_vector.involves(fn) else generated.backward
    return backward(fn, args, result.grad_in, grads)


def call_backward_in_scope(
    fn: FunctionTarget, bound: list, options: dict, result: Any, scope: Any, prior: frozenset
) -> bool:
    """``_in_scope``; False: SlangPy's path, a held-back forward of ``result`` recorded and
    submitted first (generated_hold)."""
    if _in_scope(fn, bound, options, result, scope, prior):
        return True
    generated_hold.release(fn, result)
    return False


def _in_scope(
    fn: FunctionTarget, bound: list, options: dict, result: Any, scope: Any, prior: frozenset
) -> bool:
    """A ``.bwds`` inside ``scope`` (a tape's backward, a zeroing policy, a broadcast or
    deterministic-mode call) as a generated kernel, when it is large and covered: the
    policy acts on each gradient buffer (``scope.before_accumulate``) as on SlangPy's path,
    and a result the call overwrote on a tape (its storage in ``prior``) has its gradient
    cleared after the call. False: SlangPy's path (which raises the errors)."""
    generated.check_switch()
    if options or type(result) is not Tensor or result.grad_in is None:
        _declined_bwds(bound, options, result)
        return False
    if capturing.recording() is not None:
        return False  # a captured tape.backward: SlangPy's path refuses it, as before
    dev = fn.module.device
    if result.device is not dev or result.numel < generated.MIN_ELEMENTS:
        return False
    grads, owners = {}, []
    for i, (p, v) in enumerate(bound):
        if type(v) is not Tensor:
            continue
        if v.device is not dev:
            return False  # SlangPy's path names the parameter
        if not p.differentiable:
            owners.append((p, v, None))
        elif v.requires_grad:
            if v.grad_out.shape != v.shape:
                return False  # refused there
            grads[i] = v.grad_out
            owners.append((p, v, v.grad_out))
    whole = [id(g.storage) for i, g in grads.items() if bound[i][1].shape == result.shape]
    if is_deterministic() and len(set(whole)) < len(whole):
        # SlangPy's path sums each parameter apart there, then adds: other roundings. (A
        # broadcast parameter's sums are added one by one on both paths: the same bits.)
        generated.decline("backward", "deterministic mode: a shared gradient buffer")
        return False

    def before() -> None:
        for p, v, grad in owners:  # every warning first: one made an error (-W error) must
            if grad is None:  # find no buffer zeroed yet (RESET), so nothing changes
                warn_no_gradient(fn, p, v)
        for p, v, grad in owners:
            if grad is not None:
                scope.before_accumulate(v, grad, f"{fn.label}: parameter '{p.name}'")

    args = [v for _, v in bound]
    backward = generated_vector.backward if generated_vector.involves(fn) else generated.backward
    # Not fused where before() warns: a warning reaches user code (showwarning) that may
    # read the result, and a claimed forward is neither held nor recorded until dispatched.
    warns = any(grad is None for _, _, grad in owners)
    fused = not warns and generated_hold.fused_backward(fn, args, result, grads, before)
    if not fused and not backward(fn, args, result.grad_in, grads, before):
        return False
    if id(result.storage) in prior:  # overwritten: the value before gets no gradient
        scope.clear(dev, result.grad_in.native)
    if scope.label != fn.bwds_label:  # joined an outer backward: a tape's, a Function's
        generated.count(f"backward: in {scope.label}")
    return True


def call_fwds(fn: FunctionTarget, bound: list, call_args: list, want: str) -> Any:
    """``.fwds`` as a generated kernel when it is large and covered: ``call_args`` as
    forward mode builds them (a (value, tangent) pair of arguments per differentiable
    parameter); ``(value, tangent)`` tensors, or arrays for ``want == "numpy"``; None:
    SlangPy's path."""
    generated.check_switch()
    args, tangents = [], []
    it = iter(call_args)
    for p, _ in bound:
        args.append(next(it, None))
        tangent = next(it, None) if p.differentiable and p.io == "in" else None
        tangent = None if tangent is NO_TANGENT else tangent  # a literal zero: no 0 * inf
        if tangent is not None and not (type(tangent) is Tensor or type(tangent) is float):
            _declined("fwds", f"parameter '{p.name}': a NumPy tangent", [*call_args, tangent])
            return None  # NumPy tangents and the like: SlangPy's path converts them
        tangents.append(tangent)
    if not _large(args):
        return None
    if generated_vector.involves(fn):
        out = generated_vector.fwds(fn, args, tangents)
    else:
        out = generated.fwds(fn, args, tangents)
    if out is None or want != "numpy":
        return out
    return out[0].numpy(), out[1].numpy()
