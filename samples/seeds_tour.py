"""Every example of the SlangPy autodiff docs, with pydiff: values and gradients printed.

python samples/seeds_tour.py
"""

from pathlib import Path

import numpy as np
import slangpy as spy

import pydiff

m = pydiff.load_module(Path(__file__).parent / "seeds_tour.slang")

# 1. Tensor-parameter polynomial: 2x^2 + 8x - 1 (the docs print [9, 27, 53, 87]; it is
#    [9, 23, 41, 63]).
x = pydiff.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
result = pydiff.zeros((4,))
m.polynomial_tensor(idx=spy.grid((4,)), a=2.0, b=8.0, c=-1.0, x=x, result=result)
print("polynomial      ", result.numpy())
result = result.with_grads(ones=True)
m.polynomial_tensor.bwds(idx=spy.grid((4,)), a=2.0, b=8.0, c=-1.0, x=x, result=result)
print("  d/dx = 4x + 8 ", x.grad.numpy())

# 2. In place: pydiff allocates the separate grad_in/grad_out SlangPy needs.
data = pydiff.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
m.process_inplace(idx=spy.grid((4,)), data=data)
print("process_inplace ", data.numpy())
data.grad.fill(1.0)
m.process_inplace.bwds(idx=spy.grid((4,)), data=data)
print("  d/d(before)   ", data.grad.numpy())

# 3. Custom [BackwardDerivative] with a concrete DiffTensor (smoothstep).
inp = pydiff.tensor([-0.5, 0.25, 0.5, 0.75, 1.5], requires_grad=True)
out = m.custom_activation(spy.grid((5,)), inp, _result="tensor")
m.custom_activation.bwds(spy.grid((5,)), inp, _result=1.0)
print("smoothstep      ", out.numpy())
print("  6x(1-x) inside", inp.grad.numpy())

# 4. The linear layer (int loop counter: a uint one crashes SlangPy's bwds).
rng = np.random.default_rng(0)
W, b, v = rng.standard_normal((3, 4)), rng.standard_normal(3), rng.standard_normal(4)
w_t, b_t, v_t = (pydiff.tensor(a, requires_grad=True) for a in (W, b, v))
y = pydiff.zeros((3,))
m.linear_layer(spy.grid((3,)), w_t, b_t, v_t, y)
print("linear layer    ", y.numpy(), " numpy:", (W @ v + b).astype(np.float32))
y = y.with_grads(ones=True)
m.linear_layer.bwds(spy.grid((3,)), w_t, b_t, v_t, y)
print("  dL/dinput     ", v_t.grad.numpy(), " numpy:", W.sum(axis=0).astype(np.float32))

# 5. The same polynomial over 2^20 elements: large calls over a grid run kernels pydiff
#    generates (SlangPy's own tensor types, called per thread; docs/generated-kernels.md),
#    about three times faster than SlangPy's generic kernel on lavapipe.
#    pydiff.generated.stats() says which path each call took.
n = 1 << 20
xs = np.linspace(-1.0, 1.0, n, dtype=np.float32)
x = pydiff.tensor(xs).with_grads(zero=True)
result = pydiff.zeros((n,)).with_grads(ones=True)
m.polynomial_tensor(spy.grid((n,)), 2.0, 8.0, -1.0, x, result)
m.polynomial_tensor.bwds(spy.grid((n,)), 2.0, 8.0, -1.0, x, result)
worst = np.abs(x.grad.numpy() - (4.0 * xs + 8.0)).max()
print(f"2^20 elements    d/dx worst error {worst:.1e}; paths: {pydiff.generated.stats()}")

# 6. Calls over a grid in a training loop: solve 2x^2 + 8x - 1 = t for 64 targets by gradient
#    descent on sum((p(x) - t)^2), each step on a Tape. From the second step on, the grid
#    call and its backward take pydiff's call plans (docs/tensors-and-gradients.md).
roots = np.linspace(0.2, 1.0, 64)
target = pydiff.tensor(2 * roots**2 + 8 * roots - 1)
x = pydiff.tensor(np.full(64, 0.5), requires_grad=True)
opt = pydiff.optim.SGD([x], lr=0.004)
for step in range(150):
    opt.zero_grad()
    y = pydiff.zeros((64,))
    with pydiff.Tape() as tape:
        m.polynomial_tensor(spy.grid((64,)), 2.0, 8.0, -1.0, x, y)
        loss = pydiff.ops.sum((y - target) * (y - target))
    tape.backward(loss, retain_graph=False)
    opt.step()
worst = np.abs(x.numpy() - roots).max()
print(f"fitted roots     worst error {worst:.1e} (loss {loss.item():.1e})")
