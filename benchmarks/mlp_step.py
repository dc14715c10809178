"""The benchmarks' MLP training step: 256 x 64 x 64 x 10, linear + relu (fused) -> linear ->
cross_entropy on a tape, AdamW.

    layers, step = make_mlp_step(xb, yb)
    step()                       # one eager step; pydiff.capture(step) records it

The backward forgets the recording (``retain_graph=False``), as a training loop does: the
step's intermediates are then freed at once (docs/tape.md).
"""

from __future__ import annotations

import numpy as np

import pydiff
from pydiff import nn, ops, optim


def make_batch(seed: int = 0) -> tuple[pydiff.Tensor, pydiff.Tensor]:
    """The benchmarks' batch: 256 rows of 64 standard-normal inputs and their labels (0..9).

    >>> xb, yb = make_batch()
    """
    rng = np.random.default_rng(seed)
    xb = pydiff.tensor(rng.standard_normal((256, 64)).astype(np.float32))
    return xb, pydiff.tensor(rng.integers(0, 10, 256).astype(np.int32))


def make_mlp_step(
    xb: pydiff.Tensor,
    yb: pydiff.Tensor,
    retain_graph: bool = False,
    widths: tuple[int, int, int] = (64, 64, 10),
):
    """Fresh layers (seeded) and an optimizer, and the function that runs one step on them;
    ``widths``: (inputs, hidden, classes)."""
    n_in, hidden, classes = widths
    layers = [
        nn.Linear(n_in, hidden, seed=0, activation="relu"),
        nn.Linear(hidden, classes, seed=1),
    ]
    opt = optim.AdamW([p for layer in layers for p in layer.parameters()], lr=1e-3)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss, retain_graph=retain_graph)
        opt.step()
        return loss

    return layers, step
