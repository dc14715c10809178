"""Gradients of broadcast parameters without contended float atomics.

SlangPy adds the gradient of a parameter broadcast over a vectorised call (a bias, a (1,)
coefficient) with one float atomic per call element, all into the same address: slow,
different bits every run, and inaccurate (2^24 adds of ~0.5 are off by 2%). pydiff instead
binds the parameter's values as a stride-0 view of the call's shape with a *full-shape*
gradient buffer behind it, so each thread adds into its own element, then sums that buffer
along the broadcast axes in a fixed order with compensated sums (shaders/accumulate.slang),
in float64 (a float32 partial sum could overflow where the total fits), and adds the result
into ``grad_out`` rounded once. inf and NaN follow IEEE's rules.

    shape = call_shape(fn, bound, result)           # (2**24,) for polynomial(a, b, c, x)
    native = expand(scope, device, a, shape, ordinal=0)     # bind this instead of a
    reduce_into(scope, device, native.grad_out, a)          # after the call: a.grad += sum
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import slangpy as spy

from .signature import FunctionTarget
from .tensor import Tensor

EXPANDABLE = ("float", "half")  # gradient dtypes the reduction kernels read
_FLOAT_AGGREGATE = re.compile(r"^(vector<float,(\d+)>|matrix<float,(\d+),(\d+)>)$")


def float_components(t: Tensor) -> int:
    """How many floats one gradient element of ``t`` is: 1 for float, N for a float vector,
    R*C for a float matrix (SlangPy packs them tightly); 0 when pydiff cannot sum it."""
    native = t.grad_out.native if t.grad_out is not None else None
    if native is None or not native.is_contiguous():
        return 0
    name = native.dtype.full_name.replace(" ", "")
    if name == "float":
        return 1
    m = _FLOAT_AGGREGATE.match(name)
    if not m:
        return 0
    return int(m.group(2)) if m.group(2) else int(m.group(3)) * int(m.group(4))


def expandable(t: Tensor) -> bool:
    """Whether pydiff sums ``t``'s broadcast gradient itself (float/half, float vectors and
    matrices)."""
    return t.grad_out.dtype in EXPANDABLE or float_components(t) > 1


def _as_floats(device: Any, x: spy.Tensor, shape: list[int], k: int) -> spy.Tensor:
    """A contiguous tensor of k-float elements seen as floats, with a last axis of k."""
    dims = [*shape, k]
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return spy.Tensor(x.storage, device.dtype("float"), dims, strides[::-1], x.offset * k)


_MIN_CHUNK = 64  # fewest elements one thread sums
_TARGET_THREADS = 16384  # enough threads to fill a GPU; more passes below this


def call_shape(fn: FunctionTarget, bound: list, result: Any) -> tuple[int, ...] | None:
    """The shape SlangPy vectorises the call over, or None when pydiff cannot tell.

    NumPy's right-aligned broadcast of the vectorised tensor arguments (and the result).
    A tensor whose element type differs from its parameter's (a float tensor for a float3
    parameter), or an argument such as spy.grid, could add dimensions: None then.
    """
    shapes = []
    for p, value in bound:
        if type(value) is Tensor:
            if p.tensor_kind is not None:
                continue  # whole-tensor parameters do not vectorise
            if value.native.dtype.full_name != p.type_name:
                return None
            shapes.append(value.shape)
        elif value is None or isinstance(value, (bool, int, float)):
            continue
        elif _plain_grid(value):
            shapes.append(tuple(int(d) for d in value.shape))
        else:
            return None
    if type(result) is Tensor:
        if result.native.dtype.full_name != fn.signature.return_type:
            return None
        shapes.append(result.shape)
    if not shapes:
        return None
    try:
        return tuple(int(s) for s in np.broadcast_shapes(*shapes))
    except ValueError:
        return None  # SlangPy will report the mismatch


def _plain_grid(value: Any) -> bool:
    """A ``spy.grid`` of a fixed shape: its shape is its part of the call shape, whatever its
    stride and offset (they change the ids it yields, not how many threads run)."""
    if type(value).__name__ != "GridArg":
        return False
    return all(int(d) > 0 for d in value.shape)


def is_broadcast(t: Tensor, shape: tuple[int, ...] | None) -> bool:
    """Whether ``t`` is read by more call elements than it has (its gradient is a sum)."""
    if shape is None or t.shape == shape:
        return False
    return math.prod(shape) > t.numel


def expand(scope: Any, device: Any, t: Tensor, shape: tuple[int, ...], ordinal: int) -> spy.Tensor:
    """``t``'s values as a stride-0 view of ``shape``, with a zeroed full-shape gradient."""
    grad_dtype = t.grad_dtype
    key = ("broadcast-grad", shape, grad_dtype.full_name, ordinal)
    if key not in device.scratch:
        # One spare element: Vulkan clears whole 4-byte words, so an odd count of halves
        # would keep its last element (SlangPy's Tensor.clear rounds the size down).
        numel = math.prod(shape)
        device.scratch[key] = spy.Tensor.zeros(device.native, (numel + 1,), grad_dtype).view(shape)
    full = device.scratch[key]
    scope.clear(device, full)
    values = t.native if t.shape else t.native.view((1,))
    return values.broadcast_to(shape).with_grads(grad_in=full, grad_out=full, zero=False)


