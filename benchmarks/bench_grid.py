"""The pattern of SlangPy's differentiable-tensor docs, a function indexing its own tensors
called over a grid, forward and ``.bwds``, through pydiff (generated kernels), pydiff's SlangPy path
(``PYDIFF_GENERATED=0``), raw SlangPy and NumPy; a clamped five-point stencil over a 2-D grid
(``int2`` index, ``--side`` squared pixels) through the same paths; and large host transfers
(staged in pydiff, SlangPy's own in raw SlangPy) against NumPy's copy.

    python benchmarks/bench_grid.py [--log2 22] [--side 2048] [--rounds 5]

Medians and minima of interleaved rounds; prints ratios. Timings only: the tests never
assert on speed.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import slangpy as spy

import pydiff
from timing import describe, interleaved

SOURCE = """import slangpy;
[Differentiable]
void polynomial(int idx, float a, float b, float c, IDiffTensor<float, 1> x,
                IWDiffTensor<float, 1> result)
{
    float xval = x[idx];
    result[idx] = a * xval * xval + b * xval + c;
}
"""

STENCIL = """import slangpy;
[Differentiable]
void blur(int2 px, IDiffTensor<float, 2> img, IWDiffTensor<float, 2> result)
{
    int h = int(img.shape[0]);
    int w = int(img.shape[1]);
    int r = px.y;
    int c = px.x;
    float s = 0.5 * img[r, c] + 0.2 * img[r, max(c - 1, 0)] + 0.1 * img[r, min(c + 1, w - 1)]
        + 0.15 * img[max(r - 1, 0), c] + 0.05 * img[min(r + 1, h - 1), c];
    result[r, c] = s;
}
"""


def grid_contenders(dev, n: int) -> dict:
    m = pydiff.load_module_from_source("bench_grid", SOURCE, device=dev)
    raw = spy.Module.load_from_source(dev.native, "bench_grid_raw", SOURCE)
    xs = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x, y = pydiff.tensor(xs, device=dev), pydiff.zeros((n,), device=dev)
    rx = spy.Tensor.from_numpy(dev.native, xs)
    ry = spy.Tensor.zeros(dev.native, (n,), "float")
    out = np.empty_like(xs)

    def pydiff_generated():
        m.polynomial(spy.grid((n,)), 2.0, 8.0, -1.0, x, y)
        dev.native.wait_for_idle()

    def pydiff_slangpy_path():
        os.environ["PYDIFF_GENERATED"] = "0"
        try:
            m.polynomial(spy.grid((n,)), 2.0, 8.0, -1.0, x, y)
        finally:
            del os.environ["PYDIFF_GENERATED"]
        dev.native.wait_for_idle()

    def raw_slangpy():
        raw.polynomial(spy.grid((n,)), 2.0, 8.0, -1.0, rx, ry)
        dev.native.wait_for_idle()

    def numpy_in_place():  # (2x + 8) x - 1
        np.multiply(xs, 2.0, out=out)
        np.add(out, 8.0, out=out)
        np.multiply(out, xs, out=out)
        np.subtract(out, 1.0, out=out)

    return {
        "pydiff (generated)": pydiff_generated,
        "pydiff, SlangPy path": pydiff_slangpy_path,
        "raw SlangPy": raw_slangpy,
        "NumPy in place": numpy_in_place,
    }


def backward_contenders(dev, n: int) -> dict:
    """``.bwds`` of the same call: x's gradient (4x + 8) times the upstream ones."""
    m = pydiff.load_module_from_source("bench_grid_bwd", SOURCE, device=dev)
    raw = spy.Module.load_from_source(dev.native, "bench_grid_bwd_raw", SOURCE)
    xs = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    x = pydiff.tensor(xs, device=dev).with_grads(zero=True)
    y = pydiff.zeros((n,), device=dev).with_grads(ones=True)
    rx = spy.Tensor.from_numpy(dev.native, xs).with_grads(zero=True)
    ry = spy.Tensor.zeros(dev.native, (n,), "float").with_grads()
    ry.grad.copy_from_numpy(np.ones(n, np.float32))
    grad, up = np.zeros_like(xs), np.ones_like(xs)

    def pydiff_bwds(generated_on: bool):
        def run():
            if not generated_on:
                os.environ["PYDIFF_GENERATED"] = "0"
            try:
                m.polynomial.bwds(spy.grid((n,)), 2.0, 8.0, -1.0, x, y)
            finally:
                os.environ.pop("PYDIFF_GENERATED", None)
            dev.native.wait_for_idle()

        return run

    def raw_bwds():
        raw.polynomial.bwds(spy.grid((n,)), 2.0, 8.0, -1.0, rx, ry)
        dev.native.wait_for_idle()

    def numpy_in_place():  # grad += up (4x + 8)
        tmp = np.multiply(xs, 4.0)
        np.add(tmp, 8.0, out=tmp)
        np.multiply(tmp, up, out=tmp)
        np.add(grad, tmp, out=grad)

    return {
        "pydiff (generated)": pydiff_bwds(True),
        "pydiff, SlangPy path": pydiff_bwds(False),
        "raw SlangPy": raw_bwds,
        "NumPy in place": numpy_in_place,
    }


