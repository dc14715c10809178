"""The eager MLP step with and without the head's product and its cross-entropy in one kernel
(``pydiff.head_fusion.HOLD_HEADS`` flipped in alternate rounds of one process: the same
device, buffers and machine load for both), and the forward pair alone.

python benchmarks/bench_head_fusion.py [--rounds 60]

Per step: the calling thread's CPU and the process's (lavapipe's queue thread runs the
kernels), medians over the rounds of each side; each round 50 steps and one device wait.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pydiff
from pydiff import head_fusion, nn, ops

from mlp_step import make_batch, make_mlp_step


def alternate(run, rounds: int) -> dict[bool, tuple[float, float]]:
    """Medians of ``run()``'s (thread, process) microseconds with HOLD_HEADS True / False."""
    for _ in range(3):
        run()
    got: dict[bool, list] = {True: [], False: []}
    for r in range(rounds):
        head_fusion.HOLD_HEADS = r % 2 == 0
        got[head_fusion.HOLD_HEADS].append(run())
    head_fusion.HOLD_HEADS = True
    return {
        k: (statistics.median(v[0] for v in got[k]), statistics.median(v[1] for v in got[k]))
        for k in got
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    dev = pydiff.default_device()
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    h = pydiff.tensor(np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32))
    head = nn.Linear(64, 10, seed=1)

    def timed(fn, n):
        def run():
            c0, p0 = time.thread_time(), time.process_time()
            for _ in range(n):
                fn()
            c1 = time.thread_time()
            dev.native.wait_for_idle()
            return (c1 - c0) / n * 1e6, (time.process_time() - p0) / n * 1e6

        return run

    def pair():
        with pydiff.Tape():
            ops.cross_entropy(head(h), yb)

    for name, fn, n in (("MLP step", step, 50), ("head + cross_entropy", pair, 200)):
        res = alternate(timed(fn, n), args.rounds)
        (t1, p1), (t0, p0) = res[True], res[False]
        print(
            f"{name}: calling thread {t0:.0f} -> {t1:.0f} us, process CPU {p0:.0f} -> "
            f"{p1:.0f} us (two kernels -> one; {args.rounds // 2} rounds each)"
        )


if __name__ == "__main__":
    main()
