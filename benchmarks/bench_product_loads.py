"""A/B of the matrix products' float4 reads on lavapipe (matmul.slang's W64): the captured MLP
step's product dispatches, once per PYDIFF_MM_W64 setting, timed in one process, the settings
interleaved round by round (process CPU time: lavapipe executes in this process).

python benchmarks/bench_product_loads.py --variants "" "mm_nt=2" [--reps 100 --rounds 21]
    [--shape 256 64 64 10]

Each variant is a PYDIFF_MM_W64 value (``entry=bits`` pairs: bit 1 A, 2 B, 4 C read back);
the plans are dropped between variants so each captures its own kernels. It reads the
capture's command list and the device's kernel cache (private to pydiff: a measuring tool).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import pydiff

from mlp_step import make_mlp_step
from timing import describe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["", "mm_nt=3"])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument(
        "--shape",
        type=int,
        nargs=4,
        default=[256, 64, 64, 10],
        help="batch, inputs, hidden, classes of the MLP (the benchmarks' step)",
    )
    args = ap.parse_args()
    dev = pydiff.default_device()
    native = dev.native
    rng = np.random.default_rng(0)
    batch, n_in, hidden, classes = args.shape
    xb = pydiff.tensor(rng.standard_normal((batch, n_in)).astype(np.float32))
    yb = pydiff.tensor(rng.integers(0, classes, batch).astype(np.int32))

    captures = []
    for v in args.variants:
        os.environ["PYDIFF_MM_W64"] = v
        dev.kernels.plans.clear()
        _, step = make_mlp_step(xb, yb, widths=(n_in, hidden, classes))
        step()
        captures.append(pydiff.capture(step))
    names = {id(k): f"{key[1]}" for key, k in dev.kernels._kernels.items()}

    def run(command, reps):
        encoder = native.create_command_encoder()
        for _ in range(reps):
            _, kernel, root, _, threads, _, _ = command
            compute = encoder.begin_compute_pass()
            compute.bind_pipeline(kernel.pipeline, root)
            compute.dispatch([threads, 1, 1])
            compute.end()
        native.submit_command_buffer(encoder.finish())
        native.wait_for_idle()

    def products(c):
        return [
            x
            for x in c._commands
            if x[0] == "dispatch"
            and "matmul" in str([key for key, k in dev.kernels._kernels.items() if k is x[1]])
        ]

    per = [products(c) for c in captures]
    times = [[[] for _ in p] for p in per]
    for _ in range(args.rounds):
        for vi, p in enumerate(per):
            for ci, command in enumerate(p):
                run(command, 2)
                t0 = time.process_time()
                run(command, args.reps)
                times[vi][ci].append((time.process_time() - t0) / args.reps)
    print(f"device: {describe(dev)}; load {os.getloadavg()[0]:.2f}")
    for vi, v in enumerate(args.variants):
        print(f"  variant {vi}: PYDIFF_MM_W64={v!r}")
    print(f"process CPU per dispatch, median (quartiles, min) of {args.rounds} x {args.reps}:")
    for ci, command in enumerate(per[0]):
        row = f"  {names.get(id(command[1]), '?'):18s} ({command[4]:4d} threads)"
        for vi, v in enumerate(args.variants):
            q = statistics.quantiles(times[vi][ci], n=4)
            med, low = statistics.median(times[vi][ci]) * 1e6, min(times[vi][ci]) * 1e6
            row += f" | {vi}: {med:6.1f} ({q[0] * 1e6:.0f}-{q[2] * 1e6:.0f}, min {low:.0f})"
        print(row)


if __name__ == "__main__":
    main()
