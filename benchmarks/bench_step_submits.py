"""The eager MLP step waited on each time: the calling thread's CPU in each of the step's
submissions (by their order in the step) and in ``dev.wait()``, and how often the wait found
the step's last submission already finished; medians over ``--steps`` steps.

python benchmarks/bench_step_submits.py [--steps 400]

A submission's CPU is mostly slang-rhi's and lavapipe's (waking lavapipe's queue thread,
retiring the command buffers that have finished: a 4 KiB unmap per descriptor set, one set a
dispatch); the step's last submission, made while the queue thread still runs the backward,
costs least. Run it for two checkouts, alternating (``PYTHONPATH=<tree>``): one process's
figures depend on its placement on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import pydiff

from mlp_step import make_batch, make_mlp_step


class _Timed:
    """The device's SlangPy object, with its submissions timed (calling thread's CPU)."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.log: list[float] = []
        self.polls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def submit_command_buffer(self, *args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        out = self._native.submit_command_buffer(*args, **kwargs)
        self.log.append(time.thread_time() - t)
        return out

    def submit_command_buffers(self, *args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        out = self._native.submit_command_buffers(*args, **kwargs)
        self.log.append(time.thread_time() - t)
        return out

    def is_submit_finished(self, submit_id: int) -> bool:
        self.polls += 1
        return self._native.is_submit_finished(submit_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    dev = pydiff.default_device()
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    for _ in range(60):
        step()
        dev.wait()
    timed = _Timed(dev.queue.native)
    dev.queue.native = timed
    per: list[list[float]] = []
    waits, first = [], 0
    p0 = time.process_time()
    for _ in range(args.steps):
        timed.log = []
        step()
        timed.polls = 0
        t = time.thread_time()
        dev.wait()
        waits.append(time.thread_time() - t)
        first += timed.polls == 1
        for i, cost in enumerate(timed.log):
            if i == len(per):
                per.append([])
            per[i].append(cost)
    process = (time.process_time() - p0) / args.steps
    dev.queue.native = timed._native
    med = statistics.median
    subs = ", ".join(f"{med(c) * 1e6:.1f} ({len(c) / args.steps:.2f})" for c in per)
    print(
        f"per step: process CPU {process * 1e6:.0f} us; calling thread per submission, by "
        f"order (median us, submissions a step): {subs}; dev.wait() {med(waits) * 1e6:.1f} us "
        f"(mean {statistics.mean(waits) * 1e6:.1f}), finished at its first check "
        f"{first / args.steps:.0%}; load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
