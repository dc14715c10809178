"""pydiff call / .bwds against raw SlangPy on the same kernel, plus NumPy/PyTorch on the CPU.

    python benchmarks/bench_core.py            # or: make bench
    python benchmarks/bench_core.py --large 20 # 2^20 elements instead of 2^24

Prints per-call overhead (16 elements: alternating rounds of calls of pydiff and of raw
SlangPy, medians of wall and of process CPU time) and a large polynomial forward+backward,
with ratios. Timings only; the tests never assert on speed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import slangpy as spy

import pydiff

import statistics
import time

from timing import best_of, describe

SOURCE = Path(__file__).resolve().parent.parent / "samples" / "polynomial.slang"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", type=int, default=24, help="log2 of the large case's size")
    ap.add_argument("--calls", type=int, default=10000, help="per-call cases: calls in all")
    ap.add_argument("--rounds", type=int, default=20, help="per-call cases: alternating rounds")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    dev = pydiff.create_device(args.device)
    m = pydiff.load_module(SOURCE, device=dev)
    raw = spy.Module.load_from_file(dev.native, str(SOURCE))
    print(f"device: {describe(dev)}")
    rows = []

    def sync():
        dev.native.wait_for_idle()

    # --- per-call overhead ------------------------------------------------------------------
    n = 16
    xs = np.linspace(-1, 1, n).astype(np.float32)
    px = pydiff.tensor(xs, device=dev, requires_grad=True)
    py = pydiff.zeros((n,), device=dev).with_grads(ones=True)
    rx = spy.Tensor.from_numpy(dev.native, xs).with_grads(zero=True)
    ry = spy.Tensor.zeros(dev.native, (n,), "float").with_grads(zero=True)
    ry.grad.copy_from_numpy(np.ones(n, np.float32))

    calls = {
        "call p": lambda: m.polynomial(2.0, 8.0, -1.0, px, _result=py),
        "call r": lambda: raw.polynomial(2.0, 8.0, -1.0, rx, _result=ry),
        "bwds p": lambda: m.polynomial.bwds(2.0, 8.0, -1.0, px, _result=py),
        "bwds r": lambda: raw.polynomial.bwds(2.0, 8.0, -1.0, rx, _result=ry),
    }
    # Alternating rounds (the machine's speed drifts): medians of wall time and of the
    # process's CPU time (lavapipe's threads included), which other processes disturb less.
    wall: dict = {k: [] for k in calls}
    cpu: dict = {k: [] for k in calls}
    per_round = max(1, args.calls // args.rounds)
    for f in calls.values():
        for _ in range(50):
            f()
    sync()
    for _ in range(args.rounds):
        for name, f in calls.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(per_round):
                f()
            sync()
            wall[name].append((time.perf_counter() - t0) / per_round)
            cpu[name].append((time.process_time() - c0) / per_round)
    med = {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in calls}
    for case in ("call", "bwds"):
        (pw, pc), (rw, rc) = med[f"{case} p"], med[f"{case} r"]
        rows.append((f"{case}, 16 elements", pw * 1e6, rw * 1e6, "us"))
        rows.append((f"{case}, 16, CPU time", pc * 1e6, rc * 1e6, "us"))

    # --- large forward + backward -------------------------------------------------------------
    big = 1 << args.large
    xb = np.random.default_rng(0).standard_normal(big).astype(np.float32)
    pxb = pydiff.tensor(xb, device=dev, requires_grad=True)
    pyb = pydiff.zeros((big,), device=dev).with_grads(ones=True)
    rxb = spy.Tensor.from_numpy(dev.native, xb).with_grads(zero=True)
    ryb = spy.Tensor.zeros(dev.native, (big,), "float").with_grads(zero=True)
    ryb.grad.copy_from_numpy(np.ones(big, np.float32))

    def pydiff_fb():
        m.polynomial(2.0, 8.0, -1.0, pxb, _result=pyb)
        m.polynomial.bwds(2.0, 8.0, -1.0, pxb, _result=pyb)
        sync()

    def raw_fb():
        raw.polynomial(2.0, 8.0, -1.0, rxb, _result=ryb)
        raw.polynomial.bwds(2.0, 8.0, -1.0, rxb, _result=ryb)
        sync()

    def numpy_fb():
        y = 2.0 * xb * xb + 8.0 * xb - 1.0
        g = 4.0 * xb + 8.0
        return y, g

    t_p, t_r, t_np = best_of(pydiff_fb, 3), best_of(raw_fb, 3), best_of(numpy_fb, 3)
    rows.append((f"fwd+bwd 2^{args.large}", t_p * 1e3, t_r * 1e3, "ms"))
    others = [("NumPy (closed-form grad)", t_np)]
    try:
        import torch

        xt = torch.from_numpy(xb).requires_grad_(True)

        def torch_fb():
            xt.grad = None
            y = 2.0 * xt * xt + 8.0 * xt - 1.0
            y.backward(torch.ones_like(y))

        others.append(("PyTorch-CPU eager autograd", best_of(torch_fb, 3)))
    except ImportError:
        others.append(("PyTorch-CPU (not installed)", float("nan")))

    print(f"\n{'case':<22}{'pydiff':>12}{'SlangPy':>12}{'pydiff/SlangPy':>16}")
    for name, p, r, unit in rows:
        print(f"{name:<22}{p:>10.1f}{unit:>2}{r:>10.1f}{unit:>2}{p / r:>15.2f}x")
    print(f"\nfwd+bwd 2^{args.large}, others (pydiff time / theirs):")
    for name, t in others:
        print(f"  {name:<30}{t * 1e3:>9.1f} ms   pydiff/them = {t_p / t:.2f}x")


if __name__ == "__main__":
    main()
