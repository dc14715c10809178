"""Fit y = a sin(b x) + c to noisy data with a tape over three Slang calls.

    python samples/fit_chain.py [--steps 300] [--plot fit.png]

Each step records model -> squared_error -> mean on a pydiff.Tape, runs tape.backward(loss)
and takes a gradient step on a, b, c. Prints progress and the fitted parameters; with
matplotlib installed, saves a plot of data and fit.
"""

import argparse
from pathlib import Path

import numpy as np

import pydiff

try:
    from tqdm import trange
except ImportError:  # tqdm is optional
    trange = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--plot", default="fit_chain.png", help="PNG to write ('' to skip)")
    args = ap.parse_args()

    m = pydiff.load_module(Path(__file__).parent / "fit.slang")
    rng = np.random.default_rng(0)
    xs = np.linspace(-3, 3, 256).astype(np.float32)
    truth = (1.5, 1.2, 0.3)
    ys = (truth[0] * np.sin(truth[1] * xs) + truth[2] + rng.normal(0, 0.05, xs.size)).astype(
        np.float32
    )
    x, y = pydiff.tensor(xs), pydiff.tensor(ys)
    params = {
        name: pydiff.tensor([v], requires_grad=True) for name, v in zip("abc", (1.0, 1.0, 0.0))
    }
    pydiff.set_zero_policy("reset")  # each backward starts the parameter gradients from zero

    steps = trange(args.steps, desc="fitting") if trange else range(args.steps)
    for step in steps:
        with pydiff.Tape() as tape:
            pred = m.model(params["a"], params["b"], params["c"], x, _result="tensor")
            err = m.squared_error(pred, y, _result="tensor")
            loss = m.mean(err, _result="tensor")
        tape.backward(loss)
        for p in params.values():
            p.copy_from_numpy(p.numpy() - args.lr * p.grad.numpy())
        if trange is None and step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.5f}")
        elif trange is not None:
            steps.set_postfix(loss=f"{loss.item():.5f}")

    fitted = {k: p.item() for k, p in params.items()}
    print(f"final loss {loss.item():.5f}")
    print("fitted a, b, c =", ", ".join(f"{fitted[k]:.3f}" for k in "abc"), " truth:", truth)
    if args.plot:
        from plotting import save_line_plot

        save_line_plot(
            args.plot,
            [(xs, ys, ".", "data"), (xs, pred.numpy(), "r-", "fit (pydiff tape)")],
            xlabel="x",
            size=(6, 3.5),
        )


if __name__ == "__main__":
    main()
