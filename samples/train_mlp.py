"""Train an MLP (linear -> relu -> linear -> cross_entropy, AdamW) with pydiff.

    python samples/train_mlp.py [--epochs 30] [--plot loss.png] [--no-capture]

Uses scikit-learn's bundled handwritten-digits set (8x8 images, 10 classes) when
scikit-learn is installed (`pip install scikit-learn`); otherwise a generated 3-class
spiral. Prints a progress bar (tqdm, if installed), the final test accuracy, and saves the
loss curve as a PNG (matplotlib, if installed).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import pydiff
from pydiff import nn, ops, optim

try:
    from tqdm import trange
except ImportError:
    trange = None


def load_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test, name): digits if available, else a spiral."""
    rng = np.random.default_rng(seed)
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y, name = digits.data / 16.0, digits.target, "handwritten digits (scikit-learn)"
    except ImportError:
        n, classes = 300, 3
        t = rng.uniform(0, 1, n * classes)
        cls = np.repeat(np.arange(classes), n)
        r = t * 1.0
        angle = t * 4.0 + cls * 2 * np.pi / classes + rng.normal(0, 0.15, t.size)
        x = np.stack([r * np.sin(angle), r * np.cos(angle)], 1)
        y, name = cls, "generated 3-class spiral"
    order = rng.permutation(len(y))
    x, y = x[order].astype(np.float32), y[order].astype(np.int32)
    split = int(0.8 * len(y))
    return x[:split], y[:split], x[split:], y[split:], name


def accuracy(layers, x, y) -> float:
    logits = layers[1](layers[0](pydiff.tensor(x)))
    return float(np.mean(np.argmax(logits.numpy(), axis=1) == y))


def train(
    epochs: int = 30,
    batch: int = 64,
    hidden: int = 64,
    lr: float = 1e-2,
    seed: int = 0,
    progress: bool = True,
    capture: bool = True,
):
    x_tr, y_tr, x_te, y_te, name = load_data(seed)
    # Zero features up to a multiple of 4 (they change nothing): the fast linear kernels,
    # which a capture records, take those; the spiral has 2 (the digits 64).
    pad = ((0, 0), (0, -x_tr.shape[1] % 4))
    x_tr, x_te = np.pad(x_tr, pad), np.pad(x_te, pad)
    classes = int(y_tr.max()) + 1
    # The hidden layer's relu runs inside its linear kernels (forward and backward).
    layers = [
        nn.Linear(x_tr.shape[1], hidden, seed=seed, activation="relu"),
        nn.Linear(hidden, classes, seed=seed + 1),
    ]
    opt = optim.AdamW([p for layer in layers for p in layer.parameters()], lr=lr, weight_decay=1e-4)
    # One batch's tensors on the device; each step copies the next batch into them.
    xb = pydiff.empty((batch, x_tr.shape[1]))
    yb = pydiff.empty((batch,), dtype="int")

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        # One backward per recording: forgetting it frees the step's tensors at once.
        tape.backward(loss, retain_graph=False)
        opt.step()
        return loss

    # After one ordinary step (it creates AdamW's state), the next is captured and the rest
    # replay its kernels: no Python per op (pydiff.capture; docs/capture.md).
    replay = None
    rng = np.random.default_rng(seed)
    losses = []
    epochs_iter = trange(epochs, desc="training") if (trange and progress) else range(epochs)
    for epoch in epochs_iter:
        order = rng.permutation(len(y_tr))
        epoch_loss = []
        for start in range(0, len(order) - batch + 1, batch):
            idx = order[start : start + batch]
            xb.copy_from_numpy(x_tr[idx])
            yb.copy_from_numpy(y_tr[idx])
            if replay is not None:
                loss = replay()
            elif capture and opt.step_count == 1:
                try:
                    captured = pydiff.capture(step)
                    loss, replay = captured.result, captured.replay
                except pydiff.CaptureError as why:  # e.g. a device without pydiff's own kernels
                    print(f"(not captured: {why})")
                    capture, loss = False, step()
            else:
                loss = step()
            epoch_loss.append(loss.item())
        losses.append(float(np.mean(epoch_loss)))
        if trange and progress:
            epochs_iter.set_postfix(loss=f"{losses[-1]:.4f}")
        elif progress:
            print(f"epoch {epoch + 1:3d}/{epochs}  loss {losses[-1]:.4f}")
    return layers, losses, accuracy(layers, x_te, y_te), name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument(
        "--plot", default="train_mlp_loss.png", help="PNG for the loss curve ('' to skip)"
    )
    ap.add_argument(
        "--no-capture", action="store_true", help="run every step eagerly (no pydiff.capture)"
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    layers, losses, acc, name = train(args.epochs, capture=not args.no_capture)
    print(f"trained in {time.perf_counter() - t0:.1f} s")
    print(f"data: {name}")
    print(f"final training loss {losses[-1]:.4f}; test accuracy {acc * 100:.1f}%")
    if args.plot:
        from plotting import save_line_plot

        save_line_plot(
            args.plot,
            [(range(1, len(losses) + 1), losses, "-", None)],
            xlabel="epoch",
            ylabel="cross-entropy",
            title=f"pydiff MLP on {name}",
        )


if __name__ == "__main__":
    main()
