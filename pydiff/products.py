"""The specialised kernels behind pydiff's ops: register-blocked matrix products (fused bias,
relu and masks), a narrow linear layer's whole backward in one kernel, float4 elementwise
kernels, each dispatched directly through ``device.kernels`` (which kernel fits a shape:
``product_kernels``); ``product`` falls back to the library's per-element SlangPy functions
where the kernels do not fit (shapes, layouts, backends).

    out = product("mm_nt", x, w, (batch, n_out), bias=b)     # x W^T + b
    fast_product("mm_tn", g, x, dw, beta=1.0)                 # dW += g^T x, if it fits
    linear_backward_narrow(g, x, w, dx, dw, db)               # all three, if it fits
"""

from __future__ import annotations

from typing import Any

import slangpy as spy

from . import capturing
from .head_fusion import hold as hold_head
from .creation import empty, tensor, zeros
from .module import library
from .product_kernels import blocking  # noqa: F401 (ops_linear reads it here)
from .product_kernels import load_words, product_plan
from .tensor import Tensor, float4_ready

import numpy as np


PLANS_MAX = 4096  # fast_product's memo (kernels.plans), emptied beyond
# The product kernels take their sizes as uniforms: one kernel serves every batch size (a
# kernel per size cost a compile and 1.5-2.5 MB). A shape used HOT_SHAPE_USES times gets
# kernels of its own with the sizes as constants, for at most FIXED_SHAPES_MAX shapes per
# device: a training step's products ran 60 us faster of a 0.41 ms captured MLP step
# (lavapipe; docs/benchmarks-history.md).
HOT_SHAPE_USES = 3
FIXED_SHAPES_MAX = 8


def sizes_fixed(kernels: Any, shape: tuple) -> bool:
    """Count a use of ``shape`` (a product's or a layer's sizes and options); whether its
    kernels take the sizes as constants (``HOT_SHAPE_USES``, or at once in a capture, which
    is replayed; ``FIXED_SHAPES_MAX``). The counts
    live in ``kernels`` (``shape_uses``, ``fixed_shapes``), emptied by ``empty_cache``.

    >>> fixed = sizes_fixed(dev.kernels, ("product", "mm_nt", 256, 64, 64))   # third use: True
    """
    fixed = kernels.fixed_shapes
    if shape in fixed:
        return True
    uses = kernels.shape_uses
    n = uses.get(shape, 0) + 1
    hot = n >= HOT_SHAPE_USES or capturing.recording() is not None  # (a capture replays)
    if hot and len(fixed) < FIXED_SHAPES_MAX:
        fixed.add(shape)
        uses.pop(shape, None)
        return True
    if n < HOT_SHAPE_USES and len(uses) < PLANS_MAX:
        uses[shape] = n
    return False


def fast_product(
    kind: str,
    a: Tensor,
    b: Tensor,
    out: Tensor,
    beta: float,
    bias: Tensor | None = None,
    *,
    relu: bool = False,
    mask: Tensor | None = None,
    db: Tensor | None = None,
) -> bool:
    """out = beta * out + a (x) b (+ bias, then relu) with the specialised kernels, A read
    through ``mask`` (A * [mask > 0]) and, for mm_tn, ``db`` = beta * db + column sums of
    (masked) A; False, with nothing done, if the kernels do not fit."""
    m, n = out.shape
    k = a.shape[0] if kind == "mm_tn" else a.shape[1]
    extra = [t for t in (bias, mask, db) if t is not None]
    if not float4_ready(a, b, out, *extra):
        return False
    kernels = a.device.kernels
    # The plan depends on the shapes and options only: found once (a step's products repeat),
    # kept by the kernel cache with its kernels
    key = ("product", kind, m, n, k, bias is not None, relu, mask is not None, db is not None)
    fixed = sizes_fixed(kernels, key)
    key += (fixed,)
    plan = kernels.plans.get(key)
    if plan and not kernels.touch(plan[0]):  # (its kernel evicted by another thread meanwhile)
        plan = None
    if plan is None:
        plan = product_plan(kernels, *key[1:])
        if len(kernels.plans) >= PLANS_MAX:  # (shapes that never fit build no kernel)
            kernels.plans.clear()
        kernels.plans[key] = plan
    if not plan:
        return False
    _, kernel, threads, c_vec, swap, head = plan
    # (dispatch's bindings given apart: buffers, then numbers, in a fixed order per plan)
    c = out.buffer
    if swap:  # dW as (x^T g')^T: the mask on the shared side (product_kernels' swapped form)
        a, b, m = b, a, n
    buffers = [("a", a.buffer), ("b", b.buffer), ("c", c)]
    scalars = [("beta", float(beta))] if fixed else [("beta", float(beta)), ("M", m), ("K", k)]
    if c_vec:
        buffers.append(("c_in", c))
    if kind == "mm_nt":
        buffers.append(("bias", (bias if bias is not None else a).buffer))
    if mask is not None:
        buffers.append(("mask", mask.buffer))
    if db is not None:
        buffers.append(("db", db.buffer))
        db.storage.wrote(kind)
    # held back where a cross-entropy may finish it in the same kernel (pydiff.head_fusion)
    if head is None or beta or not hold_head(kernel, head, buffers, scalars, out):
        kernels.dispatch_split(kernel, threads, buffers, scalars)
    out.storage.wrote(kind)
    return True


# The one-dispatch backward of a narrow linear layer (matmul.slang's linear_bwd_narrow): up to
# this many outputs, and as many rows as the fused bias sum takes (its threads walk every row).
NARROW_MAX_OUTPUTS = 16
NARROW_MAX_ROWS = 4096


