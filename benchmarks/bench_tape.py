"""tape.backward over N recorded calls against the same N .bwds calls made by hand; then a
whole step (the N calls recorded on a fresh tape, its backward) against the same calls off a
tape with the .bwds by hand, raw SlangPy's calls and .bwds, and PyTorch autograd (CPU, one
thread) on the same math.

python benchmarks/bench_tape.py [--calls 10] [--size 16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import pydiff

from timing import best_of, describe, interleaved

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
    whole_step(m, ops, xs, seed)


def whole_step(m, ops, xs, seed) -> None:
    """A training step's shape: record the calls on a fresh tape, run its backward."""
    dev = m.device
    n = len(ops)
    x = pydiff.tensor(xs, requires_grad=True)

    def taped():
        with pydiff.Tape() as tape:
            h = x
            for op in ops:
                h = op(h)
        tape.backward(h, grad=seed, retain_graph=False)
        dev.native.wait_for_idle()

    x2 = pydiff.tensor(xs, requires_grad=True)

    def by_hand():
        chain = [x2]
        for op in ops:
            chain.append(op(chain[-1]).with_grads())
        chain[-1].grad.copy_from_numpy(seed)
        for op, inp, out in reversed(list(zip(ops, chain[:-1], chain[1:]))):
            op.bwds(inp, _result=out)
        dev.native.wait_for_idle()

    import slangpy as spy

    raw = spy.Module.load_from_file(dev.native, str(SHADER))
    raw_ops = [getattr(raw, op.name) for op in ops]
    rx = spy.Tensor.from_numpy(dev.native, xs).with_grads()

    def raw_slangpy():
        chain = [rx]
        for op in raw_ops:
            chain.append(op(chain[-1], _result="tensor").with_grads())
        chain[-1].grad.copy_from_numpy(seed.astype(np.float32))
        for op, inp, out in reversed(list(zip(raw_ops, chain[:-1], chain[1:]))):
            op.bwds(inp, _result=out)
        dev.native.wait_for_idle()

    contenders = {"pydiff tape": taped, "pydiff by hand": by_hand, "raw SlangPy": raw_slangpy}
    try:
        import torch

        torch.set_num_threads(1)
        tx = torch.tensor(xs, requires_grad=True)
        fns = {"square": lambda t: t * t, "sine": torch.sin}
        tops = [fns[op.name] for op in ops]
        tseed = torch.tensor(seed, dtype=torch.float32)

        def torch_step():
            h = tx
            for op in tops:
                h = op(h)
            h.backward(tseed)

        contenders["PyTorch CPU"] = torch_step
    except ImportError:
        print("(PyTorch not installed: its row is left out)")
    res = interleaved(contenders, rounds=9, inner=20, warmup=30)
    print(f"whole step, {n} calls of {len(xs)} elements (median of 9 alternating rounds):")
    base = res["pydiff tape"][0]
    for name, (med, _) in res.items():
        print(f"  {name:15s} {med * 1e3:8.3f} ms   tape / this {base / med:6.2f}x")


if __name__ == "__main__":
    main()
