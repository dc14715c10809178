"""mm_tn (C = A^T B, a weight gradient) with and without the split-K kernel, against
torch.matmul on the same device type: µs per product.

    python benchmarks/bench_products.py [--device cuda] [--repeats 200] [--rounds 5]

Shapes: K = 256 (the MLP step's batch) x M x N = 64 x 64 (its hidden dW) and 10 x 64 (its
head's dW). "GPU" is the time between two timestamps written around ``--repeats`` products
in one command buffer (the kernels back to back, no host time); "wall" is the host's time for
the same calls, synchronised once at the end (recording included). The split kernel is taken
on a GPU's kernel shapes only (``kernels.gpu``; ``PYDIFF_KERNEL_SHAPES=gpu`` on lavapipe).
Timings only; the tests never assert on speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import slangpy as spy

import pydiff
from pydiff import product_kernels, products

from timing import describe

SHAPES = [(256, 64, 64), (256, 10, 64)]  # (K, M, N)


def time_products(dev, k, m, n, repeats: int, rounds: int) -> tuple[float, float]:
    """(GPU, wall) µs per mm_tn product, medians over rounds."""
    rng = np.random.default_rng(0)
    a = pydiff.tensor(rng.standard_normal((k, m)).astype(np.float32), device=dev)
    b = pydiff.tensor(rng.standard_normal((k, n)).astype(np.float32), device=dev)
    c = pydiff.zeros((m, n), device=dev)
    queue, native = dev.kernels.queue, dev.native
    try:  # (a backend without timestamp queries: wall times only)
        pool = native.create_query_pool(type=spy.QueryType.timestamp, count=2)
        probe = native.create_command_encoder()
        probe.write_timestamp(pool, 0)
        probe.write_timestamp(pool, 1)
        native.submit_command_buffer(probe.finish())
        native.wait_for_idle()
        pool.get_timestamp_results(0, 2)
        pool.reset()
    except Exception as exc:
        print(f"  (no GPU timestamps: {type(exc).__name__}: {exc})")
        pool = None
    gpu, wall = [], []
    for _ in range(rounds + 1):  # (the first round compiles and warms up)
        native.wait_for_idle()
        t0 = time.perf_counter()
        token = queue.begin_batch()
        if pool is not None:
            queue.encoder().write_timestamp(pool, 0)
        for _ in range(repeats):
            assert products.fast_product("mm_tn", a, b, c, 1.0)
        if pool is not None:
            queue.encoder().write_timestamp(pool, 1)
        queue.flush()
        queue.end_batch(token)
        native.wait_for_idle()
        wall.append((time.perf_counter() - t0) / repeats)
        if pool is not None:
            ticks = pool.get_timestamp_results(0, 2)
            gpu.append((ticks[1] - ticks[0]) / native.info.timestamp_frequency / repeats)
            pool.reset()
    gpu_us = statistics.median(gpu[1:]) * 1e6 if gpu else 0.0
    return gpu_us, statistics.median(wall[1:]) * 1e6


def time_torch(torch, tdev: str, k, m, n, repeats: int, rounds: int) -> float:
    a = torch.randn(k, m, device=tdev)
    b = torch.randn(k, n, device=tdev)
    sync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
    times = []
    for _ in range(rounds + 1):
        sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a.T, b)
        sync()
        times.append((time.perf_counter() - t0) / repeats)
    return statistics.median(times[1:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", help="auto, vulkan, cuda, ...")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = pydiff.create_device(args.device)
    print(f"device: {describe(dev)}; GPU kernel shapes: {dev.kernels.gpu}")
    try:
        import torch
    except ImportError:
        torch = None
    tdev = (
        "cuda" if dev.type == "cuda" and torch is not None and torch.cuda.is_available() else "cpu"
    )
    max_blocks = product_kernels.SPLIT_K_MAX_BLOCKS
    print(f"{'K x M x N':<14}{'kernel':<14}{'GPU µs':>10}{'wall µs':>10}")
    for k, m, n in SHAPES:
        for split in (True, False):
            product_kernels.SPLIT_K_MAX_BLOCKS = max_blocks if split else 0
            dev.kernels.plans.clear()  # (plans are memoised without the split rule)
            taken = product_kernels.split_k("mm_tn", m, n, k, dev.kernels.gpu)
            name = f"split {taken}" if taken > 1 else "one thread"
            g, w = time_products(dev, k, m, n, args.repeats, args.rounds)
            gpu = f"{g:>10.2f}" if g >= 0.01 else f"{'n/a':>10}"  # (lavapipe: no timestamps)
            print(f"{k}x{m}x{n:<8}{name:<14}{gpu}{w:>10.2f}")
        product_kernels.SPLIT_K_MAX_BLOCKS = max_blocks
        if torch is not None:
            t = time_torch(torch, tdev, k, m, n, args.repeats, args.rounds)
            print(f"{k}x{m}x{n:<8}{'torch ' + tdev:<14}{'':>10}{t:>10.2f}")


if __name__ == "__main__":
    main()