def _reduced_runs(shape: tuple[int, ...], target: tuple[int, ...]) -> list[tuple[int, int]]:
    """Runs [a, b) of consecutive axes of ``shape`` that ``target`` (right-aligned) sums over."""
    padded = (1,) * (len(shape) - len(target)) + tuple(target)
    runs: list[tuple[int, int]] = []
    for axis, (n, keep) in enumerate(zip(shape, padded)):
        if keep == 1 and n != 1:
            if runs and runs[-1][1] == axis:
                runs[-1] = (runs[-1][0], axis + 1)
            else:
                runs.append((axis, axis + 1))
    return runs


def _sum_axes(
    scope: Any, lib: "_Kernels", x: spy.Tensor, dtype: str, outer: int, n: int, inner: int
) -> spy.Tensor:
    """Sum the middle axis of an (outer, n, inner) view, in passes of fixed chunks (double out:
    a float32 partial sum could overflow where the total fits)."""
    while True:
        chunks = max(1, min(-(-n // _MIN_CHUNK), -(-_TARGET_THREADS // max(outer * inner, 1))))
        chunk = -(-n // chunks)
        chunks = -(-n // chunk)
        out = spy.Tensor.empty(lib.device_native, (outer, chunks, inner), "double")
        node = lib.partial_sums[dtype]
        grid = spy.grid((outer, chunks, inner))
        scope.dispatch(node, grid, x.view((outer, n, inner)), chunk, out)
        if chunks == 1:
            return out
        x, n, dtype = out, chunks, "double"


class _Kernels:
    """The library's reduction kernels, looked up once per device."""

    def __init__(self, device: Any):
        lib = device.library
        self.device_native = device.native
        self.partial_sums = {
            "float": lib.det_partial_sums_float,
            "half": lib.det_partial_sums_half,
            "double": lib.det_partial_sums_double,
        }
        self.add_into = {"float": lib.det_add_into_float, "half": lib.det_add_into_half}


def reduce_into(scope: Any, device: Any, full: spy.Tensor, t: Tensor) -> None:
    """Dispatch ``t.grad_out += full`` summed over the axes ``t`` was broadcast along."""
    lib = device.cached(("broadcast-grad", "kernels"), lambda: _Kernels(device))
    dtype = t.grad_out.dtype
    shape = list(full.shape)
    x = full
    target = tuple(t.shape)
    grad = t.grad_out.native
    k = float_components(t)
    if k > 1:  # float vectors/matrices: sum them as floats with a last axis of k
        x = _as_floats(device, full, shape, k)
        grad = _as_floats(device, grad, list(t.shape), k)
        shape, target, dtype = [*shape, k], (*target, k), "float"
    runs = _reduced_runs(tuple(shape), target) or [(0, 0)]  # none: one pass converts
    for a, b in runs:
        outer = math.prod(shape[:a])
        n = math.prod(shape[a:b])
        inner = math.prod(shape[b:])
        x = _sum_axes(scope, lib, x, dtype, outer, n, inner)
        shape[a:b] = [1] * (b - a)
        dtype = "double"
    numel = max(t.numel, 1) * max(k, 1)
    grad = grad.view((numel,))
    scope.dispatch(
        lib.add_into["float" if k > 1 else t.grad_out.dtype],
        spy.grid((numel,)),
        x.view((numel,)),
        grad,
    )
