"""A physics-informed network solving u''(x) = -pi^2 sin(pi x), u(0) = u(1) = 0 (exact: sin(pi x)).

    python samples/pinn_poisson.py [--steps 2000] [--plot pinn_poisson.png]

Second derivatives in x: pydiff.hvp (Slang's fwd_diff then bwd_diff of the network) checks
the residual's hand-written u'' before training; reverse mode (.bwds on the tape) gives the
parameter gradients of the residual loss; AdamW updates them. Prints the largest error
against the exact solution and saves solution vs exact as a PNG (matplotlib, if installed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import pydiff
from pydiff import ops, optim

try:
    from tqdm import trange
except ImportError:
    trange = None

HIDDEN = 32  # H in pinn_poisson.slang


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--points", type=int, default=64)
    ap.add_argument(
        "--plot", default="pinn_poisson.png", help="PNG of solution vs exact ('' to skip)"
    )
    args = ap.parse_args()
    m = pydiff.load_module(Path(__file__).with_name("pinn_poisson.slang"))
    rng = np.random.default_rng(0)
    a, w, b = (
        pydiff.tensor(rng.standard_normal(HIDDEN).astype(np.float32) * s, requires_grad=True)
        for s in (0.1, 3.0, 1.0)
    )

    # The residual's u'' (written out) against Slang's own second derivative, by HVP.
    probe = pydiff.tensor(np.linspace(0.05, 0.95, 7).astype(np.float32))
    by_hand = m.net_xx(probe, a, w, b, _result="numpy")
    by_hvp = pydiff.hvp(m.net, (probe, a, w, b), (np.ones(7), None, None, None))[0].numpy()
    print(f"u'' written out vs pydiff.hvp: max difference {np.max(np.abs(by_hand - by_hvp)):.2e}")

    x_np = (np.arange(args.points) + 0.5) / args.points
    x = pydiff.tensor(x_np.astype(np.float32))
    f = pydiff.tensor((-(np.pi**2) * np.sin(np.pi * x_np)).astype(np.float32))
    opt = optim.AdamW([a, w, b], lr=1e-2, weight_decay=0.0)
    steps = trange(args.steps, desc="training") if trange else range(args.steps)
    for step in steps:
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.mean(m.residual_sq(x, a, w, b, f, _result="tensor"))
        tape.backward(loss)
        opt.step()
        if trange and step % 100 == 0:
            steps.set_postfix(residual=f"{loss.item():.2e}")

    x_test = np.linspace(0, 1, 201)
    u = m.net(pydiff.tensor(x_test.astype(np.float32)), a, w, b, _result="numpy")
    err = np.max(np.abs(u - np.sin(np.pi * x_test)))
    print(f"mean squared residual {loss.item():.3e}; max |u - sin(pi x)| on [0, 1] = {err:.2e}")
    if args.plot:
        from plotting import save_line_plot

        save_line_plot(
            args.plot,
            [
                (x_test, np.sin(np.pi * x_test), "k--", "exact sin(pi x)"),
                (x_test, u, "-", "pydiff PINN"),
            ],
            xlabel="x",
            title=f"u'' = -pi^2 sin(pi x); max error {err:.1e}",
        )


if __name__ == "__main__":
    main()
