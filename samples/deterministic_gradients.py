"""Same gradient, same bits: a broadcast parameter's gradient with SlangPy and with pydiff.

    python samples/deterministic_gradients.py [--log2 20] [--runs 10]

polynomial(a, b, c, x) with ``a`` one value shared by 2^20 elements of x: every element adds
into a's single gradient. SlangPy adds with float atomics on one address (a different sum,
bit for bit, on every run, and a large rounding error); pydiff gives each element its own
slot and sums them in a fixed order (the same bits every run, error ~1e-8), and its
deterministic mode also covers tensors passed twice and warns about what it cannot fix.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import slangpy as spy

import pydiff

SOURCE = Path(__file__).with_name("polynomial.slang")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2", type=int, default=20, help="log2 of the number of elements")
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    # Atomics race between threads. On a machine with two CPUs or fewer pydiff runs lavapipe
    # (Vulkan on the CPU) in one thread, where they would not race: keep its worker pool here.
    os.environ.setdefault("LP_NUM_THREADS", str(os.cpu_count() or 2))
    dev = pydiff.default_device()
    n = 1 << args.log2
    xs = np.random.default_rng(0).uniform(0.5, 1.0, n).astype(np.float32)
    exact = float(np.sum(xs.astype(np.float64) ** 2))  # d/da of sum(a x^2 + b x + c)

    raw = spy.Module.load_from_file(dev.native, str(SOURCE))
    x_raw = spy.Tensor.from_numpy(dev.native, xs)
    a_raw = spy.Tensor.zeros(dev.native, (1,), "float").with_grads()
    y_raw = spy.Tensor.zeros(dev.native, (n,), "float").with_grads()
    y_raw.grad.copy_from_numpy(np.ones(n, np.float32))

    m = pydiff.load_module(SOURCE)
    x = pydiff.tensor(xs)
    a = pydiff.tensor([0.0], requires_grad=True)
    y = pydiff.zeros((n,)).with_grads(ones=True)

    results = {"SlangPy (float atomics)": [], "pydiff": [], "pydiff, deterministic mode": []}
    for _ in range(args.runs):
        a_raw.grad.clear()
        raw.polynomial.bwds(a_raw, 8.0, -1.0, x_raw, _result=y_raw)
        results["SlangPy (float atomics)"].append(a_raw.grad.to_numpy()[0])
        a.zero_grad()
        m.polynomial.bwds(a, 8.0, -1.0, x, _result=y)
        results["pydiff"].append(a.grad.numpy()[0])
        a.zero_grad()
        with pydiff.deterministic():
            m.polynomial.bwds(a, 8.0, -1.0, x, _result=y)
        results["pydiff, deterministic mode"].append(a.grad.numpy()[0])

    print(f"d/da over {n:,} elements, {args.runs} runs; float64 reference {exact:.6f}")
    for name, values in results.items():
        patterns = len({np.float32(v).tobytes() for v in values})
        err = max(abs(float(v) - exact) / exact for v in values)
        print(f"  {name:28s} {patterns:2d} bit pattern(s), worst relative error {err:.1e}")


if __name__ == "__main__":
    main()
