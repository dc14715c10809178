"""Generated kernels (pydiff.generated) against pydiff's SlangPy path and NumPy in place: the
polynomial of samples/polynomial.slang, forward + backward (gradient added into x's buffer),
and a float3 shading function (pydiff.generated_vector) called as users write it.

    python benchmarks/bench_generated.py [--sizes 20 24] [--rounds 7]

Each size times, in interleaved rounds (medians and minima; the machine is shared), the
generated forward and backward kernels, the same call through SlangPy (``m.polynomial(...)``
then ``.bwds``), the plain call users write (``y = m.polynomial(...)``: a new result each
call) then ``.bwds``, and NumPy computing the values and the closed-form gradient in place
(preallocated outputs, one core) and with new arrays. Also the host cost per call at 16
elements. The ``shade`` rows: ``y = m.shade(N, L, 2.0)`` then ``.bwds`` over N, L float
tensors of shape (n, 3) (float3 elements; a new float3 result and gradient buffer each call,
from the buffer pool), the same into a result made once (``_result=Y``), the forward alone
with a new result, against ``PYDIFF_GENERATED=0``, and NumPy's forward. Prints ratios; the
tests never assert on speed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

import pydiff
from pydiff import generated

from timing import describe, interleaved

SOURCE = Path(__file__).resolve().parent.parent / "samples" / "polynomial.slang"
SHADE = """
[Differentiable] float3 shade(float3 n, float3 l, float k)
{ return k * max(dot(n, l), 0.0) * n + 0.1 * l; }
"""


def shade_contenders(dev, m, n: int) -> dict:
    rng = np.random.default_rng(0)
    ns, ls = (rng.standard_normal((n, 3)).astype(np.float32) for _ in range(2))
    N = pydiff.tensor(ns, device=dev, requires_grad=True)
    L = pydiff.tensor(ls, device=dev, requires_grad=True)
    up = pydiff.tensor(np.ones((n, 3), np.float32), device=dev, dtype="float3")

    Y = pydiff.zeros((n,), device=dev, dtype="float3").with_grads(grad_in=up)

    def call():  # a new result (and gradient buffer) each call: pooled float4 storage
        y = m.shade(N, L, 2.0)
        m.shade.bwds(N, L, 2.0, _result=y.with_grads(grad_in=up))
        dev.native.wait_for_idle()

    def given():  # the result and its gradient buffers made once
        m.shade(N, L, 2.0, _result=Y)
        m.shade.bwds(N, L, 2.0, _result=Y)
        dev.native.wait_for_idle()

    def forward_new():
        m.shade(N, L, 2.0)
        dev.native.wait_for_idle()

    def slangpy():
        saved = os.environ.get("PYDIFF_GENERATED")
        os.environ["PYDIFF_GENERATED"] = "0"
        try:
            call()
        finally:
            os.environ.pop("PYDIFF_GENERATED")
            if saved is not None:
                os.environ["PYDIFF_GENERATED"] = saved

    def numpy_forward():
        d = np.einsum("ij,ij->i", ns, ls)
        _ = 2.0 * np.maximum(d, 0.0)[:, None] * ns + 0.1 * ls

    return {
        "generated": call,
        "generated, _result=Y": given,
        "forward only, new y": forward_new,
        "pydiff SlangPy path": slangpy,
        "NumPy forward only": numpy_forward,
    }


def contenders(dev, m, n: int) -> dict:
    rng = np.random.default_rng(0)
    xs = rng.standard_normal(n).astype(np.float32)
    ups = np.ones(n, np.float32)
    x = pydiff.tensor(xs, device=dev, requires_grad=True)
    up = pydiff.tensor(ups, device=dev)
    y = pydiff.empty((n,), device=dev)
    ys = pydiff.zeros((n,), device=dev).with_grads(grad_in=up)
    fn, args = m.polynomial, [2.0, 8.0, -1.0, x]

    def sync():
        dev.native.wait_for_idle()

    def gen():
        assert generated.forward(fn, args, (n,), out=y) is y
        assert generated.backward(fn, args, up, {3: x.grad_out})
        sync()

    def slangpy():
        saved = os.environ.get("PYDIFF_GENERATED")
        os.environ["PYDIFF_GENERATED"] = "0"  # pydiff's calls take SlangPy's path
        try:
            fn(2.0, 8.0, -1.0, x, _result=ys)
            fn.bwds(2.0, 8.0, -1.0, x, _result=ys)
        finally:
            os.environ.pop("PYDIFF_GENERATED")
            if saved is not None:
                os.environ["PYDIFF_GENERATED"] = saved
        sync()

    def plain():  # how users call it: a new result each call (pooled), then .bwds
        fn(2.0, 8.0, -1.0, x)
        fn.bwds(2.0, 8.0, -1.0, x, _result=ys)
        sync()

    out, tmp, grad = np.empty_like(xs), np.empty_like(xs), np.zeros_like(xs)

    def numpy_in_place():
        np.multiply(xs, 2.0, out=out)  # y = (2x + 8) x - 1
        np.add(out, 8.0, out=out)
        np.multiply(out, xs, out=out)
        np.subtract(out, 1.0, out=out)
        np.multiply(xs, 4.0, out=tmp)  # dx += up (4x + 8)
        np.add(tmp, 8.0, out=tmp)
        np.multiply(tmp, ups, out=tmp)
        np.add(grad, tmp, out=grad)

    def numpy_new():  # the same with new arrays, as NumPy code is usually written
        nonlocal grad
        _ = (2.0 * xs + 8.0) * xs - 1.0
        grad = grad + ups * (4.0 * xs + 8.0)

    return {
        "generated": gen,
        "pydiff y = f(..)": plain,
        "pydiff SlangPy path": slangpy,
        "NumPy in place": numpy_in_place,
        "NumPy new arrays": numpy_new,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 24], help="log2 of elements")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dev = pydiff.default_device()
    m = pydiff.load_module(SOURCE, device=dev)
    shade = pydiff.load_module_from_source("bench_shade", SHADE, device=dev)
    print(f"device: {describe(dev)}")
    print(f"{'case':<14}{'contender':<22}{'median':>10}{'min':>10}{'/ generated':>13}")
    for log2 in [4, *args.sizes]:
        n = 1 << log2
        small = n <= 1 << 12
        inner = 200 if small else max(1, (1 << 22) // n)
        times = interleaved(
            contenders(dev, m, n),
            rounds=args.rounds,
            inner=inner,
            warmup=20 if small else 2,
            pause=0.05 if small else 0.25,
        )
        base = times["generated"][0]
        unit, scale = ("us", 1e6) if small else ("ms", 1e3)
        for name, (med, low) in times.items():
            print(
                f"{'2^' + str(log2):<14}{name:<22}{med * scale:>8.1f}{unit}{low * scale:>8.1f}"
                f"{unit}{med / base:>12.2f}x"
            )
        gen, np_t = base, times["NumPy in place"][0]
        print(f"{'':<14}generated / NumPy in place = {gen / np_t:.2f}x")
        if small:
            continue
        times = interleaved(
            shade_contenders(dev, shade, n), rounds=args.rounds, inner=1, warmup=2, pause=0.25
        )
        base = times["generated"][0]
        for name, (med, low) in times.items():
            print(
                f"{'shade 2^' + str(log2):<14}{name:<22}{med * 1e3:>8.1f}ms{low * 1e3:>8.1f}"
                f"ms{med / base:>12.2f}x"
            )
    print(f"paths taken: {generated.stats()}")


if __name__ == "__main__":
    main()
