"""Generated kernels for elementwise calls of functions on float vectors: parameters and
results of type ``float2``, ``float3``, ``float4`` (``vector<float,N>``) alongside ``float``
ones. SlangPy's generic path is slow for them (lavapipe, 2^20 ``float3`` elements, forward
+ ``.bwds`` of a shading function: 85 ms, where a scalar function over the same 3M floats
took 14 ms on the float generated path, pydiff.generated).

A vector argument is a contiguous tensor of the call's elements, as SlangPy's path takes it:
a ``floatN`` tensor of the call's shape or a float tensor of shape ``(call..., N)`` (both
hold element i in the N floats from ``i * N``); a float parameter takes what the float
kernels take (a number, a float tensor of the call's shape, a one-element tensor broadcast).
One call element per thread, read from ``StructuredBuffer<float>``s; a vector result comes
back as a ``floatN`` tensor of the call's shape (SlangPy's) or into a ``_result`` given in
either layout. Gradients are added as the float kernels add them (a plain store per element,
broadcast partials summed by ``broadcast_grad``), so both paths give the same bits.

What it does not cover it declines (None / False, the reason in ``generated.stats()``): a
number, a broadcast tensor or a ``spy.float3`` value for a vector parameter, other vector
types (``half3``, ``int3``, matrices), ... The Slang source: ``generated_vector_source``.

    y = generated_vector.forward(m.shade, [N, L, 2.0])           # None: declined
    done = generated_vector.backward(m.shade, [N, L, 2.0], y.grad_in, {0: N.grad_out})
    y, dy = generated_vector.fwds(m.shade, [N, L, 2.0], [U, None, 0.0])
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from . import broadcast_grad
from .backward_scope import backward_scope
from .determinism import is_deterministic
from .generated import MAX_GROUPS, SMALL_COUNT, SMALL_GROUP, compiled, count, decline
from .generated_source import GROUP
from .generated_helpers import left_to_slangpy
from .generated_switch import enabled
from .generated_vector_source import backward_source, forward_source, fwds_source
from .signature import FunctionTarget
from .storage import allocate
from .tensor import Tensor

#: The value types covered, and their floats per element.
WIDTHS = {"float": 1, "vector<float,2>": 2, "vector<float,3>": 3, "vector<float,4>": 4}
_NUMBERS = (float, int, np.float32, np.float64)  # not bool: SlangPy's path decides


def involves(fn: FunctionTarget) -> bool:
    """Whether ``fn`` takes or returns a float vector: its calls are this module's to cover.

    generated_vector.involves(m.shade)     # True for float3 shade(float3 n, ...)
    """
    sig = fn.signature
    return any(WIDTHS.get(t, 1) > 1 for t in (sig.return_type, *(p.type_name for p in sig.params)))


def call_dims(value: Tensor, width: int) -> tuple | None:
    """The call shape a tensor gives at a value of ``width`` floats (a ``floatN`` tensor: its
    shape; a float tensor: its shape less a last axis of N), or None: neither."""
    dtype = value.dtype
    if width > 1 and dtype == f"float{width}":
        return value.shape
    if dtype == "float":
        if width == 1:
            return value.shape
        if value.shape[-1:] == (width,):
            return value.shape[:-1]
    return None


def _checked(fn: FunctionTarget, args: list) -> str | None:
    sig = fn.signature
    if not enabled():
        return "PYDIFF_GENERATED=0"
    if (reason := left_to_slangpy(fn)) is not None:
        return reason
    if sig.return_type not in WIDTHS:
        return f"returns {sig.return_type}"
    if len(args) != len(sig.params):
        return "argument count"
    for p in sig.params:
        if p.type_name not in WIDTHS or p.io != "in" or p.tensor_kind is not None or p.generic:
            return f"parameter '{p.name}' is {p.io} {p.type_name}"
    return None


def _tensor_dims(fn: FunctionTarget, what: str, value: Any, width: int) -> Any:
    """A tensor argument's call shape, or the reason it is not covered (a str); None: a
    number for a float."""
    if type(value) is not Tensor:
        if type(value) in _NUMBERS and width == 1:
            return None
        target = "a vector" if width > 1 else "a float"
        return f"{what}: {type(value).__name__} argument for {target}"
    if value.device is not fn.module.device:
        return f"{what}: tensor of another device"
    dims = call_dims(value, width)
    if dims is None:
        return f"{what}: {value.dtype} tensor of shape {value.shape} for a {width}-float value"
    if not value.dense:
        return f"{what}: tensor not contiguous from the start of its buffer"
    return dims


def layout_of(fn: FunctionTarget, values: list, shape: tuple | None, tangents: bool = False):
    """``(layout, shape)``: per parameter ``(kind, width)`` (generated_vector_source) over the
    call's ``shape`` (None: the largest a tensor gives), or the reason the call is not
    covered (a str). ``tangents``: ``values`` are tangents (None: zero)."""
    params = fn.signature.params
    dims = []
    for p, v in zip(params, values):
        if tangents and v is None:
            dims.append(None)
            continue
        what = f"{'tangent of ' if tangents else 'parameter '}'{p.name}'"
        found = _tensor_dims(fn, what, v, WIDTHS[p.type_name])
        if type(found) is str:
            return found
        dims.append(found)
    if shape is None:
        shape = max((d for d in dims if d is not None), key=math.prod, default=None)
        if shape is None:
            return "no tensor argument of the call's shape"
    if len(shape) == 0 or math.prod(shape) == 0:
        return f"call of shape {shape}"
    layout = []
    for p, v, d in zip(params, values, dims):
        width = WIDTHS[p.type_name]
        if d is None:
            layout.append(("z" if v is None else "n", width))
        elif d == shape:
            layout.append(("t", width))
        elif width == 1 and v.numel == 1 and len(v.shape) <= len(shape):
            layout.append(("s", 1))
        else:
            return f"parameter '{p.name}': tensor of call shape {d}, not the call's {shape}"
    if not tangents and not any(kind == "t" for kind, _ in layout):
        return "no tensor argument of the call's shape"
    return tuple(layout), shape


def _geometry(numel: int) -> tuple[int, int, bool]:
    """(threads per group, threads, whether they loop): one element per thread."""
    group = SMALL_GROUP if numel <= 4 * SMALL_COUNT else GROUP
    groups = -(-numel // group)
    return group, min(groups, MAX_GROUPS) * group, groups > MAX_GROUPS


def _kernel(fn: FunctionTarget, what: str, key: tuple, numel: int, make: Callable) -> Any:
    group, threads, looped = _geometry(numel)
    kernel = compiled(
        fn, (fn, "vector", what, *key, group, looped), f"pydiff_vec_{what}",
        lambda: make(group, looped),
    )  # fmt: skip
    if kernel is None:
        decline({"fwd": "forward", "bwd": "backward"}.get(what, what), "kernel failed to build")
    return kernel, threads


def _bindings(args: list, name: str = "a") -> dict:
    return {
        f"pydiff_{name}{i}": v.buffer if type(v) is Tensor else float(v)
        for i, v in enumerate(args)
        if v is not None
    }


def _dispatch(fn: FunctionTarget, kernel: Any, threads: int, numel: int, bindings: dict) -> None:
    bindings.update(pydiff_n=numel, pydiff_stride=threads)
    fn.module.device.kernels.dispatch(kernel, threads, **bindings)


def new_result(shape: tuple, width: int, dev: Any) -> Tensor:
    """A new result of ``width`` floats per element (a ``floatN`` tensor for a vector): pooled
    float4 storage (pydiff.float_storage), as the float kernels' results are.

    y = generated_vector.new_result((1024,), 3, dev)      # a float3 tensor
    """
    return Tensor(allocate(dev, shape, "float" if width == 1 else f"float{width}"), dev)


def forward(fn: FunctionTarget, args: list, out: Tensor | None = None) -> Tensor | None:
    """``fn`` over ``args`` (one per parameter): a new tensor of the call's shape (a
    ``floatN`` one for a vector result), or ``out`` written; None when not covered."""
    found = forward_kernel(fn, args, out)
    if found is None:
        return None
    kernel, threads, shape, width = found
    out = new_result(shape, width, fn.module.device) if out is None else out
    _dispatch(
        fn, kernel, threads, math.prod(shape), _bindings(args) | {"pydiff_result": out.buffer}
    )
    count("forward")
    count("forward: vector")
    return out


def forward_kernel(fn: FunctionTarget, args: list, out: Tensor | None = None) -> tuple | None:
    """``(kernel, threads, shape, width)`` of ``forward``'s call (``width``: the result's
    floats per element), or None when not covered (the reason counted). A call plan
    (planned_vector) dispatches it for later calls of the layout.

    kernel, threads, shape, width = generated_vector.forward_kernel(m.shade, [N, L, 2.0])
    """
    reason = _checked(fn, args)
    width = WIDTHS.get(fn.signature.return_type, 0)
    shape = None
    if reason is None and out is not None:
        shape = call_dims(out, width) if type(out) is Tensor else None
        if shape is None or not out.dense or out.device is not fn.module.device:
            reason = "_result not a contiguous tensor of the result's type"
        elif any(type(v) is Tensor and v.storage is out.storage for v in args):
            reason = "_result shares storage with an argument"
    found = reason or layout_of(fn, args, shape)
    if type(found) is str:
        decline("forward", found)
        return None
    layout, shape = found
    kernel, threads = _kernel(
        fn, "fwd", (layout, width), math.prod(shape),
        lambda group, looped: forward_source(fn, layout, width, group, looped),
    )  # fmt: skip
    return None if kernel is None else (kernel, threads, shape, width)


def backward(
    fn: FunctionTarget,
    args: list,
    upstream: Tensor,
    grads: dict[int, Tensor],
    before: Callable[[], None] | None = None,
) -> bool:
    """Add the gradient of each parameter ``i`` in ``grads`` into ``grads[i]`` given the
    result's ``upstream`` gradient (as ``generated.backward`` does for float functions);
    False, nothing done, when not covered. ``before()`` runs once the call is known to be
    covered, before anything is dispatched (zeroing policies)."""
    found = backward_kernel(fn, args, upstream, grads)
    if found is None:
        return False
    kernel, threads, shape, sums, scalars = found
    dev, numel = fn.module.device, math.prod(shape)
    partials = {i: _partials(dev, shape, n) for n, i in enumerate(scalars)}
    if before is not None:
        before()
    bindings = _bindings(args) | {"pydiff_up": upstream.buffer, "pydiff_zero": 0}
    for j, members in enumerate(sums):
        bindings[f"pydiff_g{j}"] = grads[members[0]].buffer
    for i, full in partials.items():
        bindings[f"pydiff_sg{i}"] = full.storage
    _dispatch(fn, kernel, threads, numel, bindings)
    if partials:
        # SlangPy's path sums its full-shape buffers with the same kernels, in parameter order.
        with backward_scope(fn.bwds_label) as scope:
            for i, full in partials.items():
                broadcast_grad.reduce_into(scope, dev, full, args[i])
        count("backward: broadcast")
    count("backward")
    count("backward: vector")
    return True


def backward_kernel(fn: FunctionTarget, args: list, upstream: Any, grads: dict) -> tuple | None:
    """``(kernel, threads, shape, sums, scalars)`` of ``backward``'s call: ``sums`` the
    parameters adding into each gradient buffer (one binding ``pydiff_g<j>`` each),
    ``scalars`` the broadcast ones (partials summed after); None when not covered (the
    reason counted).

    kernel, threads, shape, sums, scalars = backward_kernel(m.shade, [N, L, 2.0], up, grads)
    """
    found = _backward_plan(fn, args, upstream, grads)
    if type(found) is str:
        decline("backward", found)
        return None
    layout, shape, sums, scalars = found
    width = WIDTHS[fn.signature.return_type]
    kernel, threads = _kernel(
        fn, "bwd", (layout, width, sums, scalars), math.prod(shape),
        lambda group, looped: backward_source(fn, layout, width, sums, scalars, group, looped),
    )  # fmt: skip
    return None if kernel is None else (kernel, threads, shape, sums, scalars)


def _backward_plan(fn: FunctionTarget, args: list, upstream: Any, grads: dict) -> Any:
    """``(layout, shape, sums, scalars)`` of a covered backward, or why not (a str)."""
    reason = _checked(fn, args)
    if reason is not None:
        return reason
    if not fn.signature.differentiable:
        return "not differentiable"
    if not grads:
        return "no gradient wanted"
    dev, width = fn.module.device, WIDTHS[fn.signature.return_type]
    shape = call_dims(upstream, width) if type(upstream) is Tensor else None
    if shape is None or upstream.device is not dev or not upstream.dense:
        return "upstream gradient not a contiguous tensor of the result's type"
    found = layout_of(fn, args, shape)
    if type(found) is str:
        return found
    layout = found[0]
    if any(not 0 <= i < len(args) or type(args[i]) is not Tensor for i in grads):
        return "gradient wanted for a number"
    read = {id(upstream.storage)} | {id(v.storage) for v in args if type(v) is Tensor}
    full = {id(g.storage) for i, g in grads.items() if layout[i][0] == "t"}
    shared: dict[int, list[int]] = {}
    for i, g in sorted(grads.items()):
        p, (kind, w) = fn.signature.params[i], layout[i]
        if p.no_diff:
            return f"gradient wanted for no_diff parameter '{p.name}'"
        if type(g) is not Tensor or g.device is not dev or id(g.storage) in read:
            return f"gradient buffer of '{p.name}' not apart from the values the call reads"
        if kind == "s":
            if g is not args[i].grad_out or id(g.storage) in full:
                return "broadcast gradient not the parameter's own buffer"
        elif call_dims(g, w) != shape or not g.dense:
            return f"gradient buffer of '{p.name}' not a contiguous tensor of the call"
        else:
            shared.setdefault(id(g.storage), []).append(i)
    sums = tuple(tuple(m) for m in shared.values())
    for members in sums:
        if len({layout[i][1] for i in members}) > 1:
            return "a gradient buffer shared by values of different widths"
        if len(members) > 1 and is_deterministic():
            # SlangPy's path sums each parameter apart there, then adds: other roundings
            return "deterministic mode: a shared gradient buffer"
    scalars = tuple(sorted(i for i in grads if layout[i][0] == "s"))
    return layout, shape, sums, scalars


def _partials(dev: Any, shape: tuple, ordinal: int) -> Any:
    """A full-shape float buffer for a broadcast parameter's partials, kept per shape among
    the device's scratch buffers."""
    key = ("pydiff.generated_vector partials", shape, ordinal)
    if key not in dev.scratch:
        dev.scratch[key] = allocate(dev, shape, "float")
    return dev.scratch[key]


