"""A custom pydiff.Function (Legendre P3) with a hand-written backward, checked by gradcheck.

python samples/legendre_function.py
"""

from pathlib import Path

import numpy as np

import pydiff

m = pydiff.load_module(Path(__file__).parent / "fit.slang")


class LegendrePolynomial3(pydiff.Function):
    """P3(x) = 1/2 (5x^3 - 3x); forward and backward are plain (non-autodiff) Slang kernels."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return m.p3(x, _result="tensor")

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return m.p3_backward(x, grad_output, _result="tensor")  # (7.5 x^2 - 1.5) * grad


x = pydiff.tensor([-0.8, -0.3, 0.5, 0.9], requires_grad=True)
with pydiff.Tape() as tape:
    y = LegendrePolynomial3.apply(x)
tape.backward(y, grad=np.ones(4))
xs = x.numpy()
print("P3(x)    =", y.numpy())
print("dP3/dx   =", x.grad.numpy())
print("expected =", (7.5 * xs**2 - 1.5).astype(np.float32))
print("gradcheck:", pydiff.gradcheck(LegendrePolynomial3, (x,)))
