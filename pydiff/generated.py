"""Generated compute kernels for elementwise calls of a user's function: for a call pydiff can
see whole (every parameter a ``float``, each argument a number or a contiguous float tensor of
the call's shape), a Slang kernel that imports the user's module and calls the function (or
its ``bwd_diff``) per element, one float4 (four elements) per thread in 256-thread groups,
each gradient added with a plain store (every thread owns its elements: no atomics). It is
compiled once per function and argument layout and dispatched like pydiff's own kernels
(``device.kernels.dispatch``: batched with the device's queue).

What it does not cover it declines (``None`` / ``False``, nothing done), and the caller takes
SlangPy's path unchanged. ``PYDIFF_GENERATED=0`` turns it off; ``stats()`` counts the calls
per path and the reasons for declining.

    y = generated.forward(m.polynomial, [2.0, 8.0, -1.0, x], x.shape)     # None: declined
    done = generated.backward(m.polynomial, [2.0, 8.0, -1.0, x], dy, {3: x.grad_out})
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import Counter
from typing import Any, Callable

import numpy as np

from .buffer_pool import BoundedDict
from .creation import empty
from .kernels import KERNELS_MAX
from .signature import FunctionTarget
from .tensor import Tensor, float4_ready

#: Threads per group, and at most this many groups (Vulkan's guaranteed limit; beyond it each
#: thread loops over several float4s). One float4 per thread measured fastest on lavapipe:
#: 2^24 floats forward + backward 43-52 ms, against 260 ms with 64 or 256 looping groups.
GROUP = 256
MAX_GROUPS = 65535
#: Calls of at most this many float4s run in 32-thread groups: lavapipe runs a whole group
#: however few threads have work (16 elements: about 15 us less per fwd + bwd).
SMALL_COUNT = 64
SMALL_GROUP = 32

#: pydiff calls take this path from this many elements up: below it a generated dispatch,
#: recorded from Python, costs more than SlangPy's (16 elements: ~105 against ~90 us).
#: ``PYDIFF_GENERATED_MIN_ELEMENTS=1`` sends every covered call this way (the test suite).
MIN_ELEMENTS = int(os.environ.get("PYDIFF_GENERATED_MIN_ELEMENTS", "4096"))
_NUMBERS = (float, int, np.float32, np.float64)  # not bool: SlangPy's path decides
_stats: Counter = Counter()
_lock = threading.Lock()


def enabled() -> bool:
    """Whether generated kernels may be used (``PYDIFF_GENERATED=0`` turns them off)."""
    return os.environ.get("PYDIFF_GENERATED", "1") != "0"


def settings() -> dict[str, Any]:
    """What ``pydiff info`` reports: whether the path is on, and from how many elements."""
    return {"enabled": enabled(), "min_elements": MIN_ELEMENTS}


def stats() -> dict[str, int]:
    """Calls per path since the last ``reset_stats()``: ``forward``/``backward`` (generated),
    ``forward_fallback``/``backward_fallback`` (declined), and ``declined: <reason>`` each."""
    return dict(_stats)


def reset_stats() -> None:
    _stats.clear()


def _decline(kind: str, reason: str) -> None:
    _stats[f"{kind}_fallback"] += 1
    _stats[f"declined: {reason}"] += 1


# --------------------------------------------------------------------------------------------
# what the generator covers


def _uncovered(fn: FunctionTarget, args: list, shape: tuple) -> str | None:
    """Why the call is not covered, or None when it is."""
    sig = fn.signature
    if not enabled():
        return "PYDIFF_GENERATED=0"
    if fn.module.traps.get(fn.name):
        return "trap findings"
    if sig.return_type != "float":
        return f"returns {sig.return_type}"
    if len(args) != len(sig.params):
        return "argument count"
    tensors = 0
    for p, value in zip(sig.params, args):
        if p.type_name != "float" or p.io != "in" or p.tensor_kind is not None or p.generic:
            return f"parameter '{p.name}' is {p.io} {p.type_name}"
        if type(value) is Tensor:
            if value.device is not fn.module.device or value.dtype != "float":
                return f"parameter '{p.name}': tensor of another device or dtype"
            if value.shape != tuple(shape) or not float4_ready(value):
                return f"parameter '{p.name}': tensor not contiguous float4 storage of the call"
            tensors += 1
        elif type(value) not in _NUMBERS:
            return f"parameter '{p.name}': {type(value).__name__} argument"
    if not tensors:
        return "no tensor argument"
    return None


def _pattern(args: list) -> tuple[bool, ...]:
    """Which arguments are tensors (the kernel's layout)."""
    return tuple(type(v) is Tensor for v in args)


# --------------------------------------------------------------------------------------------
# Slang source


def _header(fn: FunctionTarget, typed_loads: bool) -> str:
    float4_in = "Buffer<float4>" if typed_loads else "StructuredBuffer<float4>"
    return f"import {fn.module.import_spec};\ntypealias Float4In = {float4_in};\n\n"


def _params(pattern: tuple[bool, ...]) -> list[str]:
    return [
        f"uniform Float4In pydiff_a{i}" if tensor else f"uniform float pydiff_a{i}"
        for i, tensor in enumerate(pattern)
    ]


def _element(pattern: tuple[bool, ...], i: int) -> str:
    return f"pydiff_v{i}[pydiff_k]" if pattern[i] else f"pydiff_a{i}"


def _loads(pattern: tuple[bool, ...]) -> str:
    return "".join(
        f"        float4 pydiff_v{i} = pydiff_a{i}[pydiff_q];\n"
        for i, tensor in enumerate(pattern)
        if tensor
    )


def _kernel(entry: str, params: list[str], body: str, group: int) -> str:
    params = ["uint3 pydiff_tid: SV_DispatchThreadID", *params]
    params += [
        "uniform uint pydiff_count",
        "uniform uint pydiff_tail",
        "uniform uint pydiff_stride",
    ]
    joined = ",\n    ".join(params)
    return (
        f'[shader("compute")][numthreads({group}, 1, 1)]\nvoid {entry}(\n    {joined})\n{{\n'
        "    for (uint pydiff_q = pydiff_tid.x; pydiff_q < pydiff_count; "
        "pydiff_q += pydiff_stride)\n    {\n"
        f"{body}    }}\n}}\n"
    )


def forward_source(
    fn: FunctionTarget, pattern: tuple[bool, ...], typed_loads: bool, group: int = GROUP
) -> str:
    """The kernel ``pydiff_gen_fwd``: result[q] = f(args[q]) for each float4 q."""
    call = f"{fn.name}({', '.join(_element(pattern, i) for i in range(len(pattern)))})"
    body = (
        _loads(pattern) + "        float4 pydiff_r;\n"
        "        [ForceUnroll] for (int pydiff_k = 0; pydiff_k < 4; pydiff_k++)\n"
        f"            pydiff_r[pydiff_k] = {call};\n"
        "        pydiff_result[pydiff_q] = pydiff_r;\n"
    )
    params = _params(pattern) + ["uniform RWStructuredBuffer<float4> pydiff_result"]
    return _header(fn, typed_loads) + _kernel("pydiff_gen_fwd", params, body, group)


def backward_source(
    fn: FunctionTarget,
    pattern: tuple[bool, ...],
    sums: tuple[tuple[int, ...], ...],
    typed: bool,
    group: int = GROUP,
) -> str:
    """The kernel ``pydiff_gen_bwd``: for each float4 q, ``bwd_diff(f)`` per element with the
    upstream gradient, then each gradient buffer j (adding the parameters in ``sums[j]``)
    ``g_j[q] = g_j_in[q] + d`` (in the last float4 only the call's elements)."""
    params = _params(pattern) + ["uniform Float4In pydiff_up"]
    for j in range(len(sums)):
        params += [
            f"uniform RWStructuredBuffer<float4> pydiff_g{j}",
            f"uniform Float4In pydiff_g{j}_in",
        ]
    wanted = sorted(i for members in sums for i in members)
    body = _loads(pattern) + "        float4 pydiff_u = pydiff_up[pydiff_q];\n"
    body += "".join(f"        float4 pydiff_d{i} = float4(0.0);\n" for i in wanted)
    body += "        [ForceUnroll] for (int pydiff_k = 0; pydiff_k < 4; pydiff_k++)\n        {\n"
    args = []
    for i, p in enumerate(fn.signature.params):
        if p.no_diff:
            args.append(_element(pattern, i))
            continue
        body += f"            var pydiff_p{i} = diffPair({_element(pattern, i)});\n"
        args.append(f"pydiff_p{i}")
    body += f"            bwd_diff({fn.name})({', '.join(args)}, pydiff_u[pydiff_k]);\n"
    body += "".join(f"            pydiff_d{i}[pydiff_k] = pydiff_p{i}.d;\n" for i in wanted)
    body += "        }\n        bool4 pydiff_in = pydiff_q + 1 < pydiff_count"
    body += " ? bool4(true) : uint4(0, 1, 2, 3) < pydiff_tail;\n"
    for j, members in enumerate(sums):
        d = " + ".join(f"pydiff_d{i}" for i in members)
        body += (
            f"        float4 pydiff_o{j} = pydiff_g{j}_in[pydiff_q];\n        pydiff_g{j}"
            f"[pydiff_q] = select(pydiff_in, pydiff_o{j} + ({d}), pydiff_o{j});\n"
        )
    return _header(fn, typed) + _kernel("pydiff_gen_bwd", params, body, group)


# --------------------------------------------------------------------------------------------
# compiling and dispatching


def _group(numel: int) -> int:
    return SMALL_GROUP if -(-numel // 4) <= SMALL_COUNT else GROUP


def _compiled(fn: FunctionTarget, key: tuple, entry: str, make: Callable[[], str]) -> Any:
    """The kernel for ``key``, built from the source ``make()`` returns once per device (the
    ``KERNELS_MAX`` most recently used are kept); None, remembered, if it fails to build:
    the call falls back."""
    dev = fn.module.device
    cache = dev.cached("pydiff.generated", lambda: BoundedDict(KERNELS_MAX))
    with _lock:
        if key in cache:
            return cache[key]
    source = make()
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    try:
        module = dev.native.load_module_from_source(f"pydiff_gen_{fn.name}_{digest}", source)
        program = dev.native.link_program([module], [module.entry_point(entry)])
        kernel = dev.native.create_compute_kernel(program)
    except Exception:  # e.g. an overload the generated call cannot pick: SlangPy's path
        kernel = None
    with _lock:
        cache[key] = kernel
    return kernel


def _launch(fn: FunctionTarget, kernel: Any, numel: int, bindings: dict) -> None:
    count, group = -(-numel // 4), _group(numel)
    threads = min(-(-count // group), MAX_GROUPS) * group
    bindings.update(pydiff_count=count, pydiff_tail=numel - 4 * (count - 1), pydiff_stride=threads)
    fn.module.device.kernels.dispatch(kernel, threads, **bindings)


def _arguments(args: list) -> dict:
    return {
        f"pydiff_a{i}": v.native.storage if type(v) is Tensor else float(v)
        for i, v in enumerate(args)
    }


def forward(
    fn: FunctionTarget, args: list, shape: tuple | None, out: Tensor | None = None
) -> Tensor | None:
    """``fn`` over ``args`` (one per parameter, in order) as a generated kernel: a new tensor
    of ``shape`` (None: the first tensor argument's), or ``out`` written, or None when the
    call is not covered (nothing done)."""
    if shape is None:
        shape = next((v.shape for v in args if type(v) is Tensor), ())
    shape = tuple(shape)
    reason = _uncovered(fn, args, shape)
    if reason is None and out is not None:
        if not (type(out) is Tensor and out.shape == shape and float4_ready(out)):
            reason = "_result not contiguous float4 storage of the call"
    if reason is not None:
        _decline("forward", reason)
        return None
    dev = fn.module.device
    pattern = _pattern(args)
    group = _group(math.prod(shape))
    key = (fn, "fwd", pattern, dev.typed_loads, group)
    kernel = _compiled(
        fn, key, "pydiff_gen_fwd", lambda: forward_source(fn, pattern, dev.typed_loads, group)
    )
    if kernel is None:
        _decline("forward", "kernel failed to build")
        return None
    if out is None:
        out = empty(shape, device=dev)
    bindings = _arguments(args)
    bindings["pydiff_result"] = out.native.storage
    _launch(fn, kernel, out.numel, bindings)
    _stats["forward"] += 1
    return out


def backward(fn: FunctionTarget, args: list, upstream: Tensor, grads: dict[int, Tensor]) -> bool:
    """Add the gradient of each parameter ``i`` in ``grads`` into ``grads[i]`` (plain adds,
    as under ACCUMULATE) given the result's ``upstream`` gradient, as one generated kernel;
    False, nothing done, when the call is not covered (a gradient wanted for a number, a
    gradient buffer shared with a value the kernel reads, ...)."""
    reason = _uncovered(fn, args, upstream.shape)
    reason = reason or _uncovered_backward(fn, args, upstream, grads)
    if reason is not None:
        _decline("backward", reason)
        return False
    dev = fn.module.device
    pattern = _pattern(args)
    buffers: dict[int, list[int]] = {}  # parameters adding into one gradient buffer
    for i in sorted(grads):
        buffers.setdefault(id(grads[i].storage), []).append(i)
    sums = tuple(tuple(g) for g in buffers.values())
    group = _group(upstream.numel)
    key = (fn, "bwd", pattern, sums, dev.typed_loads, group)
    kernel = _compiled(
        fn,
        key,
        "pydiff_gen_bwd",
        lambda: backward_source(fn, pattern, sums, dev.typed_loads, group),
    )
    if kernel is None:
        _decline("backward", "kernel failed to build")
        return False
    bindings = _arguments(args)
    bindings["pydiff_up"] = upstream.native.storage
    for j, members in enumerate(sums):
        bindings[f"pydiff_g{j}"] = bindings[f"pydiff_g{j}_in"] = grads[members[0]].native.storage
    _launch(fn, kernel, upstream.numel, bindings)
    _stats["backward"] += 1
    return True


def _uncovered_backward(
    fn: FunctionTarget, args: list, upstream: Tensor, grads: dict[int, Tensor]
) -> str | None:
    if not fn.signature.differentiable:
        return "not differentiable"
    if not grads:
        return "no gradient wanted"
    dev = fn.module.device
    if type(upstream) is not Tensor or upstream.device is not dev or upstream.dtype != "float":
        return "upstream gradient not a float tensor of the device"
    if not float4_ready(upstream):
        return "upstream not contiguous float4 storage"
    read = {id(upstream.storage)} | {id(v.storage) for v in args if type(v) is Tensor}
    for i, g in grads.items():
        if not 0 <= i < len(args) or type(args[i]) is not Tensor:
            return "gradient wanted for a number"  # its sum over the call: not generated yet
        if fn.signature.params[i].no_diff:
            return f"gradient wanted for no_diff parameter '{fn.signature.params[i].name}'"
        if type(g) is not Tensor or g.device is not dev or g.dtype != "float":
            return "gradient buffer not a float tensor of the device"
        if g.shape != upstream.shape or not float4_ready(g):
            return "gradient buffer not contiguous float4 storage of the call"
        if id(g.storage) in read:
            return "gradient buffer shared with a value the call reads"
    return None


# --------------------------------------------------------------------------------------------
# the call layer's entry points


def call_forward(fn: FunctionTarget, bound: list, options: dict, result: Any) -> Tensor | None:
    """A forward call (``(param, value)`` pairs) as a generated kernel when it is large and
    covered: a tensor result (new or given), no SlangPy options; None: SlangPy's path."""
    if options.keys() > {"_result"} or not (
        type(result) is Tensor or type(result) is str and result == "tensor"
    ):
        return None
    first = next((v for _, v in bound if type(v) is Tensor), None)
    if first is None or first.numel < MIN_ELEMENTS:
        return None
    given = result if type(result) is Tensor else None
    return forward(fn, [v for _, v in bound], None, out=given)


def call_backward(fn: FunctionTarget, bound: list, options: dict, result: Any) -> bool:
    """A ``.bwds`` adding gradients under ACCUMULATE as a generated kernel, when it is large
    and covered; False: SlangPy's path."""
    if options or type(result) is not Tensor or result.grad_in is None:
        return False
    if result.numel < MIN_ELEMENTS:
        return False
    grads = {
        i: v.grad_out for i, (p, v) in enumerate(bound) if type(v) is Tensor and p.differentiable
    }
    return backward(fn, [v for _, v in bound], result.grad_in, grads)
