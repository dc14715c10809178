"""The fused forward + backward generated kernel (pydiff.generated_fused): its result and
gradients against float64 NumPy closed forms, the same bits as the forward kernel then the
backward kernel, one dispatch. (The kernel only: not yet reached from a tape.)"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_fused

SOURCE = """
import slangpy;
[Differentiable] float fz_poly(float a, float b, float x) { return a * x * x + b * x + sin(x); }
"""


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("fuse49_cases", SOURCE, device=device)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-2, 2, n).astype(np.float32), rng.uniform(-1, 1, n).astype(np.float32)


def _count_dispatches(device, monkeypatch):
    calls = []
    real = device.kernels.dispatch_split

    def split(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(device.kernels, "dispatch_split", split)
    return calls


@pytest.mark.parametrize("n", [1, 1000, 2**20 + 3])
def test_fused_values_and_gradients(device, m, n):
    x, g = _data(n)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    y = generated_fused.forward_backward(m.fz_poly, [1.5, -0.5, xt], gt, {2: xt.grad_out})
    assert y is not None
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    np.testing.assert_allclose(
        y.numpy(), 1.5 * x64**2 - 0.5 * x64 + np.sin(x64), rtol=1e-5, atol=1e-5
    )
    want = g64 * (3.0 * x64 - 0.5 + np.cos(x64))
    np.testing.assert_allclose(xt.grad.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 1000, 2**20 + 3])
def test_broadcast_scalar_parameter(device, m, n):
    x, g = _data(n, 1)
    at = pydiff.tensor(np.array([0.75], np.float32), device=device, requires_grad=True)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    grads = {0: at.grad_out, 2: xt.grad_out}
    y = generated_fused.forward_backward(m.fz_poly, [at, 2.0, xt], gt, grads)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    np.testing.assert_allclose(
        y.numpy(), 0.75 * x64**2 + 2 * x64 + np.sin(x64), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        xt.grad.numpy(), g64 * (1.5 * x64 + 2 + np.cos(x64)), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(at.grad.numpy().ravel(), [np.sum(g64 * x64**2)], rtol=1e-4)


@pytest.mark.parametrize("n", [1000, 2**20 + 3])
def test_same_bits_as_forward_then_backward(device, m, n):
    x, g = _data(n, 2)
    at = pydiff.tensor(np.array([0.75], np.float32), device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    runs = []
    for fused in (True, False):
        at.grad_out.copy_from_numpy(np.zeros((1,), np.float32))
        xt = pydiff.tensor(x, device=device, requires_grad=True)
        args, grads = [at, 2.0, xt], {0: at.grad_out, 2: xt.grad_out}
        if fused:
            y = generated_fused.forward_backward(m.fz_poly, args, gt, grads)
        else:
            y = generated.forward(m.fz_poly, args, None)
            assert generated.backward(m.fz_poly, args, gt, grads)
        runs.append((y.numpy(), xt.grad.numpy(), at.grad.numpy()))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_one_dispatch_and_counted(device, m, monkeypatch):
    x, g = _data(5000, 3)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    generated_fused.forward_backward(m.fz_poly, [1.0, 1.0, xt], gt, {2: xt.grad_out})  # built
    generated.reset_stats()
    calls = _count_dispatches(device, monkeypatch)
    generated_fused.forward_backward(m.fz_poly, [1.0, 1.0, xt], gt, {2: xt.grad_out})
    assert len(calls) == 1
    assert generated.stats().get("forward+backward fused") == 1


def test_declined_case_does_nothing(device, m):
    x, g = _data(100)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    # a gradient wanted for a number: generated.backward declines, so does the fused kernel
    assert generated_fused.forward_backward(m.fz_poly, [1.0, 1.0, xt], gt, {0: xt.grad_out}) is None
    np.testing.assert_array_equal(xt.grad.numpy(), np.zeros(100, np.float32))