def fwds(fn: FunctionTarget, args: list, tangents: list) -> tuple[Tensor, Tensor] | None:
    """Forward mode: ``(f(args), J tangents)`` as two new tensors of the call's shape;
    ``tangents[i]`` a tensor, a number (for a float), or None (no_diff / zero). None when
    not covered."""
    reason = _checked(fn, args)
    if reason is None and not fn.signature.differentiable:
        reason = "not differentiable"
    for p, t in zip(fn.signature.params, tangents):
        if reason is None and t is not None and p.no_diff:
            reason = f"tangent for no_diff parameter '{p.name}'"
    found = reason or layout_of(fn, args, None)
    if type(found) is not str:
        layout, shape = found
        found = layout_of(fn, tangents, shape, tangents=True)
    if type(found) is str:
        decline("fwds", found)
        return None
    tlayout = found[0]
    width = WIDTHS[fn.signature.return_type]
    numel = math.prod(shape)
    kernel, threads = _kernel(
        fn, "fwds", (layout, tlayout, width), numel,
        lambda group, looped: fwds_source(fn, layout, tlayout, width, group, looped),
    )  # fmt: skip
    if kernel is None:
        return None
    dev = fn.module.device
    value, tangent = new_result(shape, width, dev), new_result(shape, width, dev)
    bindings = _bindings(args) | _bindings(tangents, "t")
    bindings.update(pydiff_result=value.buffer, pydiff_tangent=tangent.buffer)
    _dispatch(fn, kernel, threads, numel, bindings)
    count("fwds")
    count("fwds: vector")
    return value, tangent
