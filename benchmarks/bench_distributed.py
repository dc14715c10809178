"""Data-parallel scaling, 1 -> N processes on this machine (pydiff.distributed over gloo).

python benchmarks/bench_distributed.py [--nproc 2] [--width 512] [--batch 256] [--steps 40]

An MLP (64 -> width -> width -> 10, relu, cross_entropy, AdamW), the same global batch in
each run (strong scaling: each of N ranks computes batch / N samples), its forward-backward
and its optimizer step captured (pydiff.capture) and the gradients all-reduced between them.
Every process opens its own lavapipe device (one compute thread each, LP_NUM_THREADS=0 on
this 2-CPU machine: pydiff's default). Per step, rank 0's medians: the whole step, the
forward-backward, waiting for the slower rank (a barrier, timed apart), the all-reduce
(pydiff.distributed.all_reduce_grads: host round trip and gloo), the optimizer step; the
bytes all-reduced; the all-reduce's share of the step; gloo alone on a torch tensor of the
same bytes; pydiff's host round trip alone (all_reduce_grads in a group of one process).
Then the ratios N : 1 (step time, throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import pydiff
from pydiff import distributed as dist
from pydiff import nn, ops, optim

from timing import describe

IN, CLASSES = 64, 10


def run_rank(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    dev = pydiff.create_device("vulkan")
    pydiff.set_default_device(dev)
    if world > 1:
        dist.init_process_group("gloo", timeout=120.0, rank=rank, world_size=world)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 4, IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, len(x)).astype(np.int32)
    layers = [
        nn.Linear(IN, args.width, seed=0, activation="relu"),
        nn.Linear(args.width, args.width, seed=1, activation="relu"),
        nn.Linear(args.width, CLASSES, seed=2),
    ]
    params = [p for layer in layers for p in layer.parameters()]
    opt = optim.AdamW(params, lr=1e-3)
    shard = args.batch // world
    loader = dist.ShardedLoader(x, y, batch_size=shard, rank=rank, world_size=world)
    xb, yb = pydiff.empty((shard, IN)), pydiff.empty((shard,), dtype="int")

    def forward_backward():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            h = xb
            for layer in layers:
                h = layer(h)
            loss = ops.cross_entropy(h, yb)
        tape.backward(loss)
        return loss

    def batches():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    data = batches()
    if world > 1:
        import torch
        import torch.distributed

        barrier = torch.distributed.barrier
    xb.copy_from_numpy(x[:shard])
    yb.copy_from_numpy(y[:shard])
    forward_backward()
    opt.step()  # creates AdamW's state; then both halves are captured
    fwd_bwd, update = pydiff.capture(forward_backward), pydiff.capture(opt.step)
    times: dict[str, list[float]] = {
        "step": [],
        "fwd_bwd": [],
        "wait": [],
        "all_reduce": [],
        "update": [],
        "gloo": [],
        "round_trip": [],
    }
    sent = 0
    for k in range(args.warmup + args.steps):
        xs, ys = next(data)
        t0 = time.perf_counter()
        xb.copy_from_numpy(xs)
        yb.copy_from_numpy(ys)
        fwd_bwd.replay()
        dev.wait()
        t1 = time.perf_counter()
        if world > 1:
            barrier()  # waiting for the slower rank, apart from the all-reduce itself
        t1b = time.perf_counter()
        if world > 1:
            sent = dist.all_reduce_grads(params, check_layout=not args.no_check_layout)
        t2 = time.perf_counter()
        update.replay()
        dev.wait()
        t3 = time.perf_counter()
        if k >= args.warmup:
            for name, dt in (("step", t3 - t0), ("fwd_bwd", t1 - t0), ("all_reduce", t2 - t1b)):
                times[name].append(dt)
            times["wait"].append(t1b - t1)
            times["update"].append(t3 - t2)
    if world > 1:  # gloo alone on a torch tensor of the same bytes: pydiff's part is the rest
        flat = torch.zeros(sent // 4)
        for _ in range(args.warmup + args.steps):
            barrier()
            t0 = time.perf_counter()
            torch.distributed.all_reduce(flat)
            times["gloo"].append(time.perf_counter() - t0)
    if world == 1:  # pydiff's part alone: all_reduce_grads in a group of this process only
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        for _ in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            dist.all_reduce_grads(params)
            times["round_trip"].append(time.perf_counter() - t0)
        import torch.distributed

        torch.distributed.destroy_process_group()
    if rank == 0:
        medians = {name: statistics.median(v) if v else 0.0 for name, v in times.items()}
        medians["bytes"] = sent
        medians["params"] = sum(p.numel for p in params)
        medians["device"] = describe(dev)
        Path(out).write_text(json.dumps(medians))
    if world > 1:
        barrier()
        torch.distributed.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        if world == 1:
            run_rank(0, 1, args, out)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            mp.spawn(run_rank, args=(world, args, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256, help="global batch (all ranks)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--no-check-layout",
        action="store_true",
        help="all_reduce_grads(check_layout=False): without the ranks' agreement check",
    )
    args = ap.parse_args()
    one = measure(1, args)
    many = measure(args.nproc, args)
    print(f"device: {one['device']}; CPUs: {os.cpu_count()}")
    print(
        f"MLP {IN}-{args.width}-{args.width}-{CLASSES}: {one['params']:,} parameters, "
        f"global batch {args.batch}, medians of {args.steps} captured steps"
    )
    for world, r in ((1, one), (args.nproc, many)):
        share = r["all_reduce"] / r["step"]
        print(
            f"{world} process{'es' if world > 1 else ''}: step {r['step'] * 1e3:7.2f} ms "
            f"(forward-backward {r['fwd_bwd'] * 1e3:.2f}, waiting for the other rank "
            f"{r['wait'] * 1e3:.2f}, all-reduce {r['all_reduce'] * 1e3:.2f}, "
            f"optimizer {r['update'] * 1e3:.2f}); all-reduced {r['bytes'] / 1e6:.2f} MB/step; "
            f"all-reduce share {share * 100:.1f}%"
        )
    ratio = many["step"] / one["step"]
    print(
        f"{args.nproc} : 1 processes: step time {ratio:.2f}x, throughput (samples/s) "
        f"{1 / ratio:.2f}x (ideal {args.nproc:.0f}x on {args.nproc} free CPUs); all-reduce "
        f"{many['all_reduce'] * 1e3:.2f} ms for {many['bytes'] / 1e6:.2f} MB = "
        f"{many['bytes'] / many['all_reduce'] / 1e9:.2f} GB/s, of which gloo alone on a torch "
        f"tensor of those bytes {many['gloo'] * 1e3:.2f} ms and pydiff's host round trip (in a "
        f"group of one process) {one['round_trip'] * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
