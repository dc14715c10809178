"""Binding every argument of a ``.bwds`` on the general path (``backward_call``), all or nothing.

The zeroing policy acts on each gradient buffer as its parameter is bound
(``scope.before_accumulate``), and a later argument may still be refused (a tensor on another
device, a raw SlangPy tensor, a ``_result`` of the wrong kind), or SlangPy's binding of the
call (a shape that does not broadcast). So a call that runs its kernel at once (a scope
without a batch, no grid argument) holds RESET's zeroings back (``scope.deferred``) and
records them in one command list with its kernel, after SlangPy bound the call
(``dispatch``): a refusal drops them, and every gradient stays as it was, at no cost. Where
that cannot be (a grid call, whose kernel may be pydiff's own; a tape's batch), the buffers
RESET zeroes are kept first (``GradSnapshot``, ``grad_restore.resets``) and put back.

    clears = bind_all(b, bound, native_kwargs, use_wrapper, options, result)
    dispatch(scope, node, clears, native_args, options)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import slangpy as spy

from . import capturing
from .arguments import MISSING, PLAIN
from .command_queue import build_before_lock, flush_all_deferred
from .grad_restore import kept_fields, restore_fields
from .grid_args import is_grid
from .call_shape import result_type
from .struct_grads import bind_struct
from .tensor import Tensor


def bind_all(
    b: Any, bound: list, native_kwargs: dict, use_wrapper: bool, options: dict, result: Any
) -> list | None:
    """The native arguments of every parameter and of ``_result`` (into ``native_kwargs``
    and ``options``), the policy acting on each gradient buffer as it is bound; a refusal
    puts back every buffer it zeroed (RESET: ``b.kept``) before it raises."""
    scope = b.scope
    held = scope.device is None and scope.deferred is None
    clears: list | None = [] if held and not any(is_grid(v) for _, v in bound) else None
    if clears is not None:
        scope.deferred = clears  # (before_accumulate appends RESET's zeroings to it)
    try:
        _bind_each(b, bound, native_kwargs, use_wrapper)
        native_result = b.result_arg(result, result_type(b.fn, bound))  # generic T: its type
    except BaseException:
        if b.kept is not None:
            b.kept.restore()
        drop_held(scope, clears)
        raise
    finally:
        if clears is not None:
            scope.deferred = None
    if native_result is not MISSING:
        options["_result"] = native_result
    return clears


def drop_held(scope: Any, clears: list | None, fields: list = ()) -> None:
    """A refused call's held-back zeroings: never done (the buffers' bookkeeping as it was,
    ``fields``, where the zeroing was recorded), and the policy applies again next time."""
    for k, grad in enumerate(clears or ()):
        if k < len(fields):
            restore_fields(grad, fields[k])
        scope.forget(grad)


def dispatch(scope: Any, node: Any, clears: list | None, args: tuple, kwargs: dict) -> None:
    """``scope.dispatch(node, *args, **kwargs)``, after RESET's held-back zeroings of
    ``clears``: in one command list with the kernel, recorded after SlangPy bound the call,
    submitted only if it did (a refusal leaves every buffer as it was)."""
    if not clears:
        scope.dispatch(node, *args, **kwargs)
        return
    capturing.refuse(f"a SlangPy backward kernel ({scope.label})")
    flush_all_deferred()  # (SlangPy's kernel: the deferred ones first, as scope.dispatch)
    queue = clears[0].device.queue
    fields = [kept_fields(g) for g in clears]
    try:
        build_before_lock(node, *args, **kwargs)  # (a first use's compile: not in the lock)
    except BaseException:
        drop_held(scope, clears, fields)
        raise
    with queue.lock:
        queue.enter()
        encoder = queue.native.create_command_encoder()
        for grad in clears:
            grad.zero_(encoder)
        try:
            node.append_to(encoder, *args, **kwargs)
        except BaseException:
            drop_held(scope, clears, fields)
            raise
        queue.native.submit_command_buffer(encoder.finish())


def _bind_each(b: Any, bound: list, native_kwargs: dict, use_wrapper: bool) -> None:
    for p, value in bound:
        if use_wrapper and p.io == "inout":
            native_kwargs.update(b.inout_args(p, value))
        elif p.tensor_kind == "fwd" and isinstance(value, Tensor):
            native_kwargs[p.name] = b.fwd_arg(p, value)
        elif isinstance(value, Tensor):
            native_kwargs[p.name] = b.tensor_arg(p, value)
        elif type(value) in (np.ndarray, list) and p.is_diff_tensor and _refused(b, p):
            raise TypeError(_host_at_diff_tensor(b.label, p, value))
        elif type(value) in PLAIN:
            native_kwargs[p.name] = value
        elif isinstance(value, spy.Tensor):
            raise TypeError(
                f"{b.label}.bwds: parameter '{p.name}' is a raw slangpy.Tensor; pass a "
                "pydiff.Tensor (pydiff.tensor(...)) so pydiff can bind its gradient buffers"
            )
        else:
            native_kwargs[p.name] = bind_struct(b, p, value)


def _refused(b: Any, p: Any) -> bool:
    """Whether a host value at diff tensor parameter ``p`` is refused: always where its
    gradient is written or the device is not CUDA (SlangPy: "requires a tensor with an
    associated input gradient"); a read-only one on CUDA is SlangPy's to bind."""
    return p.access != "read" or b.device.type != "cuda"


def _host_at_diff_tensor(label: str, p: Any, value: Any) -> str:
    what = f"a NumPy array of dtype {value.dtype}" if type(value) is np.ndarray else "a list"
    if p.no_diff_tensor:  # (no_diff: no gradient of its own, but bound as a tensor)
        want = "a pydiff tensor: pydiff.tensor(values)"
    else:
        want = (
            "a pydiff tensor with gradients, whose .grad receives the parameter's gradient: "
            "x = pydiff.tensor(values, requires_grad=True), then m.f.bwds(..., x, ...) and x.grad"
        )
    return (
        f"{label}.bwds: parameter '{p.name}' ({p.type_name}) is given {what}, but a "
        f"differentiable tensor parameter's backward reads and writes gradient buffers a host "
        f"value has none of; pass {want}"
    )
