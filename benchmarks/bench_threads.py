"""Lavapipe's threading measured both ways in one run: compute inline (``LP_NUM_THREADS=0``,
pydiff's default on at most 2 CPUs) against lavapipe's pool (``LP_NUM_THREADS=N``), for
small work (an eager MLP training step, a 16-element call) and large (AdamW over 10M
parameters, the polynomial forward + backward at 2^24, lavapipe's copy kernel), with AdamW's
and the copy's share of NumPy's copy bandwidth side by side.

python benchmarks/bench_threads.py [--runs 3] [--pool 2] [--params 10000000] [--rounds 7]

Lavapipe reads LP_NUM_THREADS when a device opens, so each mode runs in a child process of
its own (``--child``); the modes alternate, ``--runs`` times each, and the table gives each
figure's median over the runs (wall time per call, and the process's CPU time: lavapipe's
workers included). NumPy's copy reference is the faster of 1 and N threads (one slice
each), taken in every child; the ratios "by CPU time" divide by NumPy's one-thread copy in
process CPU time, steadier where other jobs share the cores (pooled, they count both
workers: the work done, not the speed). docs/benchmarks-history.md, twenty-third session.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(fn, rounds: int, inner: int) -> tuple[float, float]:
    """(wall, process CPU) median seconds per call over ``rounds`` rounds of ``inner`` calls."""
    fn()
    walls, cpus = [], []
    for _ in range(rounds):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(inner):
            fn()
        walls.append((time.perf_counter() - t0) / inner)
        cpus.append((time.process_time() - c0) / inner)
    return statistics.median(walls), statistics.median(cpus)


def child(args) -> dict:
    import numpy as np

    sys.path.insert(0, str(HERE))
    import pydiff
    from pydiff import generated, optim
    from pydiff.module import library
    from pydiff.products import elementwise_kernel

    from bench_train import parallel_copy
    from mlp_step import make_mlp_step

    dev = pydiff.default_device()

    def sync():  # submit pydiff's queued dispatches, then wait for the device
        dev.flush()
        dev.native.wait_for_idle()

    rng = np.random.default_rng(0)
    out: dict = {"adapter": dev.adapter_name, "LP_NUM_THREADS": os.environ.get("LP_NUM_THREADS")}
    r = args.rounds

    # small work: an eager training step (waited for), a 16-element forward call
    xb = pydiff.tensor(rng.standard_normal((256, 64)).astype(np.float32))
    yb = pydiff.tensor(rng.integers(0, 10, 256).astype(np.int32))
    _, step = make_mlp_step(xb, yb)
    out["MLP step 256x64x64x10, eager"] = timed(lambda: (step(), sync()), r, 20)
    m = pydiff.load_module(HERE.parent / "samples" / "polynomial.slang", device=dev)
    x16 = pydiff.tensor(rng.standard_normal(16).astype(np.float32))
    y16 = pydiff.empty((16,), device=dev)
    out["16-element call (forward)"] = timed(
        lambda: (m.polynomial(2.0, 8.0, -1.0, x16, _result=y16), sync()), r, 200
    )

    # large work
    n = 1 << 24
    x = pydiff.tensor(rng.standard_normal(n).astype(np.float32), requires_grad=True)
    up = pydiff.tensor(np.ones(n, np.float32))
    y = pydiff.empty((n,), device=dev)
    args4 = [2.0, 8.0, -1.0, x]

    def poly():
        generated.forward(m.polynomial, args4, (n,), out=y)
        generated.backward(m.polynomial, args4, up, {3: x.grad_out})
        sync()

    out["polynomial 2^24, forward + backward"] = timed(poly, r, 1)
    k = args.params
    p = pydiff.tensor(rng.standard_normal(k).astype(np.float32), requires_grad=True)
    p.grad.copy_from_numpy(rng.standard_normal(k).astype(np.float32))
    adam = optim.AdamW([p], lr=1e-3, weight_decay=0.01)
    xa = pydiff.tensor(rng.standard_normal(k).astype(np.float32))
    xb = pydiff.tensor(rng.standard_normal(k).astype(np.float32))
    lib = library(dev)
    dst = pydiff.tensor(np.zeros(k, np.float32))
    src_np, dst_np = np.ones(k, np.float32), np.empty(k, np.float32)
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(2)
    large = {
        "AdamW 10M step": (lambda: (adam.step(), sync()), 28),
        "mul a * b (generated kernel) 10M": (
            lambda: (lib.op_mul(xa, xb, _result=dst), sync()),
            12,
        ),
        "copy4 kernel 10M": (lambda: (elementwise_kernel("copy4", xa, x=xa, y=dst), sync()), 8),
        "NumPy copy 1 thread": (lambda: np.copyto(dst_np, src_np), 8),
        "NumPy copy 2 threads": (lambda: parallel_copy(dst_np, src_np, 2, pool), 8),
    }
    for fn, _ in large.values():
        fn()
    times: dict = {name: [] for name in large}
    for _ in range(r):  # alternating rounds
        for name, (fn, _) in large.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    for name, t in times.items():
        out[name] = (statistics.median(a for a, _ in t), statistics.median(b for _, b in t))
    gbs = {name: nbytes * k / out[name][0] for name, (_, nbytes) in large.items()}
    copy = max(gbs["NumPy copy 1 thread"], gbs["NumPy copy 2 threads"])
    out["AdamW of the copy bandwidth"] = gbs["AdamW 10M step"] / copy
    out["mul of the copy bandwidth"] = gbs["mul a * b (generated kernel) 10M"] / copy
    out["copy4 of the copy bandwidth"] = gbs["copy4 kernel 10M"] / copy
    # The same by process CPU time against NumPy's one-thread copy: steadier where other jobs
    # share the cores (with the pool it counts both workers: work, not speed)
    cpu = {name: nbytes * k / out[name][1] for name, (_, nbytes) in large.items()}
    for name, label in (("AdamW 10M step", "AdamW"), ("copy4 kernel 10M", "copy4")):
        out[f"{label} of the copy bandwidth, by CPU time"] = cpu[name] / cpu["NumPy copy 1 thread"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="child processes per mode, alternating")
    ap.add_argument("--pool", type=int, default=2, help="LP_NUM_THREADS of the pooled mode")
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    modes = {"inline (LP_NUM_THREADS=0)": "0", f"pool (LP_NUM_THREADS={args.pool})": str(args.pool)}
    results: dict = {mode: [] for mode in modes}
    cmd = [sys.executable, __file__, "--child", "--params", str(args.params)]
    cmd += ["--rounds", str(args.rounds)]
    for _ in range(args.runs):
        for mode, value in modes.items():
            env = {**os.environ, "LP_NUM_THREADS": value, "OPENBLAS_NUM_THREADS": "1"}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = results[next(iter(modes))][0]
    print(f"device: {first['adapter']}; {args.runs} alternating runs per mode, medians")
    names = [k for k in first if k not in ("adapter", "LP_NUM_THREADS")]
    head = " | ".join(f"{mode:>34}" for mode in modes)
    print(f"{'figure':40} | {head}")
    for name in names:
        cells = []
        for mode in modes:
            vals = [run[name] for run in results[mode]]
            if isinstance(vals[0], list):
                wall = statistics.median(v[0] for v in vals) * 1e3
                cpu = statistics.median(v[1] for v in vals) * 1e3
                cells.append(f"{wall:9.3f} ms wall {cpu:9.3f} ms CPU")
            else:
                cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})")
        print(f"{name:40} | " + " | ".join(f"{c:>34}" for c in cells))


if __name__ == "__main__":
    main()
