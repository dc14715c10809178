"""Breaker tests for in-place (IRWDiffTensor, inout) and overwriting (out, IWDiffTensor,
_result=) calls, written from the user docs only (tensors-and-gradients.md "In-place
parameters", tape.md "Overwrite detection").

Every gradient is compared with a closed form or float64 central differences of a NumPy
model of the shader. Cases that fail today are `xfail(strict=True)` with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import slangpy as spy

import pydiff

SRC = """
import slangpy;
[Differentiable]
void sq_at(int i, IRWDiffTensor<float, 1> d) { float v = d[i]; d[i] = v * v; }
[Differentiable]
void dbl_at(int i, IRWDiffTensor<float, 1> d) { float v = d[i]; d[i] = 2.0 * v; }
[Differentiable]
void mul_next(int i, IRWDiffTensor<float, 1> d)
{
    float a = d[i];
    float b = d[i + 1];
    d[i] = a * b;
}
[Differentiable]
void odd_from_even(int i, IRWDiffTensor<float, 1> d)
{
    float a = d[2 * i];
    float b = d[2 * i + 1];
    d[2 * i + 1] = a * b + b;
}
[Differentiable]
void set_at(int i, float x, IRWDiffTensor<float, 1> d) { d[i] = x * x; }
[Differentiable]
void cube2(int i, int j, IRWDiffTensor<float, 2> d) { float v = d[i, j]; d[i, j] = v * v * v; }
[Differentiable]
void cube3(int i, int j, int k, IRWDiffTensor<float, 3> d)
{
    float v = d[i, j, k];
    d[i, j, k] = v * v * v;
}
[Differentiable]
void sq_half(int i, IRWDiffTensor<half, 1> d) { half v = d[i]; d[i] = v * v; }
[Differentiable]
void sq_f3(int i, IRWDiffTensor<float3, 1> d) { float3 v = d[i]; d[i] = v * v; }
[Differentiable]
void mix_f2(int i, IRWDiffTensor<float2, 1> d) { float2 v = d[i]; d[i] = float2(v.x * v.y, v.y); }
[Differentiable]
void two_rw(int i, IRWDiffTensor<float, 1> a, IRWDiffTensor<float, 1> b)
{
    float x = a[i];
    float y = b[i];
    a[i] = x * y;
    b[i] = x + y * y;
}
[Differentiable]
void axpy_rw(int i, float s, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> y)
{
    float yv = y[i];
    y[i] = s * x[i] + yv * yv;
}
[Differentiable]
void scatter_add(int i, int j, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> d)
{
    float v = d[j];
    d[j] = v + x[i] * x[i];
}
[Differentiable]
void put(int i, float v, IWDiffTensor<float, 1> o) { o[i] = v * v; }
[Differentiable]
float sq(float x) { return x * x; }
[Differentiable]
float times(float a, float b) { return a * b; }
[Differentiable]
void sq_out(float x, out float y) { y = x * x; }
[Differentiable]
void scale_inout(float s, inout float v) { v = v * s; }
[Differentiable]
void add_one(inout float v) { v = v + 1.0; }
struct Box : IDifferentiable { float k; };
[Differentiable]
void box_sq(int i, Box b, IRWDiffTensor<float, 1> d) { float v = d[i]; d[i] = v * v * b.k; }
"""

# Two stores to one interface diff tensor in one thread (the second one a re-store or a
# read-back of a stored element): .bwds never finishes compiling (raw SlangPy too).
HANG_SRC = """
import slangpy;
[Differentiable]
void twice_at(int i, IRWDiffTensor<float, 1> d)
{
    float v = d[i];
    d[i] = v * v;
    float w = d[i];
    d[i] = w * 3.0 + v;
}
[Differentiable]
void two_stores_w(int i, float x, IWDiffTensor<float, 1> d) { d[i] = x * x; d[i + 1] = x; }
"""

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("breaker_inplace", SRC, device=device)


def T(device, a, **kw):
    return pydiff.tensor(np.asarray(a, np.float32), device=device, **kw)


def ints(device, a):
    return pydiff.tensor(np.asarray(a, np.int32), device=device)


def fd_vjp(f, x0, gy, eps=1e-6):
    """float64 central differences of <gy, f(x)> with respect to x."""
    x0 = np.asarray(x0, np.float64)
    out = np.zeros_like(x0)
    for k in np.ndindex(x0.shape):
        e = np.zeros_like(x0)
        e[k] = eps
        out[k] = (np.sum(gy * f(x0 + e)) - np.sum(gy * f(x0 - e))) / (2 * eps)
    return out


def partial_sq_ref(x0, g, idx):
    e = np.asarray(g, np.float64).copy()
    for i in idx:
        e[i] = 2 * x0[i] * g[i]
    return e


# ---------------------------------------------------------------- partial IRW writes


@pytest.mark.parametrize("idx", [[2], [0, 2, 4], [4, 1]])
def test_sq_at_partial_bwds_and_tape(device, m, idx):
    x0 = np.array([1.5, 2.0, -0.5, 3.0, 0.7], np.float32)
    g = np.array([1, 2, 3, 4, 5], np.float32)
    ref = partial_sq_ref(x0, g, idx)
    d = T(device, x0, requires_grad=True)
    m.sq_at(ints(device, idx), d)
    d.grad.copy_from_numpy(g)
    m.sq_at.bwds(ints(device, idx), d)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)
    d = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        m.sq_at(ints(device, idx), d)
    tape.backward(d, grad=g)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)


def test_scalar_index_single_thread(device, m):
    x0 = np.array([1.5, 2.0, -0.5], np.float32)
    d = T(device, x0, requires_grad=True)
    m.sq_at(1, d)
    d.grad.copy_from_numpy(np.array([1, 2, 3], np.float32))
    m.sq_at.bwds(1, d)
    np.testing.assert_allclose(d.grad.numpy(), [1, 8, 3], **TOL)


def test_reads_of_unwritten_neighbours(device, m):
    rng = np.random.default_rng(0)
    x0 = rng.uniform(0.5, 2, 6).astype(np.float32)
    g = rng.uniform(-1, 1, 6).astype(np.float32)
    d = T(device, x0, requires_grad=True)
    m.mul_next(ints(device, [0, 2, 4]), d)
    d.grad.copy_from_numpy(g)
    m.mul_next.bwds(ints(device, [0, 2, 4]), d)

    def f(x):
        y = x.copy()
        for i in (0, 2, 4):
            y[i] = x[i] * x[i + 1]
        return y

    np.testing.assert_allclose(d.grad.numpy(), fd_vjp(f, x0, g), **TOL)


def test_computed_index_grid_on_tape(device, m):
    rng = np.random.default_rng(1)
    x0 = rng.uniform(0.5, 2, 6).astype(np.float32)
    g = rng.uniform(-1, 1, 6)
    d = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        m.odd_from_even(spy.grid((3,)), d)
    tape.backward(d, grad=g)

    def f(x):
        y = x.copy()
        for i in range(3):
            y[2 * i + 1] = x[2 * i] * x[2 * i + 1] + x[2 * i + 1]
        return y

    np.testing.assert_allclose(d.grad.numpy(), fd_vjp(f, x0, g), **TOL)


def test_write_without_read_zeroes_written_only(device, m):
    x = T(device, [1.5, -2.0], requires_grad=True)
    d = T(device, [5, 6, 7, 8], requires_grad=True)
    d.grad.copy_from_numpy(np.array([1, 2, 3, 4], np.float32))
    m.set_at(ints(device, [0, 2]), x, d)
    m.set_at.bwds(ints(device, [0, 2]), x, d)
    np.testing.assert_allclose(d.grad.numpy(), [0, 2, 0, 4], **TOL)
    np.testing.assert_allclose(x.grad.numpy(), [2 * 1.5 * 1, 2 * -2.0 * 3], **TOL)


def test_2d_partial_and_broadcast_index_partners(device, m):
    rng = np.random.default_rng(2)
    x0 = rng.uniform(0.5, 1.5, (3, 4)).astype(np.float32)
    g = rng.uniform(-1, 1, (3, 4)).astype(np.float32)
    pts = [(0, 1), (2, 3)]
    ref = g.astype(np.float64).copy()
    for i, j in pts:
        ref[i, j] = 3 * x0[i, j] ** 2 * g[i, j]
    ii, jj = ints(device, [0, 2]), ints(device, [1, 3])
    d = T(device, x0, requires_grad=True)
    m.cube2(ii, jj, d)
    d.grad.copy_from_numpy(g)
    m.cube2.bwds(ii, jj, d)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)
    # (2, 1) x (1, 3) index tensors broadcast to 6 threads
    ref = g.astype(np.float64).copy()
    for i in (0, 2):
        for j in (0, 1, 3):
            ref[i, j] = 3 * x0[i, j] ** 2 * g[i, j]
    d = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        m.cube2(ints(device, [[0], [2]]), ints(device, [[0, 1, 3]]), d)
    tape.backward(d, grad=g)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)


def test_3d_partial(device, m):
    rng = np.random.default_rng(3)
    x0 = rng.uniform(0.5, 2, (2, 3, 2)).astype(np.float32)
    g = rng.uniform(-1, 1, (2, 3, 2)).astype(np.float32)
    ref = g.astype(np.float64).copy()
    ref[1, 2, 0] = 3 * x0[1, 2, 0] ** 2 * g[1, 2, 0]
    d = T(device, x0, requires_grad=True)
    m.cube3(1, 2, 0, d)
    d.grad.copy_from_numpy(g)
    m.cube3.bwds(1, 2, 0, d)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)


def test_half_partial_bwds_and_tape(device, m):
    x0 = np.array([0.5, 1.5, -2.0, 0.25], np.float16)
    g = np.array([1, 2, 3, 4], np.float16)
    ref = partial_sq_ref(x0.astype(np.float64), g.astype(np.float64), [1, 3])
    d = pydiff.tensor(x0, dtype="half", device=device, requires_grad=True)
    m.sq_half(ints(device, [1, 3]), d)
    d.grad.copy_from_numpy(g)
    m.sq_half.bwds(ints(device, [1, 3]), d)
    np.testing.assert_allclose(d.grad.numpy().astype(np.float64), ref, rtol=2e-3)
    d = pydiff.tensor(x0, dtype="half", device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        m.sq_half(ints(device, [1, 3]), d)
    tape.backward(d, grad=g)
    np.testing.assert_allclose(d.grad.numpy().astype(np.float64), ref, rtol=2e-3)


def test_float3_and_float2_partial(device, m):
    rng = np.random.default_rng(4)
    x0 = rng.uniform(0.5, 2, (4, 3)).astype(np.float32)
    g = rng.uniform(-1, 1, (4, 3)).astype(np.float32)
    ref = g.astype(np.float64).copy()
    ref[2] = 2 * x0[2] * g[2]
    d = pydiff.tensor(x0, dtype="float3", device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        m.sq_f3(2, d)
    tape.backward(d, grad=g)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)

    x0 = rng.uniform(0.5, 2, (4, 2)).astype(np.float32)
    g = rng.uniform(-1, 1, (4, 2)).astype(np.float32)
    ref = g.astype(np.float64).copy()
    for i in (0, 3):
        ref[i, 0] = g[i, 0] * x0[i, 1]
        ref[i, 1] = g[i, 0] * x0[i, 0] + g[i, 1]
    d = pydiff.tensor(x0, dtype="float2", device=device, requires_grad=True)
    m.mix_f2(ints(device, [0, 3]), d)
    d.grad.copy_from_numpy(g)
    m.mix_f2.bwds(ints(device, [0, 3]), d)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)


def test_two_irw_params_bwds_and_tape(device, m):
    rng = np.random.default_rng(5)
    a0, b0 = (rng.uniform(0.5, 2, 5).astype(np.float32) for _ in range(2))
    ga, gb = (rng.uniform(-1, 1, 5).astype(np.float32) for _ in range(2))
    idx = [1, 4]

    def f(ab):
        a, b = ab[:5].copy(), ab[5:].copy()
        for i in idx:
            a[i], b[i] = ab[i] * ab[5 + i], ab[i] + ab[5 + i] ** 2
        return np.concatenate([a, b])

    ab0 = np.concatenate([a0, b0])
    ref = fd_vjp(f, ab0, np.concatenate([ga, gb]))
    a, b = T(device, a0, requires_grad=True), T(device, b0, requires_grad=True)
    m.two_rw(ints(device, idx), a, b)
    a.grad.copy_from_numpy(ga)
    b.grad.copy_from_numpy(gb)
    m.two_rw.bwds(ints(device, idx), a, b)
    np.testing.assert_allclose(a.grad.numpy(), ref[:5], **TOL)
    np.testing.assert_allclose(b.grad.numpy(), ref[5:], **TOL)
    # on a tape, followed by a product of both
    a, b = T(device, a0, requires_grad=True), T(device, b0, requires_grad=True)
    with pydiff.Tape() as tape:
        m.two_rw(ints(device, idx), a, b)
        y = m.times(a, b, _result="tensor")
    tape.backward(y, grad=np.ones(5))
    ref = fd_vjp(lambda z: f(z)[:5] * f(z)[5:], ab0, np.ones(5))
    np.testing.assert_allclose(a.grad.numpy(), ref[:5], **TOL)
    np.testing.assert_allclose(b.grad.numpy(), ref[5:], **TOL)


def test_irw_with_idifftensor_and_broadcast_scalar(device, m):
    rng = np.random.default_rng(6)
    x0, y0 = (rng.uniform(0.5, 2, 5).astype(np.float32) for _ in range(2))
    g = rng.uniform(-1, 1, 5).astype(np.float32)
    idx = [0, 1, 3]
    ey = g.astype(np.float64).copy()
    ex = np.zeros(5)
    es = 0.0
    for i in idx:
        ey[i] = 2 * y0[i] * g[i]
        ex[i] = 1.7 * g[i]
        es += x0[i] * g[i]
    s = T(device, [1.7], requires_grad=True)
    x, y = T(device, x0, requires_grad=True), T(device, y0, requires_grad=True)
    m.axpy_rw(ints(device, idx), s, x, y)
    y.grad.copy_from_numpy(g)
    m.axpy_rw.bwds(ints(device, idx), s, x, y)
    np.testing.assert_allclose(y.grad.numpy(), ey, **TOL)
    np.testing.assert_allclose(x.grad.numpy(), ex, **TOL)
    np.testing.assert_allclose(s.grad.numpy(), [es], **TOL)


def test_irw_deterministic_mode_bitwise(device, m):
    rng = np.random.default_rng(7)
    x0, y0 = (rng.uniform(0.5, 2, 5).astype(np.float32) for _ in range(2))
    g = rng.uniform(-1, 1, 5)
    runs = []
    with pydiff.deterministic(), pytest.warns(pydiff.NondeterminismWarning):
        for _ in range(2):
            s = T(device, [1.7], requires_grad=True)
            x, y = T(device, x0, requires_grad=True), T(device, y0, requires_grad=True)
            with pydiff.Tape() as tape:
                m.axpy_rw(ints(device, [0, 1, 3]), s, x, y)
            tape.backward(y, grad=g)
            runs.append([t.grad.numpy() for t in (s, x, y)])
    es = sum(x0[i] * g[i] for i in (0, 1, 3))
    np.testing.assert_allclose(runs[0][0], [es], **TOL)
    for r0, r1 in zip(*runs):
        assert (r0 == r1).all()


# ---------------------------------------------------------------- chains, policies


def test_chain_of_inplace_calls_on_tape(device, m):
    rng = np.random.default_rng(8)
    x0 = rng.uniform(0.5, 1.5, 5)
    gy = rng.uniform(-1, 1, 5)

    def f(x):
        d = x.copy()
        for i in (0, 2):
            d[i] = d[i] * d[i]
        for i in (2, 3):
            d[i] = 2 * d[i]
        d[1] = d[1] * d[2]
        return d * d

    ref = fd_vjp(f, x0, gy)
    d = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        m.sq_at(ints(device, [0, 2]), d)
        m.dbl_at(ints(device, [2, 3]), d)
        m.mul_next(ints(device, [1]), d)
        y = m.times(d, d, _result="tensor")
    np.testing.assert_allclose(y.numpy(), f(x0), **TOL)
    tape.backward(y, grad=gy)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)
    with pydiff.zero_policy("reset"):
        tape.backward(y, grad=gy)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)
    d.zero_grad()
    with pydiff.zero_policy("strict"):
        tape.backward(y, grad=gy)
    np.testing.assert_allclose(d.grad.numpy(), ref, **TOL)


def test_inplace_on_intermediate_backward_twice(device, m):
    x0 = np.array([1.5, 2.0, 3.0])
    x = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.sq(x, _result="tensor")
        m.sq_at(ints(device, [0, 2]), a)
        y = m.times(a, a, _result="tensor")
    ref = np.array([8 * x0[0] ** 7, 4 * x0[1] ** 3, 8 * x0[2] ** 7])
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), ref, rtol=1e-4)
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 2 * ref, rtol=1e-4)


@pytest.mark.parametrize("policy", ["reset", "strict"])
def test_bwds_upstream_written_by_user_survives_policy(device, m, policy):
    d = T(device, [1.5, 2.0, 3.0], requires_grad=True)
    with pydiff.zero_policy(policy):
        m.sq_at(1, d)
        d.grad.copy_from_numpy(np.array([1, 2, 3], np.float32))
        m.sq_at.bwds(1, d)
    np.testing.assert_allclose(d.grad.numpy(), [1, 8, 3], **TOL)


@pytest.mark.parametrize("kind", ["inout", "irw_partial", "irw_full"])
def test_inplace_leaf_gradient_accumulates_across_tapes(device, m, kind):
    x0 = np.array([1.5, 2.0, 3.0])
    w0 = np.array([2.0, 3.0, 4.0])
    x, w = T(device, x0, requires_grad=True), T(device, w0)
    with pydiff.Tape() as tape:
        y = m.times(x, w, _result="tensor")
    tape.backward(y, grad=np.ones(3))  # x.grad = w
    with pydiff.Tape() as tape:
        if kind == "inout":
            m.scale_inout(2.0, x)
            scale = np.array([2.0, 2.0, 2.0])
        elif kind == "irw_partial":
            m.dbl_at(ints(device, [1]), x)
            scale = np.array([1.0, 2.0, 1.0])
        else:
            m.dbl_at(spy.grid((3,)), x)
            scale = np.array([2.0, 2.0, 2.0])
        y = m.times(x, w, _result="tensor")
    tape.backward(y, grad=np.ones(3))  # adds scale * w
    np.testing.assert_allclose(x.grad.numpy(), w0 + scale * w0, **TOL)


def test_inplace_leaf_backward_twice_policies(device, m):
    x0 = np.array([1.5, 2.0, 3.0])
    d, x = T(device, x0, requires_grad=True), T(device, x0)
    with pydiff.Tape() as tape:
        m.sq_at(ints(device, [1]), d)
        y = m.times(d, x, _result="tensor")
    ref = x0.copy()
    ref[1] = 2 * x0[1] * x0[1]
    tape.backward(y, grad=np.ones(3))
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(d.grad.numpy(), 2 * ref, **TOL)
    with pydiff.zero_policy("strict"), pytest.raises(pydiff.StaleGradientError):
        tape.backward(y, grad=np.ones(3))


# ---------------------------------------------------------------- duplicates


@pytest.mark.parametrize("on_tape", [False, True])
def test_duplicate_index_refused_or_right(device, m, on_tape):
    x0 = np.array([1.5, 2.0, 3.0], np.float32)
    d = T(device, x0, requires_grad=True)
    try:
        if on_tape:
            with pydiff.Tape() as tape:
                m.sq_at(ints(device, [1, 1]), d)
            tape.backward(d, grad=np.ones(3))
        else:
            m.sq_at(ints(device, [1, 1]), d)
            d.grad.fill(1.0)
            m.sq_at.bwds(ints(device, [1, 1]), d)
    except (ValueError, RuntimeError) as exc:
        assert "d" in str(exc)
        return
    np.testing.assert_allclose(d.numpy(), [1.5, 4.0, 3.0], **TOL)
    np.testing.assert_allclose(d.grad.numpy(), [1, 2 * 2.0, 1], **TOL)


def test_duplicate_scatter_refused_or_right(device, m):
    x = T(device, [1.0, 2.0, 3.0], requires_grad=True)
    d = T(device, [0.0, 0.0], requires_grad=True)
    try:
        m.scatter_add(ints(device, [0, 1, 2]), ints(device, [0, 0, 1]), x, d)
        d.grad.fill(1.0)
        m.scatter_add.bwds(ints(device, [0, 1, 2]), ints(device, [0, 0, 1]), x, d)
    except (ValueError, RuntimeError):
        return
    np.testing.assert_allclose(d.numpy(), [5.0, 9.0], **TOL)
    np.testing.assert_allclose(d.grad.numpy(), [1.0, 1.0], **TOL)
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0, 6.0], **TOL)


@pytest.mark.parametrize("kind", ["irw", "inout"])
def test_bwds_after_another_function_wrote_the_tensor(device, m, kind):
    x0 = np.array([1.5, 2.0, 3.0])
    d = T(device, x0, requires_grad=True)
    if kind == "irw":
        m.sq_at(ints(device, [1]), d)  # d = [1.5, 4, 3]
        m.dbl_at(ints(device, [0]), d)  # d = [3, 4, 3]: element 1 still holds sq_at's write
    else:
        m.scale_inout(2.0, d)  # d = [3, 4, 6]
        m.add_one(d)  # d = [4, 5, 7]
    d.grad.fill(1.0)
    try:
        if kind == "irw":
            m.sq_at.bwds(ints(device, [1]), d)
            want = [1.0, 2 * x0[1], 1.0]
        else:
            s = T(device, [2.0, 2.0, 2.0], requires_grad=True)
            m.scale_inout.bwds(s, d)
            np.testing.assert_allclose(s.grad.numpy(), x0, **TOL)  # ds = v before * 1
            want = [2.0, 2.0, 2.0]
    except ValueError as exc:
        assert "'d'" in str(exc) or "'v'" in str(exc)
        return
    np.testing.assert_allclose(d.grad.numpy(), want, **TOL)


@pytest.mark.parametrize("on_tape", [False, True])
def test_irw_beside_struct_argument(device, m, on_tape):
    x0 = np.array([1.5, 2.0, 3.0])
    d = T(device, x0, requires_grad=True)
    k = T(device, [2.0], requires_grad=True)
    try:
        if on_tape:
            with pydiff.Tape() as tape:
                m.box_sq(ints(device, [1]), {"k": k}, d)
            tape.backward(d, grad=np.ones(3))
        else:
            m.box_sq(ints(device, [1]), {"k": k}, d)
            d.grad.fill(1.0)
            m.box_sq.bwds(ints(device, [1]), {"k": k}, d)
    except (ValueError, TypeError) as exc:
        assert "compil" not in str(exc).lower(), str(exc)[:300]
        return
    np.testing.assert_allclose(d.grad.numpy(), [1.0, 2 * 2.0 * 2.0, 1.0], **TOL)
    np.testing.assert_allclose(k.grad.numpy(), [4.0], **TOL)


def test_irw_function_with_result_and_gradcheck(device, m):
    x0 = np.array([1.5, 2.0, 3.0])
    d = T(device, x0, requires_grad=True)
    assert pydiff.gradcheck(m.sq_at, (ints(device, [0, 2]), d))


# ---------------------------------------------------------------- refusals that hold


def test_nograd_at_forward_then_bwds_refused(device, m):
    d = T(device, [1.5, 2.0, 3.0])
    m.sq_at(1, d)
    d.requires_grad_()
    d.grad.fill(1.0)
    with pytest.raises(ValueError, match="'d'"):
        m.sq_at.bwds(1, d)


def test_same_tensor_twice_irw_refused(device, m):
    a = T(device, [1.5, 2.0, 3.0], requires_grad=True)
    with pytest.raises(ValueError, match="'a'"), pydiff.Tape():
        m.two_rw(ints(device, [0]), a, a)
    a = T(device, [1.5, 2.0, 3.0], requires_grad=True)
    m.two_rw(ints(device, [0]), a, a)
    a.grad.fill(1.0)
    with pytest.raises(ValueError, match="'a'"):
        m.two_rw.bwds(ints(device, [0]), a, a)


def test_separate_buffers_slangpy_semantics(device, m):
    u = T(device, [1, 2, 3])
    gout = pydiff.zeros((3,), device=device)
    d = T(device, [1.5, 2.0, 3.0]).with_grads(grad_in=u, grad_out=gout)
    m.sq_at(1, d)
    m.sq_at.bwds(1, d)
    np.testing.assert_allclose(gout.numpy(), [0, 8, 0], **TOL)


# ---------------------------------------------------------------- views


def test_view_of_leaf_inplace(device, m):
    x0 = np.arange(1, 7) / 3
    g = np.linspace(-1, 1, 6)
    ii, jj = ints(device, [0, 1]), ints(device, [2, 0])  # flat elements 2 and 3
    x = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        m.cube2(ii, jj, x.reshape((2, 3)))
        y = m.times(x, x, _result="tensor")

    def f(z):
        z1 = z.copy()
        z1[2], z1[3] = z[2] ** 3, z[3] ** 3
        return z1 * z1

    tape.backward(y, grad=g)
    np.testing.assert_allclose(x.grad.numpy(), fd_vjp(f, x0, g), rtol=1e-4)
    x = T(device, x0, requires_grad=True)
    v = x.reshape((2, 3))
    m.cube2(ii, jj, v)
    x.grad.copy_from_numpy(g.astype(np.float32))
    m.cube2.bwds(ii, jj, v)
    ref = g.copy()
    ref[2], ref[3] = 3 * x0[2] ** 2 * g[2], 3 * x0[3] ** 2 * g[3]
    np.testing.assert_allclose(x.grad.numpy(), ref, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- overwrites on a tape


def test_iw_put_some_elements_of_intermediate(device, m):
    x0 = np.array([1.5, 2.0, 3.0, 0.5])
    v0 = np.array([0.7, -1.2])
    g = np.array([1, 2, 3, 4.0])
    x, v = T(device, x0, requires_grad=True), T(device, v0, requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.sq(x, _result="tensor")
        m.put(ints(device, [0, 2]), v, a)
        y = m.times(a, a, _result="tensor")
    tape.backward(y, grad=g)

    def f(xv):
        a = xv[:4] ** 2
        a[0], a[2] = xv[4] ** 2, xv[5] ** 2
        return a * a

    ref = fd_vjp(f, np.concatenate([x0, v0]), g)
    np.testing.assert_allclose(x.grad.numpy(), ref[:4], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(v.grad.numpy(), ref[4:], rtol=1e-4)


def test_iw_put_all_elements_of_intermediate(device, m):
    x0 = np.array([1.5, 2.0])
    x, v = T(device, x0, requires_grad=True), T(device, [0.7, -1.2], requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.sq(x, _result="tensor")
        m.put(ints(device, [0, 1]), v, a)
        y = m.times(a, x, _result="tensor")
    tape.backward(y, grad=np.ones(2))
    np.testing.assert_allclose(x.grad.numpy(), [0.49, 1.44], rtol=1e-5)
    np.testing.assert_allclose(v.grad.numpy(), [2 * 0.7 * 1.5, 2 * -1.2 * 2.0], rtol=1e-5)


def test_iw_put_leaf_one_and_all(device, m):
    x0 = np.array([1.5, 2.0, 3.0])
    v = T(device, [0.7], requires_grad=True)
    w = T(device, [2.0, 3.0, 4.0], requires_grad=True)
    x = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        m.put(1, v, x)
        y = m.times(x, w, _result="tensor")
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), [2, 0, 4], rtol=1e-5)
    np.testing.assert_allclose(v.grad.numpy(), [3 * 2 * 0.7], rtol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), [1.5, 0.49, 3], rtol=1e-5)
    x = T(device, x0, requires_grad=True)
    v.zero_grad()
    with pydiff.Tape() as tape:
        m.put(spy.grid((3,)), v, x)  # v broadcast to every thread
        y = m.times(x, w.detach(), _result="tensor")
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), [0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(v.grad.numpy(), [2 * 0.7 * 9.0], rtol=1e-5)


def test_result_and_out_overwrite_earlier_result(device, m):
    x0, z0 = np.array([1.5, 2.0, 3.0]), np.array([0.5, -1.0, 2.0])
    for how in ("result", "out", "result_of_result"):
        x, z = T(device, x0, requires_grad=True), T(device, z0, requires_grad=True)
        with pydiff.Tape() as tape:
            a = m.sq(x, _result="tensor")
            if how == "result":
                m.sq(z, _result=a)
                ez = 2 * z0 * x0
                ex = z0**2
            elif how == "out":
                m.sq_out(z, a)
                ez = 2 * z0 * x0
                ex = z0**2
            else:
                b = m.sq(z, _result="tensor")
                m.sq(b, _result=a)
                ez = 4 * z0**3 * x0
                ex = z0**4
            y = m.times(a, x, _result="tensor")
        tape.backward(y, grad=np.ones(3))
        np.testing.assert_allclose(x.grad.numpy(), ex, rtol=1e-5, err_msg=how)
        np.testing.assert_allclose(z.grad.numpy(), ez, rtol=1e-5, err_msg=how)


def test_out_and_result_overwrite_of_leaf(device, m):
    x0, z0, w0 = np.array([1.5, 2.0, 3.0]), np.array([0.5, -1.0, 2.0]), np.array([2.0, 3.0, 4.0])
    for how in ("out", "result"):
        x, z = T(device, x0, requires_grad=True), T(device, z0, requires_grad=True)
        w = T(device, w0)
        with pydiff.Tape() as tape:
            if how == "out":
                m.sq_out(z, x)
            else:
                m.sq(z, _result=x)
            y = m.times(x, w, _result="tensor")  # z^2 * w: the leaf's old value is cut off
        tape.backward(y, grad=np.ones(3))
        np.testing.assert_allclose(x.grad.numpy(), 0 * x0, atol=1e-7, err_msg=how)
        np.testing.assert_allclose(z.grad.numpy(), 2 * z0 * w0, rtol=1e-5, err_msg=how)


def test_overwrite_of_value_still_read_is_refused(device, m):
    x, z = T(device, [1.5, 2.0], requires_grad=True), T(device, [0.5, -1.0], requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.sq(x, _result="tensor")
        b = m.times(a, x, _result="tensor")  # its backward needs the first a
        m.sq(z, _result=a)
        y = m.times(a, b, _result="tensor")
    with pytest.raises(RuntimeError, match="overwritten"):
        tape.backward(y, grad=np.ones(2))


# ---------------------------------------------------------------- Function mixes


def _sq_function(m):
    class Sq(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return m.sq(x.detach(), _result="tensor")

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x.numpy() * g.numpy()

    return Sq


def test_function_then_inplace_and_inplace_then_function(device, m):
    Sq = _sq_function(m)
    x0 = np.array([1.5, 2.0, 3.0])
    x = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        y = Sq.apply(x)
        m.sq_at(ints(device, [1]), y)
        z = m.times(y, x, _result="tensor")
    tape.backward(z, grad=np.ones(3))
    np.testing.assert_allclose(
        x.grad.numpy(), [3 * x0[0] ** 2, 5 * x0[1] ** 4, 3 * x0[2] ** 2], rtol=1e-4
    )
    x = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.times(x, x, _result="tensor")
        m.sq_at(ints(device, [2]), a)
        y = Sq.apply(a)
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(
        x.grad.numpy(), [4 * x0[0] ** 3, 4 * x0[1] ** 3, 8 * x0[2] ** 7], rtol=1e-4
    )


def test_function_saved_input_overwritten_in_place_refused(device, m):
    Sq = _sq_function(m)
    x = T(device, [1.5, 2.0, 3.0], requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.times(x, x, _result="tensor")
        y = Sq.apply(a)
        m.sq_at(ints(device, [0]), a)
        z = m.times(y, a, _result="tensor")
    with pytest.raises(RuntimeError, match="overwritten"):
        tape.backward(z, grad=np.ones(3))


def test_function_pattern1_with_inplace_inside(device, m):
    class P1(pydiff.Function):
        @staticmethod
        def forward(ctx, x, idx):
            a = m.times(x, x, _result="tensor")
            m.sq_at(idx, a)
            return a

    x0 = np.array([1.5, 2.0, 3.0])
    x = T(device, x0, requires_grad=True)
    with pydiff.Tape() as tape:
        y = P1.apply(x, ints(device, [1]))
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), [2 * x0[0], 4 * x0[1] ** 3, 2 * x0[2]], rtol=1e-5)


# ---------------------------------------------------------------- the process must live

_HANG_SCRIPT = """
import numpy as np, pydiff, sys
m = pydiff.load_module_from_source("breaker_hang", {src!r})
case = sys.argv[1]
try:
    if case == "read_back":
        d = pydiff.tensor(np.array([1.5, 0.5, -1.0], np.float32), requires_grad=True)
        m.twice_at(1, d)
        d.grad.copy_from_numpy(np.array([1, 2, 3], np.float32))
        m.twice_at.bwds(1, d)
        got, want = d.grad.numpy(), [1.0, 2 * (6 * 0.5 + 1), 3.0]
    else:
        x = pydiff.tensor(np.array([1.5], np.float32), requires_grad=True)
        d = pydiff.zeros((3,))
        with pydiff.Tape() as tape:
            m.two_stores_w(0, x, d)
        tape.backward(d, grad=np.array([1.0, 2.0, 3.0]))
        got, want = x.grad.numpy(), [2 * 1.5 * 1 + 2]
    print("RESULT", np.allclose(got, want, rtol=1e-4), got)
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("case", ["read_back", "two_stores_iw_tape"])
def test_two_stores_do_not_hang(device, case, tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(_HANG_SCRIPT.format(src=HANG_SRC)))
    env = dict(os.environ, PYDIFF_DEVICE=device.type)
    try:
        proc = subprocess.run(
            [sys.executable, str(script), case],
            capture_output=True,
            text=True,
            timeout=10,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("hung (> 10 s)")
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESULT True" in out or "REFUSED" in out, out
