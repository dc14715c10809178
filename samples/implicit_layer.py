"""A deep-equilibrium layer: z* = tanh(z* W^T + x U^T + c), trained through pydiff.fixed_point.

python samples/implicit_layer.py [--steps 60] [--hidden 16] [--batch 64]

The layer's output is the fixed point z* of z = tanh(linear(z, W) + linear(x, U, c)) (a
contraction while ||W|| < 1), read out by y = linear(z*, V, d). pydiff.fixed_point solves it
by iteration and differentiates it implicitly: the backward solves the adjoint equation
(I - df/dz)^T lam = zbar by VJPs of f at z*, never storing or differentiating the iterations
(guide seed 002, section 10). The script first compares the gradients of the loss with float64
central finite differences of the whole solve (NumPy, an independent implementation), printing
both, then fits a smooth target function with Adam, W projected back to ||W||_2 <= 0.9 after
each step so that the map stays a contraction.
"""

import argparse

import numpy as np

import pydiff
from pydiff import ops


def layer(z, W, injection):
    """One step of the equilibrium map: tanh(z W^T + injection)."""
    return ops.tanh(ops.linear(z, W) + injection)


def model(params, x):
    W, U, c, V, d = params
    injection = ops.linear(x, U, c)  # recorded on the tape: U and c get gradients through it
    z = pydiff.fixed_point(layer, np.zeros((x.shape[0], W.shape[0])), W, injection, tol=1e-6)
    return ops.linear(z, V, d)


def loss_of(params, x, target):
    return ops.mse_loss(model(params, x), target)


def reference_loss(arrays, x, target):
    """The same loss in float64 NumPy, the fixed point iterated to convergence."""
    W, U, c, V, d = arrays
    injection = x @ U.T + c
    z = np.zeros((x.shape[0], W.shape[0]))
    for _ in range(10000):
        new = np.tanh(z @ W.T + injection)
        if np.max(np.abs(new - z)) < 1e-14:
            break
        z = new
    return float(np.mean((new @ V.T + d - target) ** 2))


def finite_differences(arrays, x, target, h=1e-6):
    grads = []
    for k, p in enumerate(arrays):
        g = np.zeros_like(p)
        for i in np.ndindex(p.shape):
            up = [a.copy() for a in arrays]
            down = [a.copy() for a in arrays]
            up[k][i] += h
            down[k][i] -= h
            g[i] = (reference_loss(up, x, target) - reference_loss(down, x, target)) / (2 * h)
        grads.append(g)
    return grads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.02)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    h = args.hidden
    x_np = rng.uniform(-1, 1, (args.batch, 2)).astype(np.float32)
    target_np = (np.sin(2 * x_np[:, :1]) * np.cos(x_np[:, 1:])).astype(np.float32)
    arrays = [
        (0.3 / np.sqrt(h) * rng.standard_normal((h, h))).astype(np.float32),  # W: ||W|| < 1
        rng.standard_normal((h, 2)).astype(np.float32),  # U
        (0.1 * rng.standard_normal(h)).astype(np.float32),  # c
        (rng.standard_normal((1, h)) / np.sqrt(h)).astype(np.float32),  # V
        np.zeros(1, np.float32),  # d
    ]
    params = [pydiff.tensor(a, requires_grad=True) for a in arrays]
    x, target = pydiff.tensor(x_np), pydiff.tensor(target_np)

    # 1. The implicit gradient against float64 finite differences of the whole solve.
    grads = pydiff.grad(lambda *p: loss_of(p, x, target), argnums=(0, 1, 2, 3, 4))(*params)
    ref = finite_differences([a.astype(np.float64) for a in arrays], x_np, target_np)
    print("dloss/dW[0, :4] pydiff    :", np.array2string(grads[0].numpy()[0, :4], precision=6))
    print("dloss/dW[0, :4] finite dif:", np.array2string(ref[0][0, :4], precision=6))
    print("dloss/dU[:3, 0] pydiff    :", np.array2string(grads[1].numpy()[:3, 0], precision=6))
    print("dloss/dU[:3, 0] finite dif:", np.array2string(ref[1][:3, 0], precision=6))
    diff = max(float(np.max(np.abs(g.numpy() - r))) for g, r in zip(grads, ref))
    scale = max(float(np.max(np.abs(r))) for r in ref)
    print(
        f"gradient vs float64 finite differences: max difference {diff:.2e} "
        f"(max |grad| {scale:.2e})"
    )

    # 2. Training: Adam through the implicit layer.
    opt = pydiff.optim.Adam(params, lr=args.lr)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = loss_of(params, x, target)
        tape.backward(loss)
        opt.step()
        losses.append(float(loss.numpy().reshape(())))
        # Keep the map a contraction: W projected back onto ||W||_2 <= 0.9 after each step.
        W = params[0].numpy()
        norm = np.linalg.norm(W, 2)
        if norm > 0.9:
            params[0].copy_from_numpy(W * (0.9 / norm))
    final = loss_of(params, x, target).numpy().reshape(())
    print(f"mse: first step {losses[0]:.5f}, after {args.steps} steps {float(final):.5f}")
    print(f"spectral norm of W after training: {np.linalg.norm(params[0].numpy(), 2):.3f}")


if __name__ == "__main__":
    main()
