"""Written interface tensors marked ``no_diff`` pass no gradient back: the upstream gradient
of what a call stores into a ``no_diff IWDiffTensor`` (or ``IRWDiffTensor``) flowed into the
values stored there, on SlangPy's path and the generated grid kernels, in ``.bwds`` and a
tape, against docs/tape.md (a ``no_diff`` parameter gets no gradient; its buffer is left as
it was). Expected gradients are closed forms: z = 3 x is the only path that counts."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import ops
from pydiff.errors import GradientFlowWarning

SOURCE = """import slangpy;
[Differentiable]
void stores(int idx, IDiffTensor<float, 1> x, no_diff IWDiffTensor<float, 1> y,
            IWDiffTensor<float, 1> z)
{ float v = x[idx]; y[idx] = v * v; z[idx] = 3.0 * v; }
[Differentiable]
void scales(int idx, IDiffTensor<float, 1> x, no_diff IRWDiffTensor<float, 1> t,
            IWDiffTensor<float, 1> z)
{ float v = x[idx]; float w = t[idx]; t[idx] = w * v; z[idx] = 3.0 * v + w; }
"""
# 64 elements: SlangPy's kernel; 8192: the generated grid kernel (above MIN_ELEMENTS)
SIZES = [64, 8192]


_loaded = 0


@pytest.fixture
def module(device):
    # A module name of its own per test: the warning is once per message and line of code
    global _loaded
    _loaded += 1
    return pydiff.load_module_from_source(f"s34_nodiff_written{_loaded}", SOURCE, device=device)


@pytest.mark.parametrize("n", SIZES)
def test_bwds_of_a_no_diff_written_tensor(device, module, n):
    xs = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros((n,), device=device).with_grads(ones=True)
    z = pydiff.zeros((n,), device=device).with_grads(ones=True)
    module.stores(spy.grid((n,)), x, y, z)
    np.testing.assert_allclose(y.numpy(), xs.astype(np.float64) ** 2, rtol=1e-6)
    y_grad = y.grad.numpy().copy()
    with pytest.warns(GradientFlowWarning, match="'y' is no_diff.*what the call stores there"):
        module.stores.bwds(spy.grid((n,)), x, y, z)
    np.testing.assert_allclose(x.grad.numpy(), 3.0, rtol=1e-6)  # not 3 + 2 x
    np.testing.assert_array_equal(y.grad.numpy(), y_grad)


@pytest.mark.parametrize("n", SIZES)
def test_tape_through_a_no_diff_written_tensor(device, module, n):
    xs = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device, requires_grad=True)
    z = pydiff.zeros((n,), device=device, requires_grad=True)
    with pytest.warns(GradientFlowWarning, match="'y' is no_diff"):
        with pydiff.Tape() as tape:
            module.stores(spy.grid((n,)), x, y, z)
            loss = ops.add(ops.sum(y), ops.sum(z))
        tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 3.0, rtol=1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_bwds_of_a_no_diff_in_place_tensor(device, module, n):
    xs = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    t = pydiff.tensor(np.full(n, 2.0, np.float32), device=device).with_grads(ones=True)
    z = pydiff.zeros((n,), device=device).with_grads(ones=True)
    module.scales(spy.grid((n,)), x, t, z)
    after = t.numpy().copy()
    np.testing.assert_allclose(after, 2.0 * xs, rtol=1e-6)
    with pytest.warns(GradientFlowWarning, match="'t' is no_diff"):
        module.scales.bwds(spy.grid((n,)), x, t, z)
    np.testing.assert_allclose(x.grad.numpy(), 3.0, rtol=1e-6)  # not 3 + w
    np.testing.assert_array_equal(t.grad.numpy(), 1.0)  # left as it was
    np.testing.assert_array_equal(t.numpy(), after)  # the backward's rerun wrote elsewhere


def test_a_no_diff_written_tensor_without_gradients_is_quiet(device, module):
    n = 64
    x = pydiff.tensor(np.linspace(-1.0, 1.0, n, dtype=np.float32), device=device)
    x = x.with_grads(zero=True)
    y = pydiff.zeros((n,), device=device)  # no gradient buffers: nothing to warn of
    z = pydiff.zeros((n,), device=device).with_grads(ones=True)
    module.stores(spy.grid((n,)), x, y, z)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFlowWarning)
        module.stores.bwds(spy.grid((n,)), x, y, z)
    np.testing.assert_allclose(x.grad.numpy(), 3.0, rtol=1e-6)
