"""Run one shader variant through raw SlangPy in this process and print what happened.

Used by test_trap_oracle.py in a subprocess (a variant may segfault). Prints 'forward ok'
after the forward call, then 'ok' when the backward gives the expected dL/dx (by default 2x,
for y = x*x), 'wrong' otherwise.

    python tests/trap_oracle.py "<params>" "<body>" 2,2 ["<prefix source>" ["g0,g1,..."]]

The optional prefix is Slang source put before ``f`` (helper functions, macros, imports); the
optional expected gradients (float64, from the caller's closed form or finite differences)
replace 2x. ``TRAP_ORACLE_INCLUDE`` (a folder) is put on the device's include paths, for
variants that import a module of their own.
"""

import os
import sys

import numpy as np
import slangpy as spy

params, body, shape_arg = sys.argv[1:4]
prefix = sys.argv[4] if len(sys.argv) > 4 else ""
expected_arg = sys.argv[5] if len(sys.argv) > 5 else ""
shape = tuple(int(s) for s in shape_arg.split(","))
dims = len(shape)
src = (
    f"import slangpy;\n{prefix}\n[Differentiable]\nvoid f("
    f"{params}, IDiffTensor<float, {dims}> x, IWDiffTensor<float, {dims}> y)\n{{\n{body}\n}}\n"
)
include = [os.environ["TRAP_ORACLE_INCLUDE"]] if os.environ.get("TRAP_ORACLE_INCLUDE") else []
device = spy.create_device(type=spy.DeviceType.vulkan, include_paths=include)
module = spy.Module.load_from_source(device, "oracle", src)
xs = (np.arange(np.prod(shape)) + 1).astype(np.float32).reshape(shape)
x = spy.Tensor.from_numpy(device, xs).with_grads(zero=True)
y = spy.Tensor.zeros(device, shape, "float").with_grads(zero=True)
module.f(spy.grid(shape), x, y)
print("forward ok", flush=True)  # a crash before this line is a crash of the forward call
y.grad.copy_from_numpy(np.ones(shape, np.float32))
module.f.bwds(spy.grid(shape), x, y)
if expected_arg:
    expected = np.array([float(v) for v in expected_arg.split(",")]).reshape(shape)
else:
    expected = 2.0 * xs
got = x.grad.to_numpy()
print(
    "ok" if np.allclose(got, expected, rtol=1e-4, atol=1e-5) else f"wrong {got.ravel()}", flush=True
)
