"""Broadcast float vector and matrix parameters, and calls driven by `spy.grid`, get their
gradients summed by pydiff in a fixed order (issue 15, coverage), not with float atomics:
accurate against float64 NumPy, bitwise repeatable in deterministic mode, and without a
NondeterminismWarning."""

import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff

SOURCE = """
[Differentiable] float3 shift3(float3 b, float3 x) { return x * b + b; }
[Differentiable] float2 shift2(float2 b, float2 x) { return x * x * b; }
[Differentiable] float2x2 mshift(float2x2 b, float2x2 x) { return x + b * 2.0; }
[Differentiable] float ramp(int i, float a) { return a * float(i); }
[Differentiable] float ramp2(int[2] ij, float a) { return a * float(ij[0] + 10 * ij[1]); }
"""


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("broadcast_coverage", SOURCE, device=device)


def _bwds(fn, *args, deterministic, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydiff.NondeterminismWarning)
        if deterministic:
            with pydiff.deterministic():
                fn.bwds(*args, **kw)
        else:
            fn.bwds(*args, **kw)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_float3_broadcast(device, m, deterministic):
    n = 3001
    X = np.random.default_rng(1).standard_normal((n, 3))
    B = np.array([[0.5, -1.0, 2.0]])
    grads = []
    for _ in range(2):
        b = pydiff.tensor(B, dtype="float3", device=device, requires_grad=True)
        x = pydiff.tensor(X, dtype="float3", device=device)
        y = pydiff.zeros((n,), dtype="float3", device=device).with_grads(ones=True)
        _bwds(m.shift3, b, x, _result=y, deterministic=deterministic)
        grads.append(b.grad.numpy())
    np.testing.assert_allclose(grads[0], [(X + 1).sum(0)], rtol=1e-6, atol=1e-4)
    if deterministic:
        assert grads[0].tobytes() == grads[1].tobytes()


def test_float2_broadcast_over_two_axes(device, m):
    X = np.random.default_rng(2).standard_normal((7, 5, 2))
    B = np.random.default_rng(3).standard_normal((1, 5, 2))
    U = np.random.default_rng(4).standard_normal((7, 5, 2))
    b = pydiff.tensor(B, dtype="float2", device=device, requires_grad=True)
    x = pydiff.tensor(X, dtype="float2", device=device)
    y = pydiff.zeros((7, 5), dtype="float2", device=device).with_grads(
        pydiff.tensor(U, dtype="float2", device=device)
    )
    _bwds(m.shift2, b, x, _result=y, deterministic=True)
    np.testing.assert_allclose(b.grad.numpy(), (U * X**2).sum(0, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_matrix_broadcast(device, m, deterministic):
    n = 50
    b = pydiff.tensor(np.zeros((1, 2, 2)), dtype="float2x2", device=device, requires_grad=True)
    x = pydiff.tensor(np.zeros((n, 2, 2)), dtype="float2x2", device=device)
    up = np.random.default_rng(5).standard_normal((n, 2, 2))
    y = pydiff.zeros((n,), dtype="float2x2", device=device).with_grads(
        pydiff.tensor(up, dtype="float2x2", device=device)
    )
    _bwds(m.mshift, b, x, _result=y, deterministic=deterministic)
    np.testing.assert_allclose(b.grad.numpy(), 2 * up.sum(0, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_grid_call_with_a_broadcast_parameter(device, m, deterministic):
    n = 5000
    grads = []
    for _ in range(2):
        a = pydiff.tensor([2.0], device=device, requires_grad=True)
        y = pydiff.zeros((n,), device=device).with_grads(ones=True)
        _bwds(m.ramp, spy.grid((n,)), a, _result=y, deterministic=deterministic)
        grads.append(a.grad.numpy())
    assert grads[0][0] == n * (n - 1) / 2  # exact: the compensated sum of integers
    assert grads[0].tobytes() == grads[1].tobytes()


def test_two_dimensional_grid(device, m):
    a = pydiff.tensor([2.0], device=device, requires_grad=True)
    y = pydiff.zeros((4, 3), device=device).with_grads(ones=True)
    _bwds(m.ramp2, spy.grid((4, 3)), a, _result=y, deterministic=True)
    i, j = np.meshgrid(np.arange(4), np.arange(3), indexing="ij")
    np.testing.assert_allclose(a.grad.numpy(), [(i + 10 * j).sum()])
