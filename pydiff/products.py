"""The specialised kernels behind pydiff's ops: register-blocked matrix products (fused bias,
relu and masks), a narrow linear layer's whole backward in one kernel, float4 elementwise
kernels, each dispatched directly through ``device.kernels``; ``product`` falls back to the
library's per-element SlangPy functions where the kernels do not fit (shapes, layouts,
backends).

    out = product("mm_nt", x, w, (batch, n_out), bias=b)     # x W^T + b
    fast_product("mm_tn", g, x, dw, beta=1.0)                 # dW += g^T x, if it fits
    linear_backward_narrow(g, x, w, dx, dw, db)               # all three, if it fits
"""

from __future__ import annotations

import functools
import os
from typing import Any

import slangpy as spy

from . import capturing, head_fusion
from .head_fusion import hold as hold_head
from .creation import empty, tensor, zeros
from .errors import PydiffError
from .module import library
from .tensor import Tensor, float4_ready

import numpy as np


def blocking(
    kind: str, m: int, n: int, k: int, accumulators: int | None = None
) -> tuple[int, int] | None:
    """Rows and columns of C per thread for the fast product kernels, or None when the
    shapes do not fit them (B is read as float4 rows: mm_nt needs K % 4 == 0, the others
    N % 4 == 0). Blocks of up to 128 accumulators: on lavapipe, 8 x 16 blocks beat 8 x 8
    by 10-35% on a training step's products (each load feeds more multiply-adds); a GPU
    takes ``GPU_BLOCK_ACCUMULATORS`` (a 64 x 64 product in 16 x 8 blocks is 32 threads)."""
    return _blocking(kind, m, n, k, accumulators or BLOCK_ACCUMULATORS)


@functools.lru_cache(maxsize=1024)  # (a pure function of its numbers: each op asks again)
def _blocking(kind: str, m: int, n: int, k: int, accumulators: int) -> tuple[int, int] | None:
    small = accumulators < 64
    if kind == "mm_nt":
        if k % 4:
            return None
        widths = (4, 2, 1) if small else (16, 8, 4, 2, 1)
        cols = n if n <= (4 if small else 16) else next(c for c in widths if n % c == 0)
    else:
        if n % 4:
            return None
        cols = next(c for c in ((4,) if small else (16, 8, 4)) if n % c == 0)
    budget = accumulators // cols
    rows = next((r for r in (16, 8, 4) if m % r == 0 and r <= budget), None)
    if rows is None:  # e.g. 10 rows: 5 per thread rather than 2
        rows = next(r for r in range(min(16, budget, m), 0, -1) if m % r == 0)
    return rows, cols


BLOCK_ACCUMULATORS = 128
PLANS_MAX = 4096  # fast_product's memo (kernels.plans), emptied beyond
GPU_BLOCK_ACCUMULATORS = 8
# The product kernels take their sizes as uniforms: one kernel serves every batch size (a
# kernel per size cost a compile and 1.5-2.5 MB). A shape used HOT_SHAPE_USES times gets
# kernels of its own with the sizes as constants, for at most FIXED_SHAPES_MAX shapes per
# device: a training step's products ran 60 us faster of a 0.41 ms captured MLP step
# (lavapipe; docs/benchmarks-history.md).
HOT_SHAPE_USES = 3
FIXED_SHAPES_MAX = 8
# Split-K A^T B (matmul.slang's mm_tn_split) on a GPU: a weight gradient's few output blocks
# each walking the whole batch left an H200 latency-bound (a 256 x 64 x 64 mm_tn: 119 us, 85%
# of a captured MLP step). Where the output has at most SPLIT_K_MAX_BLOCKS blocks (threads of
# the unsplit kernel), SPLIT_K_THREADS threads (a workgroup, a power of two) share each
# block's sum and add their parts in a fixed order. Whatever K (the batch): a rule on K would
# compile a second kernel for a layer whose batch crosses it (one kernel serves every batch
# size, tests/test_memory.py), and a short K costs a GPU little either way.
# A relu layer's dW (mm_tn reading g through the relu's mask) as (x^T g')^T on lavapipe
# (_swapped): 178 -> 113 us of a 256 x 64 -> 64 layer's (twenty-second session). False: the
# direct form (measurements).
MASKED_SWAP = True
SPLIT_K_THREADS = 32
SPLIT_K_MAX_BLOCKS = 8192  # 0: never split


