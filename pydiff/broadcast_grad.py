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

from .call_shape import param_type, result_type
from .grid_args import is_grid
from .signature import FunctionTarget
from .tensor import Tensor

EXPANDABLE = ("float", "half")  # scalars the reduction kernels read (and their vectors, matrices)
_AGGREGATE = re.compile(
    r"^(?:vector<(float|half),(\d+)>|matrix<(float|half),(\d+),(\d+)>|(float|half)\[(\d+)\])$"
)
_GENERATED = {"CallIdArg", "ThreadIdArg", "WangHashArg", "RandFloatArg"}  # no part of the shape


def _aggregate(name: str) -> tuple[str, tuple[int, ...]] | None:
    """(scalar, element shape) of a float/half vector, matrix or array type name, else None."""
    m = _AGGREGATE.match(name.replace(" ", ""))
    if not m:
        return None
    if m.group(1):
        return m.group(1), (int(m.group(2)),)
    if m.group(6):
        return m.group(6), (int(m.group(7)),)
    return m.group(3), (int(m.group(4)), int(m.group(5)))


def components(t: Tensor) -> tuple[str, int]:
    """(scalar, count) of one gradient element of ``t``: ('float', 1) for float, ('float', N)
    for a float vector, ('half', R*C) for a half matrix (SlangPy packs them tightly);
    ('', 0) when pydiff cannot sum it."""
    native = t.grad_out.bind(False, False) if t.grad_out is not None else None
    if native is None or not native.is_contiguous():
        return "", 0
    name = native.dtype.full_name.replace(" ", "")
    if name in EXPANDABLE:
        return name, 1
    found = _aggregate(name)
    if found is None:
        return "", 0
    return found[0], math.prod(found[1])


def expandable(t: Tensor) -> bool:
    """Whether pydiff sums ``t``'s broadcast gradient itself (float/half, their vectors and
    matrices)."""
    return components(t)[1] > 0


def element_axes(p: Any, t: Tensor) -> int | None:
    """How many trailing axes of ``t`` one element of parameter ``p`` takes: 0 when ``t``'s
    element type is the parameter's, 1 for a float tensor of shape (..., N) passed to a
    float<N> parameter, 2 for (..., R, C) to a floatRxC one; None when pydiff cannot tell."""
    return _element_axes(p.type_name, t)


def _element_axes(type_name: str, t: Tensor) -> int | None:
    name = t.element_type.full_name
    if name == type_name:
        return 0
    found = _aggregate(type_name)
    if found is None or found[0] != name.replace(" ", ""):
        return None
    k = len(found[1])
    return k if tuple(t.shape[-k:]) == found[1] and len(t.shape) >= k else None


def _as_scalars(device: Any, x: spy.Tensor, shape: list[int], k: int, scalar: str) -> spy.Tensor:
    """A contiguous tensor of k-scalar elements seen as scalars, with a last axis of k."""
    dims = [*shape, k]
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return spy.Tensor(x.storage, device.dtype(scalar), dims, strides[::-1], x.offset * k)


_MIN_CHUNK = 64  # fewest elements one thread sums
_TARGET_THREADS = 16384  # enough threads to fill a GPU; more passes below this


def call_shape(fn: FunctionTarget, bound: list, result: Any) -> tuple[int, ...] | None:
    """The shape SlangPy vectorises the call over, or None when pydiff cannot tell.

    NumPy's right-aligned broadcast of the vectorised tensor arguments (and the result).
    A float tensor for a float vector or matrix parameter contributes its shape without the
    element's axes; spy.call_id/thread_id/wang_hash/rand_float nothing (they follow the call
    shape). Any other element type mismatch, or an argument of unknown shape: None.
    """
    shapes = []
    for p, value in bound:
        if type(value) is Tensor:
            if p.tensor_kind is not None:
                continue  # whole-tensor parameters do not vectorise
            k = _element_axes(param_type(p, value), value)  # a generic T: its argument's
            if k is None:
                return None
            shapes.append(value.shape[: len(value.shape) - k])
        elif value is None or isinstance(value, (bool, int, float)):
            continue
        elif type(value).__name__ in _GENERATED:
            continue
        elif _plain_grid(value):
            shapes.append(tuple(int(d) for d in value.shape))
        else:
            return None
    if type(result) is Tensor:
        k = _element_axes(result_type(fn, bound), result)
        if k is None:
            return None
        shapes.append(result.shape[: len(result.shape) - k])
    if not shapes:
        return None
    try:
        return tuple(int(s) for s in np.broadcast_shapes(*shapes))
    except ValueError:
        return None  # SlangPy will report the mismatch


def _plain_grid(value: Any) -> bool:
    """A ``spy.grid`` of a fixed shape: its shape is its part of the call shape, whatever its
    stride and offset (they change the ids it yields, not how many threads run)."""
    if not is_grid(value):
        return False
    return all(int(d) > 0 for d in value.shape)


def _own_shape(t: Tensor, p: Any) -> tuple[int, ...]:
    """``t``'s shape without the axes one element of ``p`` takes."""
    k = (element_axes(p, t) or 0) if p is not None else 0
    return tuple(t.shape[: len(t.shape) - k])


def is_broadcast(t: Tensor, shape: tuple[int, ...] | None, p: Any = None) -> bool:
    """Whether ``t`` (passed to parameter ``p``) is read by more call elements than it has
    elements of ``p``'s type (its gradient is a sum)."""
    own = _own_shape(t, p)
    if shape is None or own == shape:
        return False
    return math.prod(shape) > math.prod(own)


def expand(
    scope: Any, device: Any, t: Tensor, shape: tuple[int, ...] | None, ordinal: int, p: Any = None
) -> spy.Tensor:
    """``t``'s values as a stride-0 view of the call ``shape`` (None: ``t``'s own), with a
    zeroed full-shape gradient (a float tensor for a float3 parameter keeps its last axis)."""
    own = _own_shape(t, p)
    shape = tuple(shape if shape is not None else own) + tuple(t.shape[len(own) :])
    grad_dtype = t.grad_dtype
    numel = math.prod(shape)
    key = ("broadcast-grad", numel, grad_dtype.full_name, ordinal)  # shapes of one size share
    if key not in device.scratch:
        # One spare element: Vulkan clears whole 4-byte words, so an odd count of halves
        # would keep its last element (SlangPy's Tensor.clear rounds the size down).
        flat = spy.Tensor.zeros(device.native, (numel + 1,), grad_dtype)
        device.scratch[key] = [flat, None, None]  # + the last shape viewed, and its view
    entry = device.scratch[key]
    if entry[1] != shape:
        entry[1], entry[2] = shape, entry[0].view(shape)
    full = entry[2]
    scope.clear(device, full)
    values = t.bind(False, False) if t.shape else t.bind(False, False).view((1,))
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
    lib = device.cached(("broadcast-grad", "kernels"), lambda: _Kernels(device), kernels=True)
    dtype = t.grad_out.dtype
    shape = list(full.shape)
    x = full
    target = tuple(t.shape)
    grad = t.grad_out.bind(False, False)
    scalar, k = components(t)
    if k > 1:  # vectors/matrices: sum them as scalars with a last axis of k
        x = _as_scalars(device, full, shape, k, scalar)
        grad = _as_scalars(device, grad, list(t.shape), k, scalar)
        shape, target, dtype = [*shape, k], (*target, k), scalar
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
        lib.add_into[scalar],
        spy.grid((numel,)),
        x.view((numel,)),
        grad,
    )
