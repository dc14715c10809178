"""The eager MLP training step's CPU time, split by thread: the process's, the calling
thread's, and (Linux) each other thread's from /proc (lavapipe's queue thread, which runs the
kernels when compute is inline), with the wall time; medians of rounds of 50 steps back to
back and one device wait, as a training loop (``--wait-each``: a wait after every step).

python benchmarks/bench_step_cpu.py [--rounds 12] [--wait-each]
    [--ab pydiff.product_kernels:MASKED_SWAP]
(``--ab pydiff.head_fusion:HOLD_HEADS``: the head and its loss in one kernel, or two)

Run it in separate processes for two checkouts, alternating (``PYTHONPATH=<tree>``): the
process CPU per step is the figure that holds when another process takes the second core
(wall time then tracks it). ``--ab MODULE:NAME`` instead sets that module-level switch to
True and False in alternate rounds of one process (the kernel cache's plan memo emptied at each
switch, so that products plan again): the same device, buffers and machine load for both.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time


import pydiff

from mlp_step import make_batch, make_mlp_step


def threads_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process (Linux; empty elsewhere)."""
    out: dict[str, float] = {}
    base = "/proc/self/task"
    if not os.path.isdir(base):
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def timed_round(step, dev, wait_each: bool, steps: int = 50) -> tuple[float, float, float]:
    """(process CPU, calling thread's CPU, wall) per step over ``steps`` steps and a wait."""
    w0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        step()
        if wait_each:
            dev.wait()
    c1 = time.thread_time()
    dev.wait()
    return (time.process_time() - p0) / steps, (c1 - c0) / steps, (time.perf_counter() - w0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--wait-each", action="store_true", help="a device wait after every step")
    ap.add_argument("--ab", help="MODULE:NAME, a boolean switch set True/False in alternate rounds")
    args = ap.parse_args()
    if args.ab:
        ab(args)
        return
    dev = pydiff.default_device()
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    for _ in range(60):
        step()
    dev.native.wait_for_idle()
    me = str(__import__("threading").get_native_id())
    process, thread, wall = [], [], []
    submissions = dev.queue.submissions
    before = threads_cpu()
    for _ in range(args.rounds):
        p, t, w = timed_round(step, dev, args.wait_each)
        process.append(p)
        thread.append(t)
        wall.append(w)
    after = threads_cpu()
    steps = 50 * args.rounds
    others = sorted(
        ((after[t] - before.get(t, 0.0)) / steps for t in after if t != me), reverse=True
    )
    med = statistics.median
    print(
        f"per step: process CPU {med(process) * 1e6:.0f} us, calling thread "
        f"{med(thread) * 1e6:.0f} us, wall {med(wall) * 1e6:.0f} us; other threads "
        f"(clock ticks, mean) {', '.join(f'{v * 1e6:.0f}' for v in others[:2])} us; "
        f"{(dev.queue.submissions - submissions) / steps:.2f} submissions; "
        f"load {os.getloadavg()[0]:.2f}"
    )


def ab(args: argparse.Namespace) -> None:
    """``--ab``: process CPU, calling thread's CPU and wall per step, the switch on and off in
    alternate rounds (the order swapped every round), medians."""
    modname, name = args.ab.split(":")
    mod = importlib.import_module(modname)
    dev = pydiff.default_device()
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)

    def use(value: bool) -> None:
        setattr(mod, name, value)
        dev.kernels.plans.clear()

    for value in (False, True):
        use(value)
        for _ in range(30):
            step()
    dev.native.wait_for_idle()
    times: dict[bool, list] = {True: [], False: []}
    others = {True: 0.0, False: 0.0}  # the other threads' CPU (clock ticks), summed
    me = str(__import__("threading").get_native_id())
    for r in range(args.rounds):
        for value in (True, False) if r % 2 == 0 else (False, True):
            use(value)
            before = threads_cpu()
            times[value].append(timed_round(step, dev, args.wait_each))
            after = threads_cpu()
            others[value] += sum(after[t] - before.get(t, 0.0) for t in after if t != me)
    med = statistics.median
    for value in (False, True):
        t = times[value]
        print(
            f"{name}={value}: process CPU {med(x[0] for x in t) * 1e6:.0f} us, calling thread "
            f"{med(x[1] for x in t) * 1e6:.0f} us, wall {med(x[2] for x in t) * 1e6:.0f} us; "
            f"other threads (mean) {others[value] / (50 * args.rounds) * 1e6:.0f} us"
        )
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
