"""A 256 x 64 x 64 x 10 MLP training step and the fused AdamW step, against NumPy/PyTorch.

python benchmarks/bench_train.py [--params 10000000]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import pydiff
from pydiff import nn, ops, optim

from timing import best_of, describe, interleaved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=15, help="alternating timing rounds of 20 steps")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="PyTorch's threads (default: as many as lavapipe computes on: 1 when inline)",
    )
    args = ap.parse_args()
    dev = pydiff.default_device()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((256, 64)).astype(np.float32)
    Y = rng.integers(0, 10, 256)

    xb = pydiff.tensor(X)
    yb = pydiff.tensor(Y.astype(np.int32))  # data on the device once, as in a training loop

    def make_step():
        layers = [
            nn.Linear(64, 64, seed=0, activation="relu"),
            nn.Linear(64, 10, seed=1),
        ]  # relu fused
        opt = optim.AdamW([p for layer in layers for p in layer.parameters()], lr=1e-3)

        def step():
            opt.zero_grad()
            with pydiff.Tape() as tape:
                loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
            tape.backward(loss)
            opt.step()
            return loss

        return layers, step

    layers, eager_step = make_step()
    _, step_to_capture = make_step()
    step_to_capture()  # the optimizer creates its state on its first step
    captured = pydiff.capture(step_to_capture)

    def pydiff_step():
        eager_step()
        dev.native.wait_for_idle()

    def pydiff_captured_step():
        captured.replay()
        dev.native.wait_for_idle()

    W1, b1 = layers[0].weight.numpy(), layers[0].bias.numpy()
    W2, b2 = layers[1].weight.numpy(), layers[1].bias.numpy()

    def numpy_step():  # forward + hand-derived backward + plain SGD update
        h = np.maximum(X @ W1.T + b1, 0)
        z = h @ W2.T + b2
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        dz = (p - np.eye(10, dtype=np.float32)[Y]) / 256
        dW2, db2 = dz.T @ h, dz.sum(0)
        dh = (dz @ W2) * (h > 0)
        dW1, db1 = dh.T @ X, dh.sum(0)
        for w, g in ((W1, dW1), (b1, db1), (W2, dW2), (b2, db2)):
            w -= 1e-3 * g

    contenders = {
        "pydiff": pydiff_step,
        "pydiff captured": pydiff_captured_step,
        "NumPy": numpy_step,
    }
    try:
        import torch

        threads = args.torch_threads
        if threads is None:
            lp = os.environ.get("LP_NUM_THREADS", "").strip()
            threads = 1 if lp == "0" else int(lp) if lp.isdigit() else os.cpu_count() or 1
        torch.set_num_threads(threads)  # the same thread count as pydiff's compute
        tl = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)]
        topt = torch.optim.AdamW([p for m in tl for p in m.parameters()], lr=1e-3)
        tx, ty = torch.from_numpy(X), torch.from_numpy(Y.astype(np.int64))

        def torch_step():
            topt.zero_grad()
            loss = torch.nn.functional.cross_entropy(tl[1](torch.relu(tl[0](tx))), ty)
            loss.backward()
            topt.step()

        contenders[f"PyTorch-CPU ({threads} thread{'s' if threads > 1 else ''})"] = torch_step
    except ImportError:
        pass
    # Alternating rounds: this class of machine (a shared VM) drifts 2x in speed over
    # seconds, which best-of timings of one contender after another turn into noise.
    steps = interleaved(contenders, rounds=args.rounds, inner=20)

    n = args.params
    p = pydiff.tensor(rng.standard_normal(n).astype(np.float32), requires_grad=True)
    p.grad.copy_from_numpy(rng.standard_normal(n).astype(np.float32))
    adam = optim.AdamW([p], lr=1e-3)

    def adam_step():
        adam.step()
        dev.native.wait_for_idle()

    t_adam = best_of(adam_step, 3)
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    # AdamW moves p, grad, m, v in and p, m, v out: 7 floats per parameter.
    moved = 7 * 4 * n
    t_copy = best_of(lambda: np.copyto(dst, src), 5)  # reads + writes 8 bytes per float
    gbs_adam, gbs_copy = moved / t_adam / 1e9, 8 * n / t_copy / 1e9

    print(f"device: {describe(dev)}")
    ours = {name: steps.pop(name) for name in ("pydiff", "pydiff captured")}
    print(
        f"MLP step 256x64x64x10 (median / best of {args.rounds} rounds of 20 steps, alternating):"
    )
    for name, (p_med, p_min) in ours.items():
        how = "pydiff.capture, replay()" if name.endswith("captured") else "eager: ops, Tape, AdamW"
        print(f"  {name} ({how}): {p_med * 1e3:.2f} / {p_min * 1e3:.2f} ms")
        for other, (o_med, o_min) in steps.items():
            print(
                f"    vs {other} {o_med * 1e3:.2f} / {o_min * 1e3:.2f} ms: "
                f"{p_med / o_med:.1f}x (median), {p_min / o_min:.1f}x (best)"
            )
    print(
        f"fused AdamW, {n / 1e6:.0f}M params: {t_adam * 1e3:.1f} ms = {gbs_adam:.1f} GB/s; "
        f"NumPy memcpy {gbs_copy:.1f} GB/s; ratio {gbs_adam / gbs_copy:.2f} of the copy bandwidth"
    )


if __name__ == "__main__":
    main()
