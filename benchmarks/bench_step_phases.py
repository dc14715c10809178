"""The eager MLP training step's calling-thread CPU per phase (``opt.zero_grad``, each layer,
the cross-entropy, ``tape.backward``, ``opt.step``), means over 1,200 steps after 300 of
warm-up, a device wait every 50 steps. Run it for two checkouts alternating
(``PYTHONPATH=<tree>``, from ``benchmarks/``).

python benchmarks/bench_step_phases.py
"""

from __future__ import annotations

import statistics
import time

import pydiff
from pydiff import nn, ops, optim

from mlp_step import make_batch


def main() -> None:
    dev = pydiff.default_device()
    xb, yb = make_batch()
    layers = [nn.Linear(64, 64, seed=0, activation="relu"), nn.Linear(64, 10, seed=1)]
    opt = optim.AdamW([p for layer in layers for p in layer.parameters()], lr=1e-3)
    clock = time.thread_time
    acc: dict[str, list] = {k: [] for k in ("zero_grad", "linear1", "linear2", "ce", "bwd", "opt")}
    for it in range(1500):
        t0 = clock()
        opt.zero_grad()
        t1 = clock()
        with pydiff.Tape() as tape:
            h = layers[0](xb)
            t2 = clock()
            z = layers[1](h)
            t3 = clock()
            loss = ops.cross_entropy(z, yb)
            t4 = clock()
        del h, z
        tape.backward(loss, retain_graph=False)
        t5 = clock()
        opt.step()
        t6 = clock()
        if it % 50 == 49:
            dev.native.wait_for_idle()
        if it >= 300:
            for k, a, b in zip(acc, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
                acc[k].append(b - a)
    means = {k: statistics.mean(v) * 1e6 for k, v in acc.items()}
    print(
        "calling thread per step (us): "
        + ", ".join(f"{k} {v:.1f}" for k, v in means.items())
        + f"; sum {sum(means.values()):.1f}"
    )


if __name__ == "__main__":
    main()
