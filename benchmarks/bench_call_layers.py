"""Where a 16-element call's time goes on the host: pydiff's layers against SlangPy's call.

    python benchmarks/bench_call_layers.py            # or --device cuda

Runs bench_core's per-call case (the polynomial on 16 floats, forward into a given result,
a new result each call, and ``.bwds``), and the float3 ``shade`` of bench_generated on 16
elements (pydiff.planned_vector's kernels), ``.bwds`` with a data input (no gradient
buffers), and a 4x4 stencil over ``spy.grid``, past
the point where its call plans dispatch pydiff's generated kernels, and times the calling
thread's CPU (``time.thread_time``) per call with pydiff's layers replaced one at a time by
no-ops: the whole call; without the dispatch (pydiff's Python above it); without recording
(pydiff's Python up to the native calls). Then raw SlangPy's call, and a raw dispatch of an
empty kernel against one binding one buffer (the binding cost every dispatch pays: on
lavapipe a descriptor set, mapped and unmapped per dispatch). Timings only; medians of 5.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import slangpy as spy

import pydiff

SOURCE = Path(__file__).resolve().parent.parent / "samples" / "polynomial.slang"
EMPTY = """
[shader("compute")][numthreads(64, 1, 1)]
void bench_empty(uint3 t: SV_DispatchThreadID) {}
[shader("compute")][numthreads(64, 1, 1)]
void bench_one(uint3 t: SV_DispatchThreadID, RWStructuredBuffer<float> a) { a[t.x] = 1; }
"""
SHADE = """
[Differentiable] float3 shade(float3 n, float3 l, float k)
{ return k * max(dot(n, l), 0.0) * n + 0.1 * l; }
"""


def shade_cases(dev: pydiff.Device) -> dict:
    """The float3 function of bench_generated (planned_vector's kernels) on 16 elements:
    forward into a result given, and ``.bwds``, against raw SlangPy's."""
    m = pydiff.load_module_from_source("bench_layers_shade", SHADE, device=dev)
    raw = spy.Module.load_from_source(dev.native, "bench_layers_shade_raw", SHADE)
    rng = np.random.default_rng(0)
    ns, ls = (rng.standard_normal((16, 3)).astype(np.float32) for _ in range(2))
    pn, pl = (pydiff.tensor(a, device=dev, dtype="float3", requires_grad=True) for a in (ns, ls))
    py = pydiff.zeros((16,), device=dev, dtype="float3").with_grads(ones=True)
    natives = []
    for a in (ns, ls, np.zeros((16, 3), np.float32)):
        t = spy.Tensor.empty(dev.native, (16,), dev.dtype("float3"))
        t.copy_from_numpy(a)
        natives.append(t.with_grads(zero=True))
    rn, rl, ry = natives
    ry.grad_in.copy_from_numpy(np.ones((16, 3), np.float32))
    return {
        "shade forward": (
            lambda: m.shade(pn, pl, 0.5, _result=py),
            lambda: raw.shade(rn, rl, 0.5, _result=ry),
        ),
        "shade .bwds": (
            lambda: m.shade.bwds(pn, pl, 0.5, _result=py),
            lambda: raw.shade.bwds(rn, rl, 0.5, _result=ry),
        ),
    }


GRID = """import slangpy;
[Differentiable]
void blur(int2 px, IDiffTensor<float, 2> img, IWDiffTensor<float, 2> result)
{
    int h = int(img.shape[0]);
    int r = px.y;
    int c = px.x;
    result[r, c] = 0.75 * img[r, c] + 0.25 * img[min(r + 1, h - 1), c];
}
"""


DATA = """
[Differentiable] float affine_data(float a, float b, float x, float y) { return a * x * y + b * y; }
"""


def data_cases(dev: pydiff.Device) -> dict:
    """``.bwds`` with a data input: x with gradients, y without (a plan since the nineteenth
    session; the general path before), against raw SlangPy's with y a plain tensor."""
    m = pydiff.load_module_from_source("bench_layers_data", DATA, device=dev)
    raw = spy.Module.load_from_source(dev.native, "bench_layers_data_raw", DATA)
    xs = np.linspace(-1, 1, 16).astype(np.float32)
    px = pydiff.tensor(xs, device=dev, requires_grad=True)
    py = pydiff.tensor(xs, device=dev)
    po = pydiff.zeros((16,), device=dev).with_grads(ones=True)
    rx = spy.Tensor.from_numpy(dev.native, xs).with_grads(zero=True)
    ry = spy.Tensor.from_numpy(dev.native, xs)
    ro = spy.Tensor.zeros(dev.native, (16,), "float").with_grads(zero=True)
    ro.grad_in.copy_from_numpy(np.ones(16, np.float32))
    return {
        ".bwds, data y": (
            lambda: m.affine_data.bwds(1.5, 0.5, px, py, _result=po),
            lambda: raw.affine_data.bwds(1.5, 0.5, rx, ry, _result=ro),
        )
    }


def grid_cases(dev: pydiff.Device) -> dict:
    """A small stencil over ``spy.grid((4, 4))`` (SlangPy's differentiable-tensor pattern):
    the forward (a call plan since the seventeenth session), ``.bwds`` (one since the
    eighteenth) and a step on a tape (a new output, the call, ``tape.backward``) against raw
    SlangPy's forward and ``.bwds``."""
    m = pydiff.load_module_from_source("bench_layers_grid", GRID, device=dev)
    raw = spy.Module.load_from_source(dev.native, "bench_layers_grid_raw", GRID)
    values = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
    img = pydiff.tensor(values, device=dev, requires_grad=True)
    out = pydiff.zeros((4, 4), device=dev).with_grads(ones=True)
    rimg = spy.Tensor.from_numpy(dev.native, values).with_grads(zero=True)
    rout = spy.Tensor.zeros(dev.native, (4, 4), "float").with_grads(zero=True)
    g = spy.grid((4, 4))
    seed = np.ones((4, 4), np.float32)

    def tape_step() -> None:  # a training step's shape: a new output, the tape, its backward
        y = pydiff.zeros((4, 4), device=dev)
        with pydiff.Tape() as tape:
            m.blur(g, img, y)
        tape.backward(y, grad=seed)

    def raw_step() -> None:
        raw.blur(g, rimg, rout)
        raw.blur.bwds(g, rimg, rout)

    return {
        "grid forward": (lambda: m.blur(g, img, out), lambda: raw.blur(g, rimg, rout)),
        "grid .bwds": (lambda: m.blur.bwds(g, img, out), lambda: raw.blur.bwds(g, rimg, rout)),
        "grid tape step": (tape_step, raw_step),
    }


def per_call(dev: pydiff.Device, fn, calls: int) -> float:
    """Median over 5 rounds of the calling thread's CPU time per call, in us."""
    rounds = []
    for _ in range(5):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        rounds.append((time.thread_time() - start) / calls * 1e6)
        dev.native.wait_for_idle()
    return statistics.median(rounds)


def record_cost(dev: pydiff.Device, entry: str, calls: int) -> float:
    """CPU time per dispatch of a raw SlangPy kernel recorded into one pass, in us."""
    native = dev.native
    module = native.load_module_from_source("bench_call_layers", EMPTY)
    program = native.link_program([module], [module.entry_point(entry)])
    kernel = native.create_compute_kernel(program)
    root = native.create_root_shader_object(program)
    if entry == "bench_one":
        usage = spy.BufferUsage.unordered_access | spy.BufferUsage.shader_resource
        buffer = native.create_buffer(size=4096, usage=usage)
        spy.ShaderCursor(root).find_entry_point(0)["a"] = buffer
    rounds = []
    for _ in range(5):
        encoder = native.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute.bind_pipeline(kernel.pipeline, root)
        start = time.thread_time()
        for _ in range(calls):
            compute.dispatch([64, 1, 1])
        rounds.append((time.thread_time() - start) / calls * 1e6)
        compute.end()
        native.submit_command_buffer(encoder.finish())
        native.wait_for_idle()
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calls", type=int, default=5000, help="calls per round")
    args = ap.parse_args()
    dev = pydiff.create_device(args.device)
    m = pydiff.load_module(SOURCE, device=dev)
    raw = spy.Module.load_from_file(dev.native, str(SOURCE))
    xs = np.linspace(-1, 1, 16).astype(np.float32)
    px = pydiff.tensor(xs, device=dev, requires_grad=True)
    py = pydiff.zeros((16,), device=dev).with_grads(ones=True)
    rx = spy.Tensor.from_numpy(dev.native, xs).with_grads(zero=True)
    ry = spy.Tensor.zeros(dev.native, (16,), "float").with_grads(zero=True)
    cases = {
        "forward": (
            lambda: m.polynomial(2.0, 8.0, -1.0, px, _result=py),
            lambda: raw.polynomial(2.0, 8.0, -1.0, rx, _result=ry),
        ),
        ".bwds": (
            lambda: m.polynomial.bwds(2.0, 8.0, -1.0, px, _result=py),
            lambda: raw.polynomial.bwds(2.0, 8.0, -1.0, rx, _result=ry),
        ),
        "new y": (  # y = m.f(...): a new result each call
            lambda: m.polynomial(2.0, 8.0, -1.0, px),
            lambda: raw.polynomial(2.0, 8.0, -1.0, rx),
        ),
        **shade_cases(dev),
        **data_cases(dev),
        **grid_cases(dev),
    }
    for ours, theirs in cases.values():
        for _ in range(1200):  # past generated_switch.PLANNED_AFTER (lavapipe's 1000)
            ours()
            theirs()
    before = dict(pydiff.generated.stats())
    kernels = dev.kernels
    rows = {name: {} for name in cases}
    for name, (ours, theirs) in cases.items():
        rows[name]["pydiff, whole call"] = per_call(dev, ours, args.calls)
        rows[name]["raw SlangPy call"] = per_call(dev, theirs, args.calls)
    took = {k: v - before.get(k, 0) for k, v in pydiff.generated.stats().items()}
    kernels.dispatch_split = lambda *a, **k: None  # (an instance attribute: the method hidden)
    for name, (ours, _) in cases.items():
        rows[name]["pydiff, no dispatch (Python above it)"] = per_call(dev, ours, args.calls)
    del kernels.dispatch_split
    kernels._record = lambda *a, **k: None
    for name, (ours, _) in cases.items():
        rows[name]["pydiff, nothing recorded (Python only)"] = per_call(dev, ours, args.calls)
    del kernels._record
    print(f"device: {dev.native.info.adapter_name}")
    print(f"generated kernels dispatched while timing the whole calls: {took or 'none'}")
    print("calling thread's CPU time per call (median of 5 rounds):")
    for name, row in rows.items():
        for label, us in row.items():
            print(f"  {name:14s} {label:42s} {us:6.1f} us")
        native = row["pydiff, whole call"] - row["pydiff, nothing recorded (Python only)"]
        print(f"  {name:14s} {'-> native recording and submission':42s} {native:6.1f} us")
        ratio = row["pydiff, whole call"] / row["raw SlangPy call"]
        print(f"  {name:14s} {'-> whole call / raw SlangPy call':42s} {ratio:6.2f}x")
    empty = record_cost(dev, "bench_empty", args.calls)
    one = record_cost(dev, "bench_one", args.calls)
    print(f"raw dispatch, empty kernel: {empty:.1f} us; binding one buffer: {one:.1f} us")


if __name__ == "__main__":
    main()
