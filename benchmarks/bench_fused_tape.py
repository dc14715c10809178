"""A tape step over one user function, ``y = m.polynomial(2, 8, -1, x)`` then
``tape.backward(y, grad=g)``: pydiff's fused forward + backward kernel (one dispatch,
``pydiff.generated_hold``) against the same step as two generated kernels (the hold off),
raw SlangPy (the call, then ``.bwds``), NumPy computing the values and the closed-form
gradient in place, and PyTorch-CPU autograd.

    python benchmarks/bench_fused_tape.py [--sizes 20 22] [--rounds 7]

Each size times the contenders in interleaved rounds (medians and minima of wall time and
of the process's CPU time, lavapipe's threads included: the machine is shared), each step
waited on. ``g`` is a device tensor (a NumPy seed adds its upload to every step). Checks each
contender's gradient against the float64 closed form once; prints ratios, asserts nothing
about speed. Path counts (``forward+backward fused``) are printed at the end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import slangpy as spy

import pydiff
from pydiff import generated, generated_hold

from timing import describe

SOURCE = Path(__file__).resolve().parent.parent / "samples" / "polynomial.slang"


def contenders(dev, m, raw, xs: np.ndarray, gs: np.ndarray) -> tuple[dict, dict]:
    """(name -> one waited step, name -> that step's gradient of x as NumPy)."""
    n = xs.size
    x = pydiff.tensor(xs, device=dev, requires_grad=True)
    g = pydiff.tensor(gs, device=dev)
    sync = dev.native.wait_for_idle

    def tape_step(hold: bool):
        def step():
            generated_hold.HOLD_FORWARD = hold
            x.zero_grad()
            with pydiff.Tape() as tape:
                y = m.polynomial(2.0, 8.0, -1.0, x)
            tape.backward(y, grad=g, retain_graph=False)
            sync()

        return step

    rx = spy.Tensor.from_numpy(dev.native, xs).with_grads(zero=True)
    ry = spy.Tensor.zeros(dev.native, (n,), "float").with_grads(zero=True)
    ry.grad.copy_from_numpy(gs)

    def slangpy():
        rx.grad.clear()
        raw.polynomial(2.0, 8.0, -1.0, rx, _result=ry)
        raw.polynomial.bwds(2.0, 8.0, -1.0, rx, _result=ry)
        sync()

    out, tmp, grad = np.empty_like(xs), np.empty_like(xs), np.zeros_like(xs)

    def numpy_in_place():
        np.multiply(xs, 2.0, out=out)  # y = (2x + 8) x - 1
        np.add(out, 8.0, out=out)
        np.multiply(out, xs, out=out)
        np.subtract(out, 1.0, out=out)
        np.multiply(xs, 4.0, out=tmp)  # dx = g (4x + 8)
        np.add(tmp, 8.0, out=tmp)
        np.multiply(tmp, gs, out=grad)

    steps = {
        "pydiff tape, fused": tape_step(True),
        "pydiff tape, 2 kernels": tape_step(False),
        "raw SlangPy": slangpy,
        "NumPy in place": numpy_in_place,
    }
    grads = {
        "pydiff tape, fused": lambda: x.grad.numpy(),
        "pydiff tape, 2 kernels": lambda: x.grad.numpy(),
        "raw SlangPy": lambda: rx.grad.to_numpy().reshape(-1),
        "NumPy in place": lambda: grad,
    }
    try:
        import torch
    except ImportError:
        return steps, grads
    tx, tg = torch.from_numpy(xs.copy()).requires_grad_(), torch.from_numpy(gs)

    def torch_step():
        tx.grad = None
        y = 2.0 * tx * tx + 8.0 * tx - 1.0
        y.backward(tg)

    steps["PyTorch-CPU autograd"] = torch_step
    grads["PyTorch-CPU autograd"] = lambda: tx.grad.numpy()
    return steps, grads


def timed(steps: dict, rounds: int, inner: int) -> dict:
    """name -> (median wall, min wall, median process CPU) seconds per step, in alternating
    rounds after a pause (lavapipe's and OpenMP's threads spin for a while after work)."""
    wall: dict = {k: [] for k in steps}
    cpu: dict = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            time.sleep(0.2)
            step()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                step()
            wall[name].append((time.perf_counter() - t0) / inner)
            cpu[name].append((time.process_time() - c0) / inner)
    return {k: (statistics.median(wall[k]), min(wall[k]), statistics.median(cpu[k])) for k in steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22], help="log2 of elements")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dev = pydiff.default_device()
    m = pydiff.load_module(SOURCE, device=dev)
    raw = spy.Module.load_from_file(dev.native, str(SOURCE))
    print(f"device: {describe(dev)}")
    held = generated_hold.HOLD_FORWARD
    try:
        for log2 in args.sizes:
            n = 1 << log2
            rng = np.random.default_rng(log2)
            xs = rng.uniform(-2, 2, n).astype(np.float32)
            gs = rng.uniform(-1, 1, n).astype(np.float32)
            steps, grads = contenders(dev, m, raw, xs, gs)
            want = gs.astype(np.float64) * (4.0 * xs.astype(np.float64) + 8.0)
            for name, step in steps.items():  # each contender right once, against float64
                step()
                got = np.asarray(grads[name](), np.float64)
                err = np.max(np.abs(got - want) / (1.0 + np.abs(want)))
                if err > 1e-5:
                    raise SystemExit(f"{name}: gradient off by {err:.2e} (relative)")
            generated.reset_stats()
            res = timed(steps, args.rounds, max(1, (1 << 22) // n))
            base_wall, base_cpu = res["pydiff tape, fused"][0], res["pydiff tape, fused"][2]
            print(f"\n2^{log2} elements, one waited step (forward + backward):")
            print(f"{'contender':<24}{'median':>10}{'min':>10}{'CPU':>10}{'wall/fused':>12}")
            for name, (med, low, c) in res.items():
                print(
                    f"{name:<24}{med * 1e3:>8.2f}ms{low * 1e3:>8.2f}ms{c * 1e3:>8.2f}ms"
                    f"{med / base_wall:>11.2f}x"
                )
            two = res["pydiff tape, 2 kernels"]
            print(
                f"fused / 2 kernels: wall {base_wall / two[0]:.2f}x, process CPU "
                f"{base_cpu / two[2]:.2f}x; fused / raw SlangPy "
                f"{base_wall / res['raw SlangPy'][0]:.2f}x; fused / NumPy in place "
                f"{base_wall / res['NumPy in place'][0]:.2f}x"
            )
            if "PyTorch-CPU autograd" in res:
                print(f"fused / PyTorch-CPU {base_wall / res['PyTorch-CPU autograd'][0]:.2f}x")
            print(f"paths taken: {generated.stats()}")
    finally:
        generated_hold.HOLD_FORWARD = held


if __name__ == "__main__":
    main()
