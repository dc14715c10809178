"""The eager MLP training step's Python work, counted (the same on a loaded machine): Python-level
calls and bytecodes executed per step (``sys.settrace`` call and opcode events, the device wait
left out), and with ``--top N`` the N functions that execute the most bytecodes. Compare two
checkouts with ``PYTHONPATH=<tree>``, from ``benchmarks/``.

python benchmarks/bench_step_counts.py [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import sys

import pydiff

from mlp_step import make_batch, make_mlp_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=0, help="list the N busiest functions")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dev = pydiff.default_device()
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    for _ in range(20):  # kernels built, pool and memos filled
        step()
        dev.wait()
    ops: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def trace(frame, event, arg):
        code = frame.f_code
        key = f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno} {code.co_name}"
        calls[key] += 1
        frame.f_trace_opcodes = True

        def local(frame, event, arg):
            if event == "opcode":
                ops[key] += 1
            return local

        return local

    for _ in range(args.steps):
        sys.settrace(trace)
        step()
        sys.settrace(None)
        dev.wait()
    n = args.steps
    print(f"per step: {sum(calls.values()) / n:.0f} calls, {sum(ops.values()) / n:.0f} bytecodes")
    for key, count in ops.most_common(args.top):
        print(f"{count / n:8.0f} bytecodes {calls[key] / n:5.1f} calls  {key}")


if __name__ == "__main__":
    main()