def stencil_contenders(dev, side: int, backward: bool) -> dict:
    """The stencil over a (side, side) grid, forward or ``.bwds`` (up to five threads add into
    each pixel's gradient)."""
    tag = "bwd" if backward else "fwd"
    m = pydiff.load_module_from_source(f"bench_stencil_{tag}", STENCIL, device=dev)
    raw = spy.Module.load_from_source(dev.native, f"bench_stencil_{tag}_raw", STENCIL)
    shape = (side, side)
    xs = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    x, y = pydiff.tensor(xs, device=dev), pydiff.zeros(shape, device=dev)
    rx = spy.Tensor.from_numpy(dev.native, xs)
    ry = spy.Tensor.zeros(dev.native, shape, "float")
    if backward:
        x, y = x.with_grads(zero=True), y.with_grads(ones=True)
        rx, ry = rx.with_grads(zero=True), ry.with_grads()
        ry.grad.copy_from_numpy(np.ones(shape, np.float32))
    fn = m.blur.bwds if backward else m.blur
    raw_fn = raw.blur.bwds if backward else raw.blur

    def through_pydiff(generated_on: bool):
        def run():
            if not generated_on:
                os.environ["PYDIFF_GENERATED"] = "0"
            try:
                fn(spy.grid(shape), x, y)
            finally:
                os.environ.pop("PYDIFF_GENERATED", None)
            dev.native.wait_for_idle()

        return run

    def raw_slangpy():
        raw_fn(spy.grid(shape), rx, ry)
        dev.native.wait_for_idle()

    return {
        "pydiff (generated)": through_pydiff(True),
        "pydiff, SlangPy path": through_pydiff(False),
        "raw SlangPy": raw_slangpy,
    }


def transfer_contenders(dev, n: int) -> dict:
    values = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    x = pydiff.tensor(values, device=dev)
    rx = spy.Tensor.from_numpy(dev.native, values)
    return {
        "pydiff x.copy_from_numpy(a)": lambda: x.copy_from_numpy(values),
        "raw SlangPy copy_from_numpy": lambda: (
            rx.copy_from_numpy(values),
            dev.native.wait_for_idle(),
        ),
        "pydiff x.numpy()": lambda: x.numpy(),
        "raw SlangPy to_numpy()": lambda: rx.to_numpy(),
        "NumPy a.copy()": lambda: values.copy(),
    }


def report(title: str, times: dict, base: str) -> None:
    print(title)
    for name, (med, low) in times.items():
        print(f"  {name:<30}{med * 1e3:>9.2f} ms{low * 1e3:>9.2f} ms{med / times[base][0]:>8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2", type=int, default=22, help="log2 of the elements")
    ap.add_argument("--side", type=int, default=2048, help="the stencil's grid: side x side")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = pydiff.default_device()
    n = 1 << args.log2
    print(f"device: {describe(dev)}; 2^{args.log2} floats; median, min, / the first")
    grid = interleaved(grid_contenders(dev, n), rounds=args.rounds, inner=2, warmup=2)
    report("forward over spy.grid (IDiffTensor in, IWDiffTensor out):", grid, "pydiff (generated)")
    bwds = interleaved(backward_contenders(dev, n), rounds=args.rounds, inner=2, warmup=2)
    report(".bwds over spy.grid (DiffTensor, store counts checked):", bwds, "pydiff (generated)")
    for backward in (False, True):
        what = ".bwds" if backward else "forward"
        times = interleaved(
            stencil_contenders(dev, args.side, backward), rounds=args.rounds, inner=2, warmup=2
        )
        title = f"{what} of a 5-point stencil over spy.grid(({args.side}, {args.side})) (int2):"
        report(title, times, "pydiff (generated)")
    moves = interleaved(transfer_contenders(dev, n), rounds=args.rounds, inner=2, warmup=2)
    report(f"host transfers of {4 * n / 1e6:.0f} MB:", moves, "NumPy a.copy()")
    print(f"paths taken: {pydiff.generated.stats()}")


if __name__ == "__main__":
    main()
