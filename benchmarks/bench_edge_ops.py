"""CPU time of the elementwise ops whose shaders guard their edges (docs/op-domains.md):
forward + backward on 1M floats in the normal range, medians of 7 rounds.

    PYTHONPATH=$PWD python benchmarks/bench_edge_ops.py

Run it on two checkouts in turn (PYTHONPATH=<other checkout>) to compare builds; process
CPU time counts lavapipe's threads too. Timings only; the tests never assert on speed.
"""

from __future__ import annotations

import time

import numpy as np

import pydiff
from pydiff import ops

N = 1 << 20


def main() -> None:
    rng = np.random.default_rng(0)
    x0 = rng.uniform(-6, 6, N).astype(np.float32)
    b0 = rng.uniform(0.5, 3, N).astype(np.float32)
    res = {}
    for name in ("sin", "tanh", "gelu", "silu", "log", "div", "exp"):
        times = []
        for _ in range(8):  # the first round builds the kernels
            x = pydiff.tensor(np.abs(x0) + 0.1 if name == "log" else x0, requires_grad=True)
            b = pydiff.tensor(b0, requires_grad=True)
            t = time.process_time()
            with pydiff.Tape() as tape:
                y = ops.div(x, b) if name == "div" else getattr(ops, name)(x)
            tape.backward(y, grad=np.ones(N, np.float32))
            x.grad.numpy()
            times.append(time.process_time() - t)
        res[name] = round(float(np.median(times[1:])) * 1e3, 1)
    print(res, "ms CPU, forward + backward on 1M floats")


if __name__ == "__main__":
    main()
