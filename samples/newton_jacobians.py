"""Jacobians, Hessian-vector products and Newton's method on a composed Python function.

python samples/newton_jacobians.py [--dim 6] [--steps 8]

The function is written with pydiff ops and tensor operators, not as one shader:
    f(x) = sum(log(1 + exp(A x - b))) + 0.5 * lam * |x|^2     (a smooth, strictly convex loss)
The script
1. compares pydiff.jacfwd (one forward-mode pass per input) with pydiff.jacrev (one reverse
   pass per output) for the residual r(x) = A x - b, and both with A;
2. checks pydiff.hvp and pydiff.hessian (reverse over forward) against the closed form
   H = A^T diag(s (1 - s)) A + lam I, s = sigmoid(A x - b), in float64 NumPy;
3. minimises f by Newton's method, x <- x - H^-1 grad f, with pydiff.grad and pydiff.hessian,
   and prints the gradient norm per step: it falls quadratically once close.
"""

import argparse

import numpy as np

import pydiff
from pydiff import ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=6)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lam", type=float, default=0.1)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    A = rng.standard_normal((args.rows, args.dim)) / np.sqrt(args.dim)
    b = rng.standard_normal(args.rows)
    a_t, b_t = pydiff.tensor(A.astype(np.float32)), pydiff.tensor(b.astype(np.float32))

    def residual(x):
        return a_t @ x - b_t

    def f(x):
        return ops.log(1.0 + ops.exp(residual(x))).sum() + 0.5 * args.lam * (x * x).sum()

    def hessian_reference(x):
        s = 1.0 / (1.0 + np.exp(-(A @ x - b)))
        return A.T @ np.diag(s * (1 - s)) @ A + args.lam * np.eye(args.dim)

    x0 = rng.standard_normal(args.dim)
    x = pydiff.tensor(x0.astype(np.float32))

    # 1. Jacobians both ways.
    jf = pydiff.jacfwd(residual)(x)
    jr = pydiff.jacrev(residual)(x)
    print(f"jacfwd vs A: max difference {np.abs(jf - A).max():.2e}")
    print(f"jacrev vs jacfwd: max difference {np.abs(jr - jf).max():.2e}")

    # 2. Second order against the closed form.
    v = rng.standard_normal(args.dim)
    (hv,) = pydiff.hvp(f, (x,), (v,))
    H = pydiff.hessian(f, (x,))
    want = hessian_reference(x0)
    scale = np.abs(want).max()
    print(f"hvp vs closed form: max difference {np.abs(hv.numpy() - want @ v).max():.2e}")
    err = np.abs(H - want).max()
    print(f"hessian vs closed form: max difference {err:.2e} (max |H| {scale:.2e})")

    # 3. Newton's method.
    grad_f = pydiff.grad(f)
    xk = x0.copy()
    for step in range(args.steps):
        xt = pydiff.tensor(xk.astype(np.float32))
        g = grad_f(xt).numpy().astype(np.float64)
        print(f"newton step {step}: |grad f| = {np.linalg.norm(g):.3e}")
        if np.linalg.norm(g) < 1e-6:
            break
        xk = xk - np.linalg.solve(pydiff.hessian(f, (xt,)), g)
    s = 1.0 / (1.0 + np.exp(-(A @ xk - b)))
    exact_grad = A.T @ s + args.lam * xk  # float64 gradient at the final point
    print(f"final |grad f| in float64: {np.linalg.norm(exact_grad):.3e}")


if __name__ == "__main__":
    main()
