"""What one small dispatch costs the host on a device, submission included, recorded each way
pydiff or SlangPy may record it: a command buffer per dispatch, batches of 256 (a compute pass
each, or one pass), SlangPy's ``kernel.dispatch``, and raw SlangPy's function call.

    python benchmarks/bench_dispatch_modes.py --device cuda

A 16-thread kernel with two buffers and two float uniforms as entry-point parameters, its
shader object bound once (uniforms set again per dispatch where the row says so). Wall time
per dispatch, the device idle at the end of each round (medians of 5 rounds). Timings only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import slangpy as spy

import pydiff

SOURCE = """
[shader("compute")][numthreads(64, 1, 1)]
void probe(uint3 t: SV_DispatchThreadID, uniform RWStructuredBuffer<float> y,
           uniform StructuredBuffer<float> x, uniform float a, uniform float b)
{ if (t.x < 16) y[t.x] = a * x[t.x] + b; }
"""
FN = "[Differentiable] float probe_fn(float a, float b, float x) { return a * x + b; }"


def timed(run, calls: int, native) -> float:
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        run(calls)
        native.wait_for_idle()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calls", type=int, default=4096)
    args = ap.parse_args()
    dev = pydiff.create_device(args.device)
    native = dev.native
    module = native.load_module_from_source("bench_dispatch_modes", SOURCE)
    program = native.link_program([module], [module.entry_point("probe")])
    kernel = native.create_compute_kernel(program)
    usage = spy.BufferUsage.unordered_access | spy.BufferUsage.shader_resource
    y = native.create_buffer(size=64, usage=usage)
    x = native.create_buffer(size=64, usage=usage, data=np.ones(16, np.float32))
    root = native.create_root_shader_object(program)
    cursor = spy.ShaderCursor(root).find_entry_point(0)
    cursor["y"], cursor["x"], cursor["a"], cursor["b"] = y, x, 2.0, 1.0

    def each(n, set_uniform=False):
        for i in range(n):
            enc = native.create_command_encoder()
            compute = enc.begin_compute_pass()
            if set_uniform:
                cursor["a"] = float(i & 7)
            compute.bind_pipeline(kernel.pipeline, root)
            compute.dispatch([16, 1, 1])
            compute.end()
            native.submit_command_buffer(enc.finish())

    def batched(n, one_pass=False, set_uniform=False, per=256):
        for start in range(0, n, per):
            enc = native.create_command_encoder()
            compute = enc.begin_compute_pass() if one_pass else None
            for i in range(min(per, n - start)):
                c = compute or enc.begin_compute_pass()
                if set_uniform:
                    cursor["a"] = float(i & 7)
                c.bind_pipeline(kernel.pipeline, root)
                c.dispatch([16, 1, 1])
                if not one_pass:
                    c.end()
            if one_pass:
                compute.end()
            native.submit_command_buffer(enc.finish())

    def kernel_dispatch(n):
        for _ in range(n):
            kernel.dispatch([16, 1, 1], y=y, x=x, a=2.0, b=1.0)

    def kernel_dispatch_batched(n, per=256):
        for start in range(0, n, per):
            enc = native.create_command_encoder()
            for _ in range(min(per, n - start)):
                kernel.dispatch([16, 1, 1], command_encoder=enc, y=y, x=x, a=2.0, b=1.0)
            native.submit_command_buffer(enc.finish())

    fn = spy.Module.load_from_source(native, "bench_dispatch_modes_fn", FN).probe_fn
    tx = spy.Tensor.from_numpy(native, np.ones(16, np.float32))
    ty = spy.Tensor.zeros(native, (16,), "float")

    def slangpy_call(n):
        for _ in range(n):
            fn(2.0, 1.0, tx, _result=ty)

    def slangpy_append(n, per=256):
        for start in range(0, n, per):
            enc = native.create_command_encoder()
            for _ in range(min(per, n - start)):
                fn.append_to(enc, 2.0, 1.0, tx, _result=ty)
            native.submit_command_buffer(enc.finish())

    rows = {
        "command buffer per dispatch": each,
        "  the same, a uniform set per dispatch": lambda n: each(n, True),
        "256 per command buffer, a pass each": batched,
        "  the same, a uniform set each time": lambda n: batched(n, set_uniform=True),
        "256 in one compute pass": lambda n: batched(n, one_pass=True),
        "256 per command buffer, 32 each": lambda n: batched(n, per=32),
        "kernel.dispatch (SlangPy), each": kernel_dispatch,
        "kernel.dispatch, 256 per buffer": kernel_dispatch_batched,
        "raw SlangPy call": slangpy_call,
        "raw SlangPy append_to, 256 per buffer": slangpy_append,
    }
    print(f"device: {dev.type} ({dev.adapter_name}); wall per dispatch, median of 5")
    for name, run in rows.items():
        run(64)
        native.wait_for_idle()
        print(f"  {name:42s} {timed(run, args.calls, native):7.2f} us")


if __name__ == "__main__":
    main()
