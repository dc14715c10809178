"""One generated kernel that writes a float function's result and adds its inputs'
gradients (pydiff.generated's forward and backward kernels in one dispatch): the backward
kernel (``generated_source.backward_source``) with ``result``, which also stores ``f`` per
element as the forward kernel does. ``generated_hold`` fuses a tape's forward call with
its backward through it; ``forward_backward`` calls it directly (tests, measurements).

    y = generated_fused.forward_backward(m.polynomial, [2.0, 8.0, -1.0, x], g, {3: x.grad_out})
"""

from __future__ import annotations

from typing import Any

from . import broadcast_grad, generated
from .backward_scope import backward_scope
from .creation import empty
from .generated_source import backward_source
from .signature import FunctionTarget
from .tensor import Tensor


def forward_backward(
    fn: FunctionTarget, args: list, upstream: Tensor, grads: dict[int, Tensor]
) -> Tensor | None:
    """``f(args)`` as a new tensor of ``upstream``'s shape, with each ``grads[i]`` added the
    gradient of parameter ``i`` given ``upstream`` (as ``generated.backward``), in one
    dispatch (a broadcast parameter's deterministic sums after it); None, nothing done,
    where ``generated.backward`` would decline or the result's kernel is not covered."""
    found = fused_kernel(fn, args, upstream, grads)
    if found is None:
        return None
    kernel, sums, scalars = found
    full = partials(fn, upstream, scalars)
    if full is None:
        return None
    out = empty(upstream.shape, device=fn.module.device)
    dispatch(fn, kernel, args, upstream, grads, sums, full, out)
    return out


def partials(fn: FunctionTarget, upstream: Tensor, scalars: tuple) -> dict | None:
    """Each broadcast parameter's full-shape scratch buffer (``generated.backward``'s), or
    None (declined: not float4 storage)."""
    dev = fn.module.device
    full = [generated.partials_buffer(dev, upstream.shape, n) for n in range(len(scalars))]
    if any(f is None for f in full):
        generated.decline("backward", "scratch layout")
        return None
    return dict(zip(scalars, full))


def fused_kernel(fn: FunctionTarget, args: list, upstream: Tensor, grads: dict) -> Any:
    """``(kernel, sums, scalars)`` as ``generated.backward_kernel`` (its checks and counts:
    it also builds the backward kernel, once), with the result stored; or None."""
    found = generated.backward_kernel(fn, args, upstream, grads)
    if found is None:
        return None
    _, sums, scalars = found
    dev = fn.module.device
    kinds = generated.kinds_of(args, tuple(upstream.shape))
    small = -(-upstream.numel // 4) <= generated.SMALL_COUNT
    group = generated.SMALL_GROUP if small else generated.GROUP
    paired = dev.kernels.paired_stores
    key = (fn, "fused", kinds, sums, scalars, dev.typed_loads, group, paired)
    kernel = generated.compiled(
        fn,
        key,
        "pydiff_gen_fused",
        lambda: backward_source(fn, kinds, sums, scalars, dev.typed_loads, group, paired, True),
    )
    if kernel is None:
        generated.decline("backward", "fused kernel failed to build")
        return None
    return kernel, sums, scalars


def dispatch(
    fn: FunctionTarget,
    kernel: Any,
    args: list,
    upstream: Tensor,
    grads: dict,
    sums: tuple,
    partials: dict,
    out: Tensor,
) -> None:
    """``generated.dispatch_backward`` with the result bound: one dispatch (and a broadcast
    parameter's sums, as there); counted as ``forward+backward fused`` in ``stats()``."""
    dev = fn.module.device
    bindings = {
        f"pydiff_a{i}": v.buffer if type(v) is Tensor else float(v) for i, v in enumerate(args)
    }
    bindings.update(pydiff_up=upstream.buffer, pydiff_zero=0, pydiff_result=out.buffer)
    for j, members in enumerate(sums):
        bindings[f"pydiff_g{j}"] = bindings[f"pydiff_g{j}_in"] = grads[members[0]].buffer
    for i, f in partials.items():
        bindings[f"pydiff_sg{i}"] = f.storage
    threads, fixed = generated.geometry(upstream.numel)
    bindings.update(fixed)
    dev.kernels.dispatch(kernel, threads, **bindings)
    if partials:
        with backward_scope(fn.bwds_label) as scope:
            for i, f in partials.items():
                broadcast_grad.reduce_into(scope, dev, f, args[i])
        generated.count("backward: broadcast")
    generated.count("forward+backward fused")
