"""``Tensor.native`` inside a custom Function's ``backward`` (which runs in the tape's batch)
submits the batch first, as its docs promise: pydiff ops computed there and then handed to
raw SlangPy gave a zero gradient, silently (the batch ran after SlangPy's call)."""

from __future__ import annotations

import numpy as np
import slangpy as spy

import pydiff
from pydiff import ops

SOURCE = "float twice(float v) { return 2.0 * v; }"


def test_raw_slangpy_on_native_after_ops_in_a_function_backward(device):
    raw = spy.Module.load_from_source(device.native, "s38_native_twice", SOURCE)

    class Square(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            h = ops.relu(x * g)  # pydiff ops, recorded in the tape's batch
            out = raw.twice(h.native, _result="numpy")  # raw SlangPy reads them
            return pydiff.tensor(out, device=device)

    xs = np.linspace(0.5, 2.0, 8).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    for _ in range(3):
        x.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.sum(Square.apply(x))
        tape.backward(loss)
        np.testing.assert_allclose(x.grad.numpy(), 2.0 * xs.astype(np.float64), rtol=1e-6)
