"""Generated kernels' newer cases against pydiff's SlangPy path, in one process: a ``.bwds``
with a broadcast (1,) coefficient tensor wanting a gradient, a two-call tape forward +
backward, and ``.fwds`` (value + JVP), on samples/polynomial.slang.

    python benchmarks/bench_generated_paths.py [--sizes 20 22] [--rounds 7]

Each case runs both paths in alternating rounds (``PYDIFF_GENERATED=1`` / ``0``, everything
else equal) and reports medians of wall time and of process CPU time (``time.process_time``:
lavapipe's threads included, less sensitive to other jobs on the machine). Prints ratios; the
tests never assert on speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

import pydiff
from pydiff import generated

from timing import describe

SOURCE = Path(__file__).resolve().parent.parent / "samples" / "polynomial.slang"


def cases(dev, m, n: int) -> dict:
    rng = np.random.default_rng(0)
    xs = rng.standard_normal(n).astype(np.float32)
    x = pydiff.tensor(xs, device=dev, requires_grad=True)
    a = pydiff.tensor([2.0], device=dev, requires_grad=True)
    up = pydiff.tensor(np.ones(n, np.float32), device=dev)
    ys = pydiff.zeros((n,), device=dev).with_grads(grad_in=up)
    xt = pydiff.tensor(xs, device=dev).with_tangent(np.ones(n, np.float32))
    ones = np.ones(n)
    fn = m.polynomial

    def sync():
        dev.native.wait_for_idle()

    def broadcast_bwds():
        fn.bwds(a, 8.0, -1.0, x, _result=ys)
        sync()

    def tape():
        with pydiff.Tape() as t:
            h = fn(a, 8.0, -1.0, x, _result="tensor")
            y = fn(1.0, 0.5, 0.0, h, _result="tensor")
        t.backward(y, grad=ones)
        sync()

    def fwds():
        fn.fwds(2.0, (8.0, 1.0), -1.0, xt)
        sync()

    return {"bwds, broadcast a": broadcast_bwds, "tape fwd+bwd": tape, "fwds": fwds}


def timed(f, inner: int) -> tuple[float, float]:
    f()  # caches and threads back in shape
    w, c = time.perf_counter(), time.process_time()
    for _ in range(inner):
        f()
    return (time.perf_counter() - w) / inner, (time.process_time() - c) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22], help="log2 of elements")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dev = pydiff.default_device()
    m = pydiff.load_module(SOURCE, device=dev)
    print(f"device: {describe(dev)}")
    print(f"{'case':<20}{'size':<6}{'path':<10}{'wall':>10}{'CPU':>10}{'SlangPy/gen (CPU)':>20}")
    for log2 in args.sizes:
        n = 1 << log2
        inner = max(1, (1 << 22) // n)
        for name, f in cases(dev, m, n).items():
            got: dict[str, list] = {"1": [], "0": []}
            for _ in range(args.rounds):
                for path in got:
                    os.environ["PYDIFF_GENERATED"] = path
                    time.sleep(0.1)
                    got[path].append(timed(f, inner))
            os.environ.pop("PYDIFF_GENERATED")
            med = {p: [statistics.median(t[i] for t in v) for i in (0, 1)] for p, v in got.items()}
            for path, label in (("1", "generated"), ("0", "SlangPy")):
                wall, cpu = med[path]
                ratio = f"{med['0'][1] / med['1'][1]:.2f}x" if path == "0" else ""
                print(
                    f"{name:<20}{'2^' + str(log2):<6}{label:<10}{wall * 1e3:>8.1f}ms"
                    f"{cpu * 1e3:>8.1f}ms{ratio:>20}"
                )
    print(f"paths taken: {generated.stats()}")


if __name__ == "__main__":
    main()
