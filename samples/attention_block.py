"""Fit a small pre-norm attention block (layer_norm -> attention -> SiLU&Mul MLP) to a teacher.

    python samples/attention_block.py [--steps 150]

A "student" block with random weights learns to reproduce the outputs of a "teacher" block
with other random weights on a fixed sequence, with AdamW. Before training, pydiff.gradcheck
compares the block's gradients (every op's hand-written backward) with float64 central
finite differences. Shows pydiff.ops.layer_norm, attention, silu_and_mul, linear, mse_loss.
"""

from __future__ import annotations

import argparse

import numpy as np

import pydiff
from pydiff import ops, optim

try:
    from tqdm import trange
except ImportError:
    trange = None


def make_weights(d: int, hidden: int, seed: int) -> dict[str, pydiff.Tensor]:
    rng = np.random.default_rng(seed)
    shapes = {
        "ln_w": (d,),
        "ln_b": (d,),
        "wq": (d, d),
        "wk": (d, d),
        "wv": (d, d),
        "w_up": (2 * hidden, d),
        "w_down": (d, hidden),
    }
    weights = {}
    for name, shape in shapes.items():
        init = (
            1.0 + 0.1 * rng.standard_normal(shape)
            if name == "ln_w"
            else rng.standard_normal(shape) / np.sqrt(shape[-1])
        )
        weights[name] = pydiff.tensor(init.astype(np.float32), requires_grad=True)
    return weights


def block(x: pydiff.Tensor, w: dict[str, pydiff.Tensor]) -> pydiff.Tensor:
    h = ops.layer_norm(x, w["ln_w"], w["ln_b"])
    a = ops.attention(ops.linear(h, w["wq"]), ops.linear(h, w["wk"]), ops.linear(h, w["wv"]))
    return ops.linear(ops.silu_and_mul(ops.linear(a, w["w_up"])), w["w_down"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dim", type=int, default=8)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = pydiff.tensor(rng.standard_normal((args.tokens, args.dim)).astype(np.float32))
    teacher, student = make_weights(args.dim, 16, seed=1), make_weights(args.dim, 16, seed=2)
    target = block(x, teacher).detach()

    # Every weight's gradient against float64 finite differences (small copy of the problem).
    small = pydiff.tensor(x.numpy()[:4])
    ok = pydiff.gradcheck(
        lambda ln_w, wq, w_up: block(small, {**student, "ln_w": ln_w, "wq": wq, "w_up": w_up}),
        (student["ln_w"], student["wq"], student["w_up"]),
    )
    print(f"gradcheck of the block (layer_norm, attention, silu_and_mul, linear): {ok}")

    opt = optim.AdamW(list(student.values()), lr=3e-2, weight_decay=0.0)
    steps = trange(args.steps, desc="fitting") if trange else range(args.steps)
    losses = []
    for _ in steps:
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.mse_loss(block(x, student), target)
        tape.backward(loss)
        opt.step()
        losses.append(loss.item())
    print(f"mse to the teacher: {losses[0]:.4f} at step 1 -> {losses[-1]:.5f} at step {args.steps}")


if __name__ == "__main__":
    main()
