"""Attacks on the generated kernels of user functions (session 45, breakG45): a broadcast
one-element parameter whose gradient is summed, float3 functions with a broadcast float,
.fwds against float64 central finite differences, and one tape mixing a small call (SlangPy's
path) with a large one (generated) that share a broadcast parameter. References: float64
NumPy closed forms and central differences, never pydiff's own output."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import generated

SOURCE = """
import slangpy;
[Differentiable] public float f(float a, float x) { return a * x * x + sin(x * a); }
[Differentiable] public float3 v3(float3 a, float s) { return a * s + a.yzx * s * s; }
"""


def _f(a, x):
    return a * x * x + np.sin(x * a)


def _v3(a, s):
    return a * s + np.roll(a, -1, axis=-1) * s * s


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s45_breakG45", SOURCE, device=device)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 255, 256, 257, 4097])
@pytest.mark.parametrize("shape_a", [(), (1,)])
def test_broadcast_parameter_gradient_is_summed(device, mod, forced, n, shape_a):
    rng = np.random.default_rng(n)
    xs = rng.standard_normal(n).astype(np.float32)
    up = rng.standard_normal(n).astype(np.float32)
    a0 = np.float32(1.3)
    a = pydiff.tensor(np.full(shape_a, a0, np.float32), device=device, requires_grad=True)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    for _ in range(2):  # gradients accumulate
        y = mod.f(a, x, _result="tensor")
        mod.f.bwds(a, x, _result=y.with_grads(grad_in=pydiff.tensor(up, device=device)))
    if generated.enabled() and a.shape != y.shape:  # (n == 1, shape (1,): the call's)
        assert generated.stats().get("backward: broadcast", 0) == 2
    x64, a64, u64 = xs.astype(np.float64), np.float64(a0), up.astype(np.float64)
    np.testing.assert_allclose(y.numpy(), _f(a64, x64), rtol=1e-5, atol=1e-5)
    ga = 2 * (u64 * (x64 * x64 + x64 * np.cos(x64 * a64))).sum()
    gx = 2 * u64 * (2 * a64 * x64 + a64 * np.cos(x64 * a64))
    np.testing.assert_allclose(a.grad.numpy().reshape(()), ga, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), gx, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 65, 257])
def test_float3_with_broadcast_float_bwds_and_fwds(device, mod, forced, n):
    rng = np.random.default_rng(100 + n)
    A = rng.standard_normal((n, 3)).astype(np.float32)
    U = rng.standard_normal((n, 3)).astype(np.float32)
    s0 = np.float32(0.7)
    a = pydiff.tensor(A, device=device, requires_grad=True)
    s = pydiff.tensor(np.array([s0]), device=device, requires_grad=True)
    y = pydiff.tensor(np.zeros((n, 3), np.float32), device=device)
    mod.v3(a, s, _result=y)
    mod.v3.bwds(a, s, _result=y.with_grads(grad_in=pydiff.tensor(U, device=device)))
    A64, U64, s64 = A.astype(np.float64), U.astype(np.float64), np.float64(s0)
    np.testing.assert_allclose(y.numpy(), _v3(A64, s64), rtol=1e-5, atol=1e-5)
    ga = U64 * s64 + np.roll(U64, 1, axis=-1) * s64 * s64
    gs = (U64 * (A64 + 2 * s64 * np.roll(A64, -1, axis=-1))).sum()
    np.testing.assert_allclose(a.grad.numpy().reshape(n, 3), ga, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s.grad.numpy()[0], gs, rtol=1e-4, atol=1e-4)
    # .fwds (JVP) against float64 central differences, tangents on both parameters
    T = rng.standard_normal((n, 3)).astype(np.float32)
    _, dy = mod.v3.fwds(
        pydiff.tensor(A, device=device).with_tangent(pydiff.tensor(T, device=device)), (s0, 0.3)
    )
    h = 1e-5
    fd = (_v3(A64 + h * T, s64 + h * 0.3) - _v3(A64 - h * T, s64 - h * 0.3)) / (2 * h)
    np.testing.assert_allclose(dy.numpy().reshape(n, 3), fd, rtol=1e-4, atol=1e-5)
    assert generated.stats().get("fwds: vector", 0) == int(generated.enabled())


def test_small_and_large_calls_on_one_tape_share_a_broadcast_parameter(device, mod, auto_sizes):
    """The default threshold: the 10-element call takes SlangPy's path, the 5000-element one
    the generated kernel; the shared parameter's gradient sums both."""
    rng = np.random.default_rng(5)
    xs1 = rng.standard_normal(10).astype(np.float32)
    xs2 = rng.standard_normal(5000).astype(np.float32)
    s = pydiff.tensor(np.array([0.3], np.float32), device=device, requires_grad=True)
    x1 = pydiff.tensor(xs1, device=device, requires_grad=True)
    x2 = pydiff.tensor(xs2, device=device, requires_grad=True)
    generated.reset_stats()
    with pydiff.Tape() as tape:
        y1 = mod.f(s, x1, _result="tensor")
        y2 = mod.f(s, x2, _result="tensor")
        z = mod.f(1.0, y2, _result="tensor")  # z = y2^2 + sin(y2)
    tape.backward(z, grad=np.ones(5000, np.float32))
    tape.backward(y1, grad=np.ones(10, np.float32))
    if generated.enabled():
        assert generated.stats().get("forward", 0) == 2  # y2 and z; y1 on SlangPy's path
        assert generated.stats().get("backward: in tape.backward", 0) == 2
    s64 = np.float64(np.float32(0.3))
    x64 = xs2.astype(np.float64)
    y64 = _f(s64, x64)
    dz = 2 * y64 + np.cos(y64)
    gs = (dz * (x64 * x64 + x64 * np.cos(x64 * s64))).sum()
    x1_64 = xs1.astype(np.float64)
    gs += (x1_64 * x1_64 + x1_64 * np.cos(x1_64 * s64)).sum()
    np.testing.assert_allclose(s.grad.numpy()[0], gs, rtol=1e-4)
    np.testing.assert_allclose(
        x2.grad.numpy(), dz * (2 * s64 * x64 + s64 * np.cos(x64 * s64)), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        x1.grad.numpy(), 2 * s64 * x1_64 + s64 * np.cos(x1_64 * s64), rtol=1e-5, atol=1e-6
    )
