"""tape.backward over N recorded calls against the same N .bwds calls made by hand.

python benchmarks/bench_tape.py [--calls 10] [--size 16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import pydiff

from timing import best_of, describe

SHADER = Path(__file__).resolve().parent.parent / "tests" / "shaders" / "chain.slang"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--size", type=int, default=16)
    args = ap.parse_args()
    m = pydiff.load_module(SHADER)
    dev = m.device
    xs = np.linspace(-1, 1, args.size).astype(np.float32)
    ops = [m.square, m.sine] * (args.calls // 2) + [m.square] * (args.calls % 2)

    x = pydiff.tensor(xs, requires_grad=True)
    with pydiff.Tape() as tape:
        h = x
        for op in ops:
            h = op(h, _result="tensor")
    seed = np.ones(args.size)

    def taped():
        tape.backward(h, grad=seed)
        dev.native.wait_for_idle()

    # By hand: the same forward values, gradient buffers on every intermediate.
    x2 = pydiff.tensor(xs, requires_grad=True)
    chain = [x2]
    for op in ops:
        chain.append(op(chain[-1], _result="tensor").with_grads())

    def by_hand():
        for t in chain[1:]:
            t.zero_grad()
        chain[-1].grad.copy_from_numpy(seed)
        for op, inp, out in reversed(list(zip(ops, chain[:-1], chain[1:]))):
            op.bwds(inp, _result=out)
        dev.native.wait_for_idle()

    t_tape, t_hand = best_of(taped, 5, 20), best_of(by_hand, 5, 20)
    x.zero_grad()
    x2.zero_grad()
    taped()
    by_hand()
    if not np.array_equal(x.grad.numpy(), x2.grad.numpy()):
        raise SystemExit("tape and by-hand gradients differ")
    print(f"device: {describe(dev)}; {args.calls} calls of {args.size} elements")
    print(f"tape.backward      {t_tape * 1e3:8.3f} ms")
    print(f"by hand (.bwds x{args.calls}) {t_hand * 1e3:8.3f} ms")
    print(f"tape / by hand     {t_tape / t_hand:8.2f}x")


if __name__ == "__main__":
    main()
