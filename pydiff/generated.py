"""Generated compute kernels for elementwise calls of a user's function: for a call pydiff can
see whole (every parameter a ``float``, each argument a number, a contiguous float tensor of
the call's shape or a one-element tensor broadcast over it), a Slang kernel that imports the
user's module and calls the function (its ``bwd_diff``, its ``fwd_diff``) per element, two
adjacent float4s (eight elements) per thread in 256-thread groups. Each gradient of a tensor of the
call's shape is added with a plain store (every thread owns its elements: no atomics); a
broadcast parameter's partials go to a full-shape buffer summed by the project's
deterministic reduction (``broadcast_grad.reduce_into``), as on SlangPy's path: the same bits.
It is compiled once per function and argument layout and dispatched like pydiff's own
kernels (``device.kernels.dispatch``: batched with the device's queue).

What it does not cover it declines (``None`` / ``False``, nothing done): the caller takes
SlangPy's path unchanged. ``PYDIFF_GENERATED=0`` turns it off; ``stats()`` counts the calls per
path and the reasons for declining. The Slang source: ``generated_source``.

    y = generated.forward(m.polynomial, [2.0, 8.0, -1.0, x], x.shape)     # None: declined
    done = generated.backward(m.polynomial, [2.0, 8.0, -1.0, x], dy, {3: x.grad_out})
    y, dy = generated.fwds(m.polynomial, [2.0, 8.0, -1.0, x], [0.0, 0.0, 0.0, u])
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from typing import Any, Callable


from . import broadcast_grad, generated_helpers, generated_switch, kernel_sources
from .backward_scope import backward_scope
from .buffer_pool import BoundedDict
from .creation import empty
from .errors import env_int
from .fork_locks import renewed_lock
from .generated_switch import SWITCH as SWITCH
from .generated_switch import check_switch as check_switch
from .generated_switch import check_switch_planned as check_switch_planned
from .generated_switch import enabled
from .generated_switch import planned_after as planned_after
from .generated_coverage import call_shape as call_shape
from .generated_coverage import argument_kind, uncovered, uncovered_backward, uncovered_value
from .generated_coverage import kinds_of as kinds_of
from .generated_source import CHUNK, GROUP, backward_source, forward_source, fwds_source
from .kernels import KERNELS_MAX
from .signature import FunctionTarget
from .storage import allocate, float4_layout
from .tensor import Tensor, float4_ready

#: At most this many groups (Vulkan's guaranteed limit; beyond it each thread loops over
#: several float4s). One float4 per thread in GROUP-thread groups measured fastest on
#: lavapipe: 2^24 floats forward + backward 43-52 ms, against 260 ms with 64 or 256 looping
#: groups.
MAX_GROUPS = 65535
#: Calls of at most this many float4s run in 32-thread groups: lavapipe runs a whole group
#: however few threads have work (16 elements: about 15 us less per fwd + bwd).
SMALL_COUNT, SMALL_GROUP = 64, 32

#: Calls the full path runs take this path from this many elements up: below it the full
#: path's checks cost more than the dispatch saves (16 elements: ~105 against ~90 us).
#: ``PYDIFF_GENERATED_MIN_ELEMENTS=1`` (or pytest's ``--pydiff-generated=force``) sends every
#: covered call this way.
MIN_ELEMENTS = env_int("PYDIFF_GENERATED_MIN_ELEMENTS", 4096)
STATS: Counter = Counter()  # calls per path (stats()); call plans count into it directly
_lock = renewed_lock(globals(), "_lock")  # (new in a forked child)


def call_size(values: Any) -> int:
    """The most elements of a tensor among ``values``: the size a forward call or ``.fwds``
    compares with ``MIN_ELEMENTS`` (any argument may be the one of the call's shape, a
    broadcast one-element tensor may come first).

        generated.call_size([pydiff.tensor([2.0]), x]) >= generated.MIN_ELEMENTS
    """
    return max((v.numel for v in values if type(v) is Tensor), default=0)


def settings() -> dict[str, Any]:
    """What ``pydiff info`` reports: whether the path is on, and from how many elements."""
    after = generated_switch.PLANNED_AFTER
    return {
        "enabled": enabled(),
        "min_elements": MIN_ELEMENTS,
        "planned_after": after,
        "planned_on_gpu": generated_switch.PLANNED_AFTER_ON_GPU == after,
    }


def stats() -> dict[str, int]:
    """Calls per path since ``reset_stats()``: ``forward``, ``backward``, ``fwds``, ``forward+
    backward fused`` (generated_hold: one kernel for both; ``backward: ...`` count again), declined:
    ``forward_fallback``, ``backward_fallback``, ``fwds_fallback``, ``declined: <reason>``."""
    return dict(STATS)


def reset_stats() -> None:
    STATS.clear()


def decline(kind: str, reason: str) -> None:
    """Count a call of ``kind`` (forward, backward, fwds) declined for ``reason``."""
    if generated_switch.counted():
        STATS[f"{kind}_fallback"] += 1
        STATS[f"declined: {reason}"] += 1


def count(what: str) -> None:
    """Count a call that took the generated path in some way (``stats()``)."""
    STATS[what] += 1


# --------------------------------------------------------------------------------------------
# compiling and dispatching


def _group(numel: int) -> int:
    return SMALL_GROUP if -(-numel // 4) <= SMALL_COUNT else GROUP


def compiled(fn: FunctionTarget, key: tuple, entry: str, make: Callable[[], str]) -> Any:
    """The kernel for ``key``, built from the source ``make()`` returns once per device (the
    ``KERNELS_MAX`` most recently used kept; the helper modules it imports loaded first);
    None, remembered, if it fails to build: the call falls back."""
    dev = fn.module.device
    cache = dev.cached("pydiff.generated", lambda: BoundedDict(KERNELS_MAX), kernels=True)
    with _lock:
        if key in cache:
            return cache[key]
    source = make()
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    try:
        name = f"pydiff_gen_{fn.name}_{digest}"
        source = generated_helpers.prepare(dev, source)
        kernel = kernel_sources.build_kernel(dev.native, dev.native, name, source, entry)
    except Exception:  # e.g. an overload the generated call cannot pick: SlangPy's path
        kernel = None
    with _lock:
        cache[key] = kernel
    return kernel


def geometry(numel: int) -> tuple[int, dict]:
    """The threads a generated kernel of ``numel`` elements runs, and the uniforms that say
    how its threads share the float4s."""
    count, group = -(-numel // 4), _group(numel)
    threads = min(-(-count // (group * CHUNK)), MAX_GROUPS) * group
    return threads, dict(
        pydiff_count=count, pydiff_tail=numel - 4 * (count - 1), pydiff_stride=threads
    )


def _launch(fn: FunctionTarget, kernel: Any, numel: int, bindings: dict) -> None:
    threads, fixed = geometry(numel)
    bindings.update(fixed)
    fn.module.device.kernels.dispatch(kernel, threads, **bindings)


def _arguments(args: list, name: str = "a") -> dict:
    return {
        f"pydiff_{name}{i}": v.buffer if type(v) is Tensor else float(v)
        for i, v in enumerate(args)
        if v is not None
    }


def forward(
    fn: FunctionTarget, args: list, shape: tuple | None, out: Tensor | None = None
) -> Tensor | None:
    """``fn`` over ``args`` (one per parameter, in order) as a generated kernel: a new tensor
    of ``shape`` (None: the tensor arguments' broadcast shape), or ``out`` written, or None
    when the call is not covered (nothing done)."""
    shape = call_shape(args) if shape is None else tuple(shape)
    kernel = forward_kernel(fn, args, shape, out)
    if kernel is None:
        return None
    if out is None:
        out = empty(shape, device=fn.module.device)
    dispatch_forward(fn, kernel, args, out)
    return out


def forward_kernel(fn: FunctionTarget, args: list, shape: Any, out: Tensor | None = None) -> Any:
    """The compiled forward kernel of ``args``' layout over ``shape`` (writing ``out``, when
    given), or None: not covered (the reason counted in ``stats()``)."""
    reason = "tensor shapes do not broadcast" if shape is None else uncovered(fn, args, shape)
    if reason is None and out is not None:
        if not (type(out) is Tensor and out.shape == shape and float4_ready(out)):
            reason = "_result not contiguous float4 storage of the call"
    if reason is not None:
        decline("forward", reason)
        return None
    dev = fn.module.device
    kinds = kinds_of(args, shape)
    group = _group(math.prod(shape))
    paired = dev.kernels.paired_stores
    key = (fn, "fwd", kinds, dev.typed_loads, group, paired)
    kernel = compiled(
        fn,
        key,
        "pydiff_gen_fwd",
        lambda: forward_source(fn, kinds, dev.typed_loads, group, paired),
    )
    if kernel is None:
        decline("forward", "kernel failed to build")
    return kernel


def dispatch_forward(fn: FunctionTarget, kernel: Any, args: list, out: Tensor) -> None:
    """Dispatch ``forward_kernel``'s kernel of these arguments' layout, writing ``out``."""
    bindings = _arguments(args)
    bindings["pydiff_result"] = out.buffer
    _launch(fn, kernel, out.numel, bindings)
    STATS["forward"] += 1


def backward(
    fn: FunctionTarget,
    args: list,
    upstream: Tensor,
    grads: dict[int, Tensor],
    before: Callable[[], None] | None = None,
) -> bool:
    """Add the gradient of each parameter ``i`` in ``grads`` into ``grads[i]`` (plain adds,
    as under ACCUMULATE) given the result's ``upstream`` gradient, as one generated kernel
    (a broadcast one-element tensor's: summed over the call, in a fixed order, after it);
    False, nothing done, when the call is not covered (a gradient wanted for a number, a
    gradient buffer shared with a value the kernel reads, ...). ``before()`` runs once the
    call is known to be covered, before anything is dispatched (zeroing policies)."""
    found = backward_kernel(fn, args, upstream, grads)
    if found is None:
        return False
    kernel, sums, scalars = found
    full = [partials_buffer(fn.module.device, upstream.shape, n) for n in range(len(scalars))]
    if any(f is None for f in full):
        decline("backward", "scratch layout")
        return False
    if before is not None:
        before()
    dispatch_backward(fn, kernel, args, upstream, grads, sums, dict(zip(scalars, full)))
    return True


def backward_kernel(fn: FunctionTarget, args: list, upstream: Tensor, grads: dict) -> Any:
    """``(kernel, sums, scalars)`` for a backward of this layout (``sums``: the parameters
    adding into each gradient buffer of the call's shape; ``scalars``: the broadcast ones),
    or None: not covered (the reason counted in ``stats()``)."""
    shape = tuple(upstream.shape) if type(upstream) is Tensor else ()
    reason = uncovered(fn, args, shape) or uncovered_backward(fn, args, upstream, grads)
    if reason is not None:
        decline("backward", reason)
        return None
    dev = fn.module.device
    kinds = kinds_of(args, shape)
    buffers: dict[int, list[int]] = {}  # parameters adding into one gradient buffer
    for i in sorted(grads):
        if kinds[i] == "t":
            buffers.setdefault(id(grads[i].storage), []).append(i)
    sums = tuple(tuple(g) for g in buffers.values())
    scalars = tuple(sorted(i for i in grads if kinds[i] == "s"))
    group = _group(upstream.numel)
    paired = dev.kernels.paired_stores
    key = (fn, "bwd", kinds, sums, scalars, dev.typed_loads, group, paired)
    kernel = compiled(
        fn,
        key,
        "pydiff_gen_bwd",
        lambda: backward_source(fn, kinds, sums, scalars, dev.typed_loads, group, paired),
    )
    if kernel is None:
        decline("backward", "kernel failed to build")
        return None
    return kernel, sums, scalars


def dispatch_backward(
    fn: FunctionTarget,
    kernel: Any,
    args: list,
    upstream: Tensor,
    grads: dict,
    sums: tuple,
    partials: dict | None = None,
) -> None:
    """Dispatch ``backward_kernel``'s kernel; ``partials``: each broadcast parameter's
    full-shape scratch buffer, summed into its gradient after the kernel."""
    dev = fn.module.device
    bindings = _arguments(args)
    bindings.update(pydiff_up=upstream.buffer, pydiff_zero=0)
    for j, members in enumerate(sums):
        bindings[f"pydiff_g{j}"] = bindings[f"pydiff_g{j}_in"] = grads[members[0]].buffer
    for i, f in (partials or {}).items():
        bindings[f"pydiff_sg{i}"] = f.storage
    _launch(fn, kernel, upstream.numel, bindings)
    if partials:
        # SlangPy's path sums its full-shape buffers with the same kernels, in parameter order.
        with backward_scope(fn.bwds_label) as scope:
            for i, f in partials.items():
                broadcast_grad.reduce_into(scope, dev, f, args[i])
        STATS["backward: broadcast"] += 1
    STATS["backward"] += 1


def partials_buffer(dev: Any, shape: tuple, ordinal: int) -> Any:
    """A full-shape float buffer (float4 storage) for a broadcast parameter's partials, kept
    per shape among the device's scratch buffers; None if not float4 storage."""
    key = ("pydiff.generated partials", shape, ordinal)
    if key not in dev.scratch:
        dev.scratch[key] = allocate(dev, shape, "float")
    native = dev.scratch[key]
    return native if float4_layout(native, dev.typed_loads) else None


def fwds(
    fn: FunctionTarget, args: list, tangents: list, shape: tuple | None = None
) -> tuple[Tensor, Tensor] | None:
    """Forward mode as a generated kernel: ``(f(args), J tangents)`` as two new tensors of the
    call's shape; ``tangents[i]`` is a tensor, a number, or None (no_diff / zero). None when
    the call is not covered (nothing done)."""
    shape = (
        call_shape(args + [t for t in tangents if type(t) is Tensor]) if shape is None else shape
    )
    reason = "tensor shapes do not broadcast" if shape is None else uncovered(fn, args, shape)
    if reason is None and not fn.signature.differentiable:
        reason = "not differentiable"
    for p, t in zip(fn.signature.params, tangents):
        if reason is None and t is not None:
            if p.no_diff:
                reason = f"tangent for no_diff parameter '{p.name}'"
            else:
                reason = uncovered_value(fn, f"tangent of '{p.name}'", t, shape)
    if reason is not None:
        decline("fwds", reason)
        return None
    dev = fn.module.device
    kinds = kinds_of(args, shape)
    tkinds = tuple("z" if t is None else argument_kind(t, shape) or "?" for t in tangents)
    group = _group(math.prod(shape))
    paired = dev.kernels.paired_stores
    key = (fn, "fwds", kinds, tkinds, dev.typed_loads, group, paired)
    kernel = compiled(
        fn,
        key,
        "pydiff_gen_fwds",
        lambda: fwds_source(fn, kinds, tkinds, dev.typed_loads, group, paired),
    )
    if kernel is None:
        decline("fwds", "kernel failed to build")
        return None
    value, tangent = empty(shape, device=dev), empty(shape, device=dev)
    bindings = _arguments(args) | _arguments(tangents, "t")
    bindings.update(pydiff_result=value.buffer, pydiff_tangent=tangent.buffer)
    _launch(fn, kernel, value.numel, bindings)
    STATS["fwds"] += 1
    return value, tangent
