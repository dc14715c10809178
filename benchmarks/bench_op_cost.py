"""The host cost of one eager op, against the floor under it: one linear + relu (256 x 64 ->
64, fused kernel) as a pydiff op, as a raw dispatch of the same compiled kernel, and as a
PyTorch-CPU op, in process CPU time (the kernel included: lavapipe runs it on its queue
thread) and in the calling thread's CPU time (the host work alone).

python benchmarks/bench_op_cost.py [--rounds 15] [--batch 20]

Rows: "pydiff op" = ops.linear(x, W, b, activation="relu") with ``batch`` ops per submission
(the deferred list; a training step submits once); "+ submit each" = a flush after every
op; "raw dispatch" = the same kernel, its shader object bound once (pydiff's cached object),
recorded and submitted directly through slang-rhi (``batch`` per submission), the floor of
any path through SlangPy; "SlangPy ComputeKernel.dispatch" = SlangPy's own keyword-binding
dispatch, one submission each; "kernel alone" = the raw dispatches' command lists replayed
(pydiff.capture: no Python per op).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_train import planned_threads

os.environ.setdefault("OPENBLAS_NUM_THREADS", str(planned_threads()))

import numpy as np  # noqa: E402
import slangpy as spy  # noqa: E402

import pydiff  # noqa: E402
from pydiff import ops  # noqa: E402
from timing import describe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=20, help="ops per submission")
    args = ap.parse_args()
    dev = pydiff.default_device()
    nat, n = dev.native, args.batch
    rng = np.random.default_rng(0)
    X = rng.standard_normal((256, 64)).astype(np.float32)
    W = rng.standard_normal((64, 64)).astype(np.float32)
    B = rng.standard_normal(64).astype(np.float32)
    x, w, b = (pydiff.tensor(a) for a in (X, W, B))
    # The kernel, thread count and bindings pydiff chooses for this op (seen once).
    seen: dict = {}
    dispatch = dev.kernels.dispatch

    def watch(kernel, threads, **bindings):
        seen.update(kernel=kernel, threads=threads, bindings=bindings)
        return dispatch(kernel, threads, **bindings)

    dev.kernels.dispatch = watch
    out = ops.linear(x, w, b, activation="relu")
    del dev.kernels.dispatch
    ref = np.maximum(X.astype(np.float64) @ W.T + B, 0)
    assert np.allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)
    kernel, threads, bindings = seen["kernel"], seen["threads"], seen["bindings"]
    root = nat.create_root_shader_object(kernel.program)  # bound once, as pydiff caches it
    cursor = spy.ShaderCursor(root).find_entry_point(0)
    for name, value in bindings.items():
        cursor[name] = value

    def pydiff_ops():
        for _ in range(n):
            ops.linear(x, w, b, activation="relu")
        dev.flush()

    def pydiff_submit_each():
        for _ in range(n):
            ops.linear(x, w, b, activation="relu")
            dev.flush()

    def record(encoder):
        compute = encoder.begin_compute_pass()
        compute.bind_pipeline(kernel.pipeline, root)
        compute.dispatch([threads, 1, 1])
        compute.end()

    def raw_dispatch():
        encoder = nat.create_command_encoder()
        for _ in range(n):
            record(encoder)
        nat.submit_command_buffer(encoder.finish())

    def slangpy_dispatch():
        for _ in range(n):
            kernel.dispatch([threads, 1, 1], **bindings)

    step = pydiff.capture(
        lambda: [dev.kernels.dispatch(kernel, threads, **bindings) for _ in range(n)]
    )

    contenders = {
        "pydiff op (deferred)": pydiff_ops,
        "pydiff op + submit each": pydiff_submit_each,
        "raw dispatch (bound object)": raw_dispatch,
        "SlangPy ComputeKernel.dispatch": slangpy_dispatch,
        "kernel alone (captured replay)": step.replay,
    }
    try:
        import torch

        torch.set_num_threads(planned_threads())
        tx, tw, tb = (torch.from_numpy(a) for a in (X, W, B))

        def torch_ops():
            for _ in range(n):
                torch.relu(torch.nn.functional.linear(tx, tw, tb))

        contenders[f"PyTorch-CPU ({torch.get_num_threads()} thread)"] = torch_ops
    except ImportError:
        pass
    times: dict[str, list] = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()
        nat.wait_for_idle()
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            nat.wait_for_idle()
            c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            fn()
            nat.wait_for_idle()
            times[name].append(
                (time.process_time() - c0, time.thread_time() - t0, time.perf_counter() - w0)
            )
    print(f"device: {describe(dev)}")
    print(
        f"one linear + relu, 256 x 64 -> 64, per op (medians of {args.rounds} rounds of {n} ops, "
        "alternating): process CPU / calling thread's CPU / wall, in us"
    )
    for name, t in times.items():
        proc, thread, wall = (statistics.median(r[i] for r in t) / n * 1e6 for i in range(3))
        print(f"  {name:34s} {proc:7.1f} / {thread:7.1f} / {wall:7.1f}")


if __name__ == "__main__":
    main()
