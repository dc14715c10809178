"""Where a captured MLP training step's device time goes: each recorded command replayed on
its own, many times in one command list, timed by process CPU time (lavapipe computes in
this process, so the figure hardly depends on other load).

python benchmarks/bench_step_kernels.py [--reps 200]

It reads the capture's command list and the device's kernel cache (private to pydiff: this
is a measuring tool, not an API).
"""

from __future__ import annotations

import argparse
import statistics
import time


import pydiff

from mlp_step import make_batch, make_mlp_step
from timing import describe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200, help="replays of each command per timing")
    ap.add_argument("--rounds", type=int, default=7, help="timings per command (median)")
    args = ap.parse_args()
    dev = pydiff.default_device()
    native = dev.native
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)

    step()
    captured = pydiff.capture(step)
    names = {id(k): f"{key[0]}:{key[1]}" for key, k in dev.kernels._kernels.items()}

    def run(commands, reps):
        encoder = native.create_command_encoder()
        for _ in range(reps):
            for command in commands:
                if command[0] == "dispatch":
                    _, kernel, root, _, threads, _, _ = command
                    compute = encoder.begin_compute_pass()
                    compute.bind_pipeline(kernel.pipeline, root)
                    compute.dispatch([threads, 1, 1])
                    compute.end()
                elif command[0] == "clear":
                    command[1].clear(encoder)
                elif command[0] == "upload":
                    encoder.upload_buffer_data(command[1], 0, command[2])
        native.submit_command_buffer(encoder.finish())
        native.wait_for_idle()

    def cpu(fn):
        fn()
        times = []
        for _ in range(args.rounds):
            c0 = time.process_time()
            fn()
            times.append(time.process_time() - c0)
        return statistics.median(times)

    empty = cpu(lambda: run([], 1))
    print(f"device: {describe(dev)}")
    print(f"{captured}; CPU time per command (recording + execution), median of {args.rounds}:")
    total = 0.0
    for command in captured._commands:
        if command[0] == "host":
            continue
        t = (cpu(lambda: run([command], args.reps)) - empty) / args.reps
        total += t
        what = command[0]
        if what == "dispatch":
            what = f"{names.get(id(command[1]), '?')} ({command[4]} threads)"
        print(f"  {t * 1e6:7.1f} us  {what}")
    whole = cpu(lambda: (captured.replay(), native.wait_for_idle()))
    print(f"  sum {total * 1e6:.1f} us; the whole replay() + wait {whole * 1e6:.1f} us")


if __name__ == "__main__":
    main()
