"""Which product kernel fits a shape: rows and columns of C per thread (``blocking``),
split-K on a GPU (``split_k``), subgroup shuffles, the swapped form of a masked A^T B on
lavapipe, inputs read as 64-bit words (``load_words``), and from them the kernel with its
defines and thread count (``product_plan``). Choices only, from shapes and the device's kind;
``products`` dispatches the kernel chosen.

    blocking("mm_nt", 256, 64, 64)                  # (rows, cols) per thread, or None
    product_plan(dev.kernels, "mm_tn", 64, 64, 256, False, False, True, True, False)
"""

from __future__ import annotations

import functools
import os
from typing import Any

from . import head_fusion
from .errors import PydiffError


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
GPU_BLOCK_ACCUMULATORS = 8
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
    """Threads sharing each output block's sum over K in ``products.fast_product``'s kernel:
    1 (one thread per block), or ``SPLIT_K_THREADS`` for mm_tn on a GPU's shapes where the
    output has few blocks (``SPLIT_K_MAX_BLOCKS``), whatever K.

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
            f"pydiff.product_kernels.SPLIT_K_THREADS={SPLIT_K_THREADS}: the split kernel's tree "
            "reduction needs a power of two >= 2 (SPLIT_K_MAX_BLOCKS = 0 turns it off)"
        )
    return SPLIT_K_THREADS


def product_plan(
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
    """``products.fast_product``'s plan for these shapes and options: (kernel key, kernel,
    threads, C_VEC, swapped, head-fusion plan); () when the kernels do not fit."""
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
