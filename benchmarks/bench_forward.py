"""Forward mode: the JVP of the 2^24-element polynomial against its forward call and its bwds.

    python benchmarks/bench_forward.py [--large 24]

Forward mode should cost about one forward pass (the tangent rides along), reverse mode a
forward plus a backward. Also NumPy's closed-form derivative and PyTorch's torch.func.jvp on
the CPU when installed. Prints times and ratios; the tests never assert on speed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import pydiff

from timing import best_of, describe

SOURCE = Path(__file__).resolve().parent.parent / "samples" / "polynomial.slang"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", type=int, default=24, help="log2 of the number of elements")
    args = ap.parse_args()
    dev = pydiff.default_device()
    m = pydiff.load_module(SOURCE, device=dev)
    n = 1 << args.large
    rng = np.random.default_rng(0)
    xs = rng.standard_normal(n).astype(np.float32)
    x = pydiff.tensor(xs, device=dev, requires_grad=True).with_tangent(np.ones(n, np.float32))
    y = pydiff.zeros((n,), device=dev).with_grads(ones=True)

    def sync():
        dev.native.wait_for_idle()

    t_fwd = best_of(lambda: (m.polynomial(2.0, 8.0, -1.0, x, _result=y), sync()))
    t_jvp = best_of(lambda: (m.polynomial.fwds(2.0, 8.0, -1.0, x), sync()))
    t_bwd = best_of(lambda: (m.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y), sync()))
    print(f"device: {describe(dev)}; {n:,} elements")
    print(f"forward call       {t_fwd * 1e3:8.1f} ms")
    print(f"fwds (value + JVP) {t_jvp * 1e3:8.1f} ms   = {t_jvp / t_fwd:.2f}x the forward call")
    print(f"bwds (VJP)         {t_bwd * 1e3:8.1f} ms   fwds/bwds = {t_jvp / t_bwd:.2f}x")
    t_np = best_of(lambda: (2.0 * xs * xs + 8.0 * xs - 1.0, 4.0 * xs + 8.0))
    print(
        f"NumPy value + closed-form derivative {t_np * 1e3:.1f} ms   "
        f"pydiff fwds/NumPy = {t_jvp / t_np:.2f}x"
    )
    try:
        import torch
        from torch.func import jvp
    except ImportError:
        print("(PyTorch not installed: pip install pydiff[bench] to compare torch.func.jvp)")
        return
    tx, tt = torch.from_numpy(xs), torch.ones(n)
    t_torch = best_of(lambda: jvp(lambda v: 2.0 * v * v + 8.0 * v - 1.0, (tx,), (tt,)))
    print(
        f"PyTorch-CPU torch.func.jvp {t_torch * 1e3:.1f} ms   "
        f"pydiff fwds/PyTorch = {t_jvp / t_torch:.2f}x"
    )


if __name__ == "__main__":
    main()
