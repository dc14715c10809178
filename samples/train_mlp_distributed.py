"""Train samples/train_mlp.py's MLP data-parallel over torch.distributed (gloo), with pydiff.

    torchrun --nproc_per_node 2 samples/train_mlp_distributed.py [--epochs 30]
    python samples/train_mlp_distributed.py [--nproc 2] [--epochs 30]   # spawns the ranks

Each rank opens its own device, takes rank 0's initial parameters (broadcast), trains on its
share of every batch (ShardedLoader: --batch samples per step in all, split over the ranks)
and all-reduces the gradients (their mean) before each AdamW step, so all ranks step alike.
Run directly, it first trains the same model in one process over the whole batches, then
spawns --nproc ranks, and prints both test accuracies and whether the ranks' parameters are
bit-identical. Needs torch (pip install 'pydiff[torch]').
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import time

import numpy as np

import pydiff
from pydiff import distributed as dist
from pydiff import nn, ops, optim
from train_mlp import accuracy, load_data


def train(rank: int, world: int, epochs: int, batch: int, capture: bool = True, seed: int = 0):
    """Train on this rank's shards; returns (layers, test accuracy, seconds per step)."""
    x_tr, y_tr, x_te, y_te, name = load_data(seed)
    # Zero features up to a multiple of 4: the fast linear kernels (which a capture records)
    # take those; the spiral has 2.
    pad = ((0, 0), (0, -x_tr.shape[1] % 4))
    x_tr, x_te = np.pad(x_tr, pad), np.pad(x_te, pad)
    if batch % world:
        raise SystemExit(f"--batch {batch} does not split over {world} ranks")
    layers = [
        nn.Linear(x_tr.shape[1], 64, seed=seed, activation="relu"),
        nn.Linear(64, int(y_tr.max()) + 1, seed=seed + 1),
    ]
    params = [p for layer in layers for p in layer.parameters()]
    if world > 1:
        dist.broadcast(params)  # every rank starts from rank 0's parameters
    opt = optim.AdamW(params, lr=1e-2, weight_decay=1e-4)
    shard = batch // world
    loader = dist.ShardedLoader(
        x_tr, y_tr, batch_size=shard, seed=seed, rank=rank, world_size=world
    )
    xb, yb = pydiff.empty((shard, x_tr.shape[1])), pydiff.empty((shard,), dtype="int")

    def forward_backward():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss)
        return loss

    # After one ordinary step (it creates AdamW's state) the forward-backward and the
    # optimizer step are captured apart; the all-reduce runs between their replays.
    fwd_bwd = update = None
    steps, start = 0, time.perf_counter()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            xb.copy_from_numpy(x)
            yb.copy_from_numpy(y)
            if fwd_bwd is not None:
                fwd_bwd.replay()
            elif capture and steps == 1:
                try:
                    fwd_bwd = pydiff.capture(forward_backward)
                except pydiff.CaptureError as why:  # e.g. 2 input features: not captured
                    if rank == 0:
                        print(f"(not captured: {str(why)[:90]}...)")
                    capture = False
                    forward_backward()
            else:
                forward_backward()
            if world > 1:
                dist.all_reduce_grads(params, op="mean")
            if update is not None:
                update.replay()
            elif fwd_bwd is not None:
                update = pydiff.capture(opt.step)
            else:
                opt.step()
            steps += 1
    seconds = (time.perf_counter() - start) / max(steps, 1)
    return layers, accuracy(layers, x_te, y_te), seconds, name


def digest(layers) -> str:
    """A hash of the parameters' bits."""
    h = hashlib.sha256()
    for layer in layers:
        for p in layer.parameters():
            h.update(p.numpy().tobytes())
    return h.hexdigest()[:16]


def rank_main(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank: joins the process group, trains, compares the parameters' hashes."""
    import torch.distributed

    pydiff.set_default_device(pydiff.create_device(args.device))
    dist.init_process_group("gloo", timeout=args.timeout, rank=rank, world_size=world)
    layers, acc, seconds, name = train(rank, world, args.epochs, args.batch, not args.no_capture)
    hashes = [None] * world
    torch.distributed.all_gather_object(hashes, digest(layers))
    if rank == 0:
        print(f"{world} processes: test accuracy {acc * 100:.1f}% ({seconds * 1e3:.2f} ms/step)")
        same = all(h == hashes[0] for h in hashes)
        print(f"ranks bit-identical after training: {same} (parameter hashes {hashes})")
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="samples per step, all ranks together")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits for peers")
    ap.add_argument("--device", default="vulkan")
    ap.add_argument("--no-capture", action="store_true")
    args = ap.parse_args()
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    import torch.multiprocessing as mp

    pydiff.set_default_device(pydiff.create_device(args.device))
    layers, acc, seconds, name = train(0, 1, args.epochs, args.batch, not args.no_capture)
    print(f"data: {name}")
    print(f"1 process: test accuracy {acc * 100:.1f}% ({seconds * 1e3:.2f} ms/step)")
    with socket.socket() as s:  # a free port on loopback for the process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(rank_main, args=(args.nproc, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
