"""pydiff's main demo: load a .slang file, run it forward on a tensor, then .bwds.

Run with `make demo` (sets everything up), or `python samples/polynomial.py`.
"""

from pathlib import Path

import numpy as np

import pydiff

here = Path(__file__).parent
module = pydiff.load_module(here / "polynomial.slang")
device = module.device
print(f"device: {device.type} ({device.adapter_name})")

# y = 2x^2 + 8x - 1, vectorised by SlangPy over x; a, b, c broadcast as scalars.
x = pydiff.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
y = module.polynomial(a=2.0, b=8.0, c=-1.0, x=x, _result="tensor")
print("x          =", x.numpy())
print("y          =", y.numpy(), "  (2x^2 + 8x - 1)")

# Backward: the upstream gradient dL/dy = 1 for every element; x.grad receives dy/dx.
module.polynomial.bwds(a=2.0, b=8.0, c=-1.0, x=x, _result=y.with_grads(ones=True))
print("dy/dx      =", x.grad.numpy(), "  (4x + 8)")
assert np.allclose(y.numpy(), 2 * x.numpy() ** 2 + 8 * x.numpy() - 1)
assert np.allclose(x.grad.numpy(), 4 * x.numpy() + 8)

# Gradients accumulate (as in SlangPy and PyTorch) unless a zeroing policy says otherwise.
with pydiff.zero_policy("reset"):
    module.polynomial.bwds(a=2.0, b=8.0, c=-1.0, x=x, _result=1.0)
print("after reset =", x.grad.numpy(), "  (same gradient, not doubled)")

# Gradients w.r.t. the broadcast coefficients too: pass them as tensors with gradients.
a = pydiff.tensor([2.0], requires_grad=True)
module.polynomial.bwds(a=a, b=8.0, c=-1.0, x=x.detach(), _result=1.0)
print("dL/da      =", a.grad.numpy(), "  (sum of x^2 =", float((x.numpy() ** 2).sum()), ")")
