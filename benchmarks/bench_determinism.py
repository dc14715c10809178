"""Gradient of a broadcast parameter over 2^24 elements: SlangPy's paths against pydiff's.

    python benchmarks/bench_determinism.py [--large 24] [--repeats 5]

The parameter ``a`` of polynomial(a, b, c, x) is a (1,)-tensor, so every call element adds
into its one gradient element. Rows: SlangPy's atomic path (one float atomic per element,
all on one address), SlangPy's ``load_uniform`` (a wave sum, then one atomic per wave),
pydiff by default and in deterministic mode (full-shape gradient, fixed-order compensated
sum), and pydiff's FwdDiffTensor (int64 fixed-point atomics). For each: best time, relative
error against a float64 NumPy sum, and how many distinct bit patterns the repeats gave.
The tests never assert on speed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

import pydiff
from timing import describe

ROOT = Path(__file__).resolve().parent.parent

UNIFORM_SOURCE = """
import slangpy;
[Differentiable]
float polynomial_uniform(DiffTensor<float, 1> a, float b, float c, float x)
{
    int zero[1] = {0};
    return a.load_uniform(zero) * x * x + b * x + c;
}
"""

FIXED_SOURCE = """
import pydiff;
[Differentiable]
float polynomial_fixed(FwdDiffTensor<1> a, float b, float c, float x)
{
    return a.load({0}) * x * x + b * x + c;
}
"""


def measure(run, read, sync, repeats: int) -> tuple[float, float, set]:
    """(best seconds, last value, distinct bit patterns) of ``run`` then ``read``."""
    run()
    sync()
    best, bits, value = float("inf"), set(), 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t0)
        got = read()
        bits.add(got.tobytes())
        value = float(got.reshape(-1)[0])
    return best, value, bits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", type=int, default=24, help="log2 of the number of elements")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    # Races between threads are what this benchmark shows: on lavapipe keep its worker pool
    # (pydiff would run compute inline on a 2-CPU machine, one thread, and no races).
    os.environ.setdefault("LP_NUM_THREADS", str(os.cpu_count() or 2))
    dev = pydiff.default_device()
    n = 1 << args.large
    m = pydiff.load_module(ROOT / "samples" / "polynomial.slang", device=dev)
    uniform = pydiff.load_module_from_source("bench_uniform", UNIFORM_SOURCE, device=dev)
    fixed = pydiff.load_module_from_source("bench_fixed", FIXED_SOURCE, device=dev)
    xs = np.random.default_rng(0).uniform(0.5, 1.0, n).astype(np.float32)
    want = float(np.sum(xs.astype(np.float64) ** 2))
    x = pydiff.tensor(xs, device=dev)
    y = pydiff.empty((n,), device=dev).with_grads(ones=True)
    a = pydiff.tensor([2.0], device=dev, requires_grad=True)
    native_a = a.native.with_grads()
    native_y = y.bind(True)

    def sync():
        dev.native.wait_for_idle()

    def raw(fn):
        def run():
            native_a.grad_out.clear()
            fn.bwds(native_a, 8.0, -1.0, x.native, _result=native_y)

        return run

    def pydiff_run(fn):
        def run():
            a.zero_grad()
            fn.bwds(a, 8.0, -1.0, x, _result=y)

        return run

    def deterministic_run():
        with pydiff.deterministic():
            pydiff_run(m.polynomial)()

    rows = [
        (
            "SlangPy atomic (1 address)",
            raw(m.polynomial.native),
            lambda: native_a.grad_out.to_numpy(),
        ),
        (
            "SlangPy load_uniform",
            raw(uniform.polynomial_uniform.native),
            lambda: native_a.grad_out.to_numpy(),
        ),
        ("pydiff default", pydiff_run(m.polynomial), lambda: a.grad.numpy()),
        ("pydiff deterministic", deterministic_run, lambda: a.grad.numpy()),
        (
            "pydiff FwdDiffTensor (int64)",
            pydiff_run(fixed.polynomial_fixed),
            lambda: a.grad.numpy(),
        ),
    ]
    print(
        f"device: {describe(dev)}; broadcast parameter over {n:,} elements, best of {args.repeats}"
    )
    print(f"{'path':30s} {'time':>9s} {'rel. error':>11s} {'bit patterns':>13s}")
    times = {}
    for name, run, read in rows:
        t, value, bits = measure(run, read, sync, args.repeats)
        times[name] = t
        print(
            f"{name:30s} {t * 1e3:7.1f} ms {abs(value - want) / want:11.1e} "
            f"{len(bits):>6d} of {args.repeats}"
        )
    det, atomic, default = (
        times["pydiff deterministic"],
        times["SlangPy atomic (1 address)"],
        times["pydiff default"],
    )
    print(
        f"deterministic / SlangPy atomic = {det / atomic:.2f}x (target <= 1.0); "
        f"deterministic / pydiff default = {det / default:.2f}x (target <= 1.5)"
    )


if __name__ == "__main__":
    main()
