"""A training step that calls your own Slang function, captured once and replayed.

python samples/capture_user_step.py [--steps 200] [--n 256]

Fits per-element weights w so that w * x matches targets t = 2 x (the weighted squared error
of ``sq_err`` below, its gradient by ``.bwds``, an SGD update), first eagerly, then with the
same step captured by ``pydiff.capture`` and replayed on new data each step. Both runs start
from the same weights and see the same batches: their weights must agree, and the captured
run's time per step is printed against the eager one's (docs/capture.md).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import pydiff
from pydiff import optim

SOURCE = """
[Differentiable] float sq_err(float a, float x, float t, float w)
{ float r = w * x - t; return a * r * r; }
"""


def make_run(m, n: int):
    """Fresh tensors and optimizer, and the step that trains them on the current x, t."""
    x = pydiff.zeros((n,))  # data: no gradient buffers
    t = pydiff.zeros((n,))
    w = pydiff.ones((n,), requires_grad=True)
    err = pydiff.zeros((n,)).with_grads(ones=True)  # the upstream gradient: ones
    opt = optim.SGD([w], lr=0.05)

    def step():
        opt.zero_grad()
        m.sq_err(0.5, x, t, w, _result=err)  # 0.5: a constant of the captured kernel
        m.sq_err.bwds(0.5, x, t, w, _result=err)
        opt.step()

    return x, t, w, err, opt, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--n", type=int, default=256)
    args = ap.parse_args()
    m = pydiff.load_module_from_source("capture_user_step", SOURCE)
    rng = np.random.default_rng(0)
    batches = [rng.uniform(0.5, 1.5, args.n) for _ in range(args.steps)]

    weights, seconds = {}, {}
    for how in ("eager", "captured"):
        x, t, w, err, opt, step = make_run(m, args.n)
        opt.step()  # SGD creates its state (no gradient yet: nothing moves)
        # The first batch's step untimed: it compiles the kernels (eager), or is the capture.
        x.copy_from_numpy(batches[0])
        t.copy_from_numpy(2.0 * batches[0])
        run = pydiff.capture(step).replay if how == "captured" else step
        if how == "eager":
            step()
        w.numpy()  # (waits for the device)
        start = time.perf_counter()
        for xb in batches[1:]:
            x.copy_from_numpy(xb)
            t.copy_from_numpy(2.0 * xb)
            run()
        final = w.numpy()  # (waits for the device)
        seconds[how] = (time.perf_counter() - start) / (len(batches) - 1)
        weights[how] = final
        print(f"{how:9s} w mean {final.mean():.6f} (target 2), loss {err.numpy().sum():.3e}")

    # The same steps in NumPy (float64): w -= lr * a * 2 (w x - t) x, with t = 2 x.
    w_ref = np.ones(args.n)
    for xb in batches:
        w_ref -= 0.05 * 0.5 * 2.0 * (w_ref * xb - 2.0 * xb) * xb
    worst = max(np.abs(weights[h] - w_ref).max() for h in weights)
    print(f"eager and captured against NumPy float64: worst difference {worst:.1e}")
    assert worst < 1e-4, worst
    ratio = seconds["captured"] / seconds["eager"]
    print(
        f"per step: eager {seconds['eager'] * 1e6:.0f} us, captured {seconds['captured'] * 1e6:.0f}"
        f" us ({ratio:.2f}x)"
    )


if __name__ == "__main__":
    main()