def split_k(kind: str, m: int, n: int, k: int, gpu: bool) -> int:
    """Threads sharing each output block's sum over K in ``fast_product``'s kernel: 1 (one
    thread per block), or ``SPLIT_K_THREADS`` for mm_tn on a GPU's shapes where the output
    has few blocks (``SPLIT_K_MAX_BLOCKS``), whatever K.

    >>> split_k("mm_tn", 64, 64, 256, gpu=True), split_k("mm_tn", 64, 64, 256, gpu=False)
    (32, 1)
    """
    if not gpu or kind != "mm_tn":
        return 1
    block = blocking(kind, m, n, k, GPU_BLOCK_ACCUMULATORS)
    if block is None:
        return 1
    blocks = (m // block[0]) * (n // block[1])
    if blocks > SPLIT_K_MAX_BLOCKS:
        return 1
    if SPLIT_K_THREADS < 2 or SPLIT_K_THREADS & (SPLIT_K_THREADS - 1):
        raise ValueError(
            f"pydiff.products.SPLIT_K_THREADS={SPLIT_K_THREADS}: the split kernel's tree "
            "reduction needs a power of two >= 2 (SPLIT_K_MAX_BLOCKS = 0 turns it off)"
        )
    return SPLIT_K_THREADS


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
        plan = _plan(kernels, *key[1:])
        if len(kernels.plans) >= PLANS_MAX:  # (shapes that never fit build no kernel)
            kernels.plans.clear()
        kernels.plans[key] = plan
    if not plan:
        return False
    _, kernel, threads, c_vec, swap, head = plan
    # (dispatch's bindings given apart: buffers, then numbers, in a fixed order per plan)
    c = out.buffer
    if swap:  # dW as (x^T g')^T: the mask on the shared side (see _swapped)
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


def _plan(
    kernels: Any,
    kind: str,
    m: int,
    n: int,
    k: int,
    bias: bool,
    relu: bool,
    mask: bool,
    db: bool,
    fixed: bool,
) -> tuple:
    """fast_product's kernel (its cache key and itself), thread count and C_VEC for these
    shapes and options; () when the kernels do not fit."""
    gpu = kernels.gpu
    block = blocking(kind, m, n, k, GPU_BLOCK_ACCUMULATORS if gpu else None)
    if block is None:
        return ()
    rows, cols = block
    a_vec = kind == "mm_nt" or (k % 4 == 0 if kind == "mm_nn" else (m % 4 == 0 and rows % 4 == 0))
    sizes = {"FIXED_M": m, "FIXED_K": k} if fixed else {}
    split = split_k(kind, m, n, k, gpu)
    if split > 1:  # one workgroup per block, C written as floats (no C_VEC)
        key, kernel = kernels.get_keyed(
            "ops/matmul.slang",
            "mm_tn_split",
            N=n,
            KU=1,
            RB=rows,
            CB=cols,
            SPLIT=split,
            A_VEC=int(a_vec),
            MASK=int(mask),
            HAS_DB=int(db),
            C_VEC=0,
            SHUF=0,
            SHUF_A=0,
            **sizes,
        )
        return key, kernel, (m // rows) * (n // cols) * split, False, False, None
    swapped = _swapped(kernels, kind, m, n, k, mask, db, sizes)
    if swapped:
        return swapped
    # Runs of 8 threads share B through subgroup shuffles (matmul.slang, SHUF) where their row
    # blocks fit: mm_nt loads B rows (cols % 8 == 0, or all on lavapipe: a 256 x 64 -> 10 head 34
    # -> 29 us), the others float4s of one row; mm_nn and mm_tn reading A as floats share A instead
    # (SHUF_A), in blocks of 16 (or all m below 16) x 8 where they fit (8 threads: 64 columns).
    shuf_a = not gpu and kind != "mm_nt" and not a_vec and (m % 16 == 0 or m < 16) and n % 64 == 0
    if shuf_a:
        rows, cols = min(m, 16), 8
    # C written as float4s (and read back through a typed view to add to it, beta = 1)
    c_vec = n % 4 == 0 and cols % 4 == 0
    shuf = (
        not shuf_a
        and (m // rows) % 8 == 0
        and (cols % 8 == 0 or cols == n and not gpu if kind == "mm_nt" else 8 % (cols // 4) == 0)
    )
    # M and K are uniforms, not defines (FIXED_M/FIXED_K for hot shapes): a kernel per batch
    # size cost a compile and 1.5-2.5 MB; at compile time only RB divides M, KU divides K.
    ku = {} if kind == "mm_nt" else {"KU": 4 if k % 4 == 0 else (2 if k % 2 == 0 else 1)}
    defines = dict(
        N=n,
        **ku,
        RB=rows,
        CB=cols,
        TG=32,
        HAS_BIAS=int(bias),
        A_VEC=int(a_vec),
        RELU=int(relu),
        MASK=int(mask),
        HAS_DB=int(db),
        C_VEC=int(c_vec),
        SHUF=int(shuf),
        SHUF_A=int(shuf_a),
        W64=load_words(kernels, kind, n, cols),
        **sizes,
    )
    key, kernel = kernels.get_keyed("ops/matmul.slang", kind, **defines)
    head = head_fusion.head_plan(kind, m, n, rows, cols, fixed, gpu, defines)
    return key, kernel, (m // rows) * (n // cols), c_vec, False, head


# Which float4 inputs a product reads as two 64-bit words (matmul.slang's W64: bit 1 A, 2 B, 4
# the C added to), lavapipe only (GPUs keep float4 loads). Measured (benchmarks-history.md, mm43):
# only mm_nt's B read by all threads alike (cols == n, n % 8: no shuffle) gained (the MLP's 64 ->
# 10 layer 48-56 -> 32 us); the rest as fast or slower. PYDIFF_MM_W64=mm_nt=2,... (docs/devices).
def load_words(kernels: Any, entry: str, n: int = 0, cols: int = 0) -> int:
    if not kernels.paired_stores:
        return 0
    forced = os.environ.get("PYDIFF_MM_W64")
    if forced is None:
        return 2 if entry == "mm_nt" and cols == n and n % 8 else 0
    try:
        return int(dict(x.split("=") for x in forced.split(",") if x).get(entry, 0)) & 7
    except ValueError:
        raise PydiffError(
            f"PYDIFF_MM_W64={forced!r}: expected entry=bits, e.g. 'mm_nt=2'"
        ) from None


def _swapped(kernels: Any, kind: str, m: int, n: int, k: int, mask: bool, db: bool, sizes: dict):
    """A masked A^T B (a relu layer's dW = g'^T x, g' = g * [mask > 0]) computed as (x^T g')^T,
    lavapipe only: runs of 8 threads share B's rows (SHUF), so the mask read with g' is one
    load per thread there, where it doubled A's per-thread gathers (a 256 x 64 -> 64 layer's
    dW + db: 178 -> 113 us of CPU). The same sums in the same order, each product's factors swapped:
    the same bits. () where the shapes do not fit it."""
    if kind != "mm_tn" or not mask or kernels.gpu or not MASKED_SWAP or m % 4 or n % 4:
        return ()
    block = blocking(kind, n, m, k)
    if block is None:
        return ()
    rows, cols = block
    if rows % 4 or cols % 4 or (n // rows) % 8 or 8 % (cols // 4):
        return ()
    key, kernel = kernels.get_keyed(
        "ops/matmul.slang",
        kind,
        N=m,
        KU=4 if k % 4 == 0 else (2 if k % 2 == 0 else 1),
        RB=rows,
        CB=cols,
        TG=32,
        HAS_BIAS=0,
        A_VEC=1,
        RELU=0,
        MASK=0,
        MASK_B=1,
        HAS_DB=int(db),
        DB_B=1,
        C_VEC=1,
        C_T=1,
        SHUF=1,
        SHUF_A=0,
        W64=load_words(kernels, "mm_tn_swapped"),
        **({"FIXED_M": n, "FIXED_K": k} if sizes else {}),
    )
    return key, kernel, (n // rows) * (m // cols), True, True, None


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
