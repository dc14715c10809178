"""A FwdDiffTensor loop with [MaxIters(n)] above about 4094: Slang 0.43 stops with an
internal error in its SPIR-V emitter (no line, no fix); pydiff's error now says what it is
and how to split the loop, and the split loop's gradients are right (closed form)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import slangpy as spy

import pydiff

_names = itertools.count()


def _dense(device, loop: str):
    src = f"""
import slangpy;
import pydiff;
[Differentiable]
void dense(int i, FwdDiffTensor<2> w, FwdDiffTensor<1> x, RWFwdDiffTensor<1> y)
{{
    float acc = 0.0;
    {loop}
    y.store({{i}}, acc);
}}
"""
    return pydiff.load_module_from_source(f"s29_fdt_{next(_names)}", src, device=device)


def _grads(device, m, n: int):
    rng = np.random.default_rng(n)
    wv, xv = rng.standard_normal((3, n)), rng.standard_normal(n)
    w = pydiff.tensor(wv.astype(np.float32), requires_grad=True, device=device)
    x = pydiff.tensor(xv.astype(np.float32), requires_grad=True, device=device)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    m.dense.bwds(spy.grid((3,)), w, x, y)
    return wv, xv, w.grad.numpy(), x.grad.numpy()


def test_long_fwd_diff_tensor_loop_names_the_limit_and_the_split_is_right(device):
    if device.type != "vulkan":
        pytest.skip("the limit is in Slang's SPIR-V emitter")
    long = (
        "[MaxIters(4096)] for (int k = 0; k < x.dim(0); ++k) acc += w.load({i, k}) * x.load({k});"
    )
    with pytest.raises(pydiff.SlangCompileError, match=r"MaxIters.*FwdDiffTensor.*nested loops"):
        _grads(device, _dense(device, long), 5)
    split = (
        "[MaxIters(64)] for (int c = 0; c < (x.dim(0) + 63) / 64; ++c) {"
        " [MaxIters(64)] for (int j = 0; j < 64; ++j) {"
        " int k = c * 64 + j; if (k < x.dim(0)) acc += w.load({i, k}) * x.load({k}); } }"
    )
    wv, xv, dw, dx = _grads(device, _dense(device, split), 4000)
    x32 = xv.astype(np.float32).astype(np.float64)
    w32 = wv.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(dw, np.tile(x32, (3, 1)), rtol=1e-6)
    np.testing.assert_allclose(dx, w32.sum(axis=0), rtol=1e-5, atol=1e-5)