def narrow_fits(batch: int, n_in: int, n_out: int, device: Any) -> bool:
    """Whether ``linear_backward_narrow`` takes a (batch, n_in) -> n_out layer."""
    return not (
        n_out > NARROW_MAX_OUTPUTS or n_in % 64 or batch > NARROW_MAX_ROWS or device.kernels.gpu
    )


def linear_backward_narrow(
    g: Tensor,
    x: Tensor,
    w: Tensor,
    dx: Tensor | None,
    dw: Tensor,
    db: Tensor | None,
    mask: Tensor | None = None,
    cross_entropy: dict | None = None,
) -> bool:
    """dx += g' W, dW += g'^T x and db += column sums of g' (g' = g * [mask > 0], or g) in one
    dispatch, for layers of at most ``NARROW_MAX_OUTPUTS`` outputs and in_features a multiple
    of 64; False, with nothing done, if it does not fit. The caller checked float4_ready.
    ``cross_entropy``: g is the layer's output (the logits) and g' the gradient of the mean
    cross-entropy that read them, made in the kernel and added into the logits' gradient
    buffer too; the buffers ``z``, ``labels``, ``lse`` (its row statistics), ``gl`` (the loss's
    upstream gradient) and ``dz``, which must hold zeros (matmul.slang's CE)."""
    batch, n_out = g.shape
    n_in = x.shape[1]
    if not narrow_fits(batch, n_in, n_out, g.device):
        return False
    kernels = g.device.kernels
    shape = ("narrow", batch, n_in, n_out, mask is not None, cross_entropy is not None)
    fixed = sizes_fixed(kernels, shape)  # else the batch is a uniform (one kernel for all)
    kernel = kernels.get(
        "ops/matmul.slang",
        "linear_bwd_narrow",
        NI=n_in,
        NO=n_out,
        TG=32,
        MASK=int(mask is not None),
        CE=int(cross_entropy is not None),
        HAS_DX=int(dx is not None),
        HAS_DB=int(db is not None),
        W64=load_words(kernels, "linear_bwd_narrow"),
        **({"FIXED_B": batch} if fixed else {}),
    )
    # absent gradients bind a buffer of the right kind that the kernel never touches
    dx_buffer = (dx if dx is not None else dw).buffer
    dw_buffer = dw.buffer
    buffers = list(cross_entropy.items()) if cross_entropy is not None else [("g", g.buffer)]
    buffers += [
        ("x", x.buffer),
        ("w", w.buffer),
        ("dx", dx_buffer),
        ("dx_in", dx_buffer),
        ("dw", dw_buffer),
        ("dw_in", dw_buffer),
        ("db", (db if db is not None else g).buffer),
    ]
    if mask is not None:
        buffers.append(("mask", mask.buffer))
    scalars = [("beta", 1.0)] + ([] if fixed else [("B", batch)])
    scalars += [("ce_rows", batch)] if cross_entropy is not None else []  # (a uniform: s51)
    kernels.dispatch_split(kernel, n_in // 8, buffers, scalars)
    for t in (dx, dw, db):
        if t is not None:
            t.storage.wrote("linear_bwd_narrow")
    return True


def product(
    kind: str,
    a: Tensor,
    b: Tensor,
    shape: tuple[int, int],
    bias: Tensor | None = None,
    relu: bool = False,
) -> Tensor:
    """C = a (x) b per ``kind`` (mm_nn, mm_nt, mm_tn), plus ``bias`` per column and then
    max(C, 0) with ``relu`` (mm_nt)."""
    out = empty(shape, device=a.device)
    if fast_product(kind, a, b, out, 0.0, bias, relu=relu):
        return out
    getattr(library(a.device), kind)(spy.grid(shape), a.detach(), b.detach(), out)
    if bias is not None:
        library(a.device).add_bias(spy.grid(shape), out, bias.detach())
    return library(a.device).op_relu(out, _result="tensor") if relu else out


# Float4s per thread of the elementwise kernels (relu4, relu_bwd_acc4): on lavapipe four cost
# about 2/3 of the CPU time of one at 10M elements (bench_train.py's relu line).
ELEMENTWISE_CHUNK = 4  # lavapipe's; kernels.chunk is 1 on a GPU


def elementwise_kernel(
    name: str, count_of: Tensor, kernel_file: str = "ops/elementwise.slang", **buffers: Tensor
) -> None:
    """Run the float4 kernel ``name`` over ``count_of``'s elements with ``buffers`` bound,
    ``kernels.chunk`` float4s per thread (``ELEMENTWISE_CHUNK`` on lavapipe, 1 on a GPU)."""
    count = -(-count_of.numel // 4)
    kernels = count_of.device.kernels
    kernels.dispatch(
        kernels.get(kernel_file, name, CHUNK=kernels.chunk),
        -(-count // kernels.chunk),
        count=count,
        **{k: t.buffer for k, t in buffers.items()},
    )


def relu_masked(g: Tensor, y: Tensor) -> Tensor:
    """g * [not y <= 0] as a new tensor (the relu backward, for the unfused paths): 0 at 0,
    the upstream gradient at NaN, as ops.relu, the fused kernels and PyTorch."""
    if float4_ready(g, y):
        gz = zeros(g.shape, device=g.device)
        elementwise_kernel("relu_bwd_acc4", y, x=y, g=g, dx=gz, dx_in=gz)
        return gz
    return tensor(np.where(y.numpy() <= 0, 0.0, g.numpy()).astype(np.float32), device=g.device)
