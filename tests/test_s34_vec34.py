"""Generated kernels for functions on float vectors (pydiff.generated_vector): float2, float3
and float4 parameters and results beside float ones, each vector argument a float tensor of
shape (call..., N) or a floatN tensor of the call's shape. Forward values, gradients added
into buffers holding earlier values (zeroing policies, deterministic mode, a tape's
backward) and .fwds tangents, each against float64 NumPy closed forms or central finite
differences and bitwise against pydiff's SlangPy path (PYDIFF_GENERATED=0)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import generated
from generated_paths import run_both_paths

SOURCE = """
[Differentiable] float3 shade(float3 n, float3 l, float k)
{ return k * max(dot(n, l), 0.0) * n + 0.1 * l; }
[Differentiable] float2 rot(float2 v, float a)
{ return float2(cos(a) * v.x - sin(a) * v.y, sin(a) * v.x + cos(a) * v.y); }
[Differentiable] float len4(float4 v, no_diff float s) { return s * sqrt(dot(v, v) + 1.0); }
[Differentiable] float4 spread(float a, float x) { return float4(a * x, a * x * x, sin(x), a); }
"""


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s34_vec34", SOURCE, device=device)


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(u, v)
        assert np.array_equal(np.signbit(u), np.signbit(v))


def _vec(device, values: np.ndarray, layout: str, **kw) -> pydiff.Tensor:
    """A vector argument: a float tensor (n, N) or a floatN tensor (n,)."""
    dtype = "float" if layout == "float" else f"float{values.shape[-1]}"
    return pydiff.tensor(values.astype(np.float32), device=device, dtype=dtype, **kw)


def _shade64(n, light, k, u):
    d = np.einsum("ij,ij->i", n, light)
    mx, on = np.maximum(d, 0.0)[:, None], (d > 0)[:, None]
    un = np.einsum("ij,ij->i", u, n)[:, None]
    y = k * mx * n + 0.1 * light
    return y, k * (mx * u + on * un * light), k * on * un * n + 0.1 * u, float((mx * un).sum())


# --------------------------------------------------------------------------------------------
# forward and .bwds


@pytest.mark.parametrize("n", [1, 7, 257, 1000])
@pytest.mark.parametrize("layout", ["float", "float3"])
def test_shade_float3_matches_closed_form_and_slangpy_bitwise(device, m, forced, n, layout):
    rng = np.random.default_rng(n)
    ns, ls, us = (rng.standard_normal((n, 3)).astype(np.float32) for _ in range(3))

    def run():
        N = _vec(device, ns, layout, requires_grad=True)
        L = _vec(device, ls, "float", requires_grad=True)  # the other layout beside it
        k = pydiff.tensor([2.0], device=device, requires_grad=True)  # broadcast float
        y = m.shade(N, L, k)
        up = pydiff.tensor(us, device=device, dtype="float3")
        m.shade.bwds(N, L, k, _result=y.with_grads(grad_in=up))
        assert y.shape == (n,) and y.dtype == "float3"
        assert N.grad.dtype == N.dtype and N.grad.shape == N.shape
        return [y.numpy(), N.grad.numpy(), L.grad.numpy(), k.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward: vector"] == 1 and counts["backward: vector"] == 1
    assert counts.get("backward: broadcast", 0) == (n > 1)  # (n = 1: k is of the call)
    assert not counts.get("backward_fallback")
    _same(gen, ref)
    y, gn, gl, gk = _shade64(*(a.astype(np.float64) for a in (ns, ls)), 2.0, us.astype(np.float64))
    np.testing.assert_allclose(gen[0].reshape(n, 3), y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gen[1].reshape(n, 3), gn, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gen[2].reshape(n, 3), gl, rtol=1e-5, atol=1e-5)
    assert abs(float(gen[3][0]) - gk) <= 1e-5 * (1 + abs(gk)) * n


@pytest.mark.parametrize("layout", ["float", "float2"])
def test_float2_rotation_with_a_float_tensor_of_the_call(device, m, forced, layout):
    rng = np.random.default_rng(2)
    vs = rng.standard_normal((300, 2)).astype(np.float32)
    angles = rng.uniform(-3, 3, 300).astype(np.float32)
    us = rng.standard_normal((300, 2)).astype(np.float32)

    def run():
        v = _vec(device, vs, layout, requires_grad=True)
        a = pydiff.tensor(angles, device=device, requires_grad=True)
        y = m.rot(v, a, _result="tensor")
        m.rot.bwds(v, a, _result=y.with_grads(grad_in=_vec(device, us, "float2")))
        return [y.numpy(), v.grad.numpy(), a.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward: vector"] == 1 and counts["backward: vector"] == 1
    _same(gen, ref)
    c, s = np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))
    x, y = vs[:, 0].astype(np.float64), vs[:, 1].astype(np.float64)
    u0, u1 = us[:, 0].astype(np.float64), us[:, 1].astype(np.float64)
    np.testing.assert_allclose(gen[0], np.stack([c * x - s * y, s * x + c * y], 1), atol=1e-5)
    gv = np.stack([c * u0 + s * u1, -s * u0 + c * u1], 1)
    np.testing.assert_allclose(gen[1].reshape(300, 2), gv, atol=1e-5)
    da = u0 * (-s * x - c * y) + u1 * (c * x - s * y)
    np.testing.assert_allclose(gen[2], da, atol=1e-5)


def test_float4_parameter_float_result_no_diff_number(device, m, forced):
    rng = np.random.default_rng(4)
    vs = rng.standard_normal((5, 2, 4)).astype(np.float32)  # a call of shape (5, 2)
    us = rng.standard_normal((5, 2)).astype(np.float32)

    def run():
        v = _vec(device, vs, "float", requires_grad=True)
        w = _vec(device, vs.reshape(10, 4), "float4", requires_grad=True)
        y = m.len4(v, 1.5)
        m.len4.bwds(v, 1.5, _result=y.with_grads(grad_in=pydiff.tensor(us, device=device)))
        z = m.len4(w, 1.5)
        flat = pydiff.tensor(us.ravel(), device=device)
        m.len4.bwds(w, 1.5, _result=z.with_grads(grad_in=flat))
        assert y.shape == (5, 2) and y.dtype == "float"
        return [y.numpy(), v.grad.numpy(), z.numpy(), w.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward: vector"] == 2 and counts["backward: vector"] == 2
    _same(gen, ref)
    v64 = vs.astype(np.float64)
    r = np.sqrt((v64 * v64).sum(-1) + 1.0)
    np.testing.assert_allclose(gen[0], 1.5 * r, rtol=1e-6)
    np.testing.assert_allclose(gen[1], 1.5 * us[..., None] * v64 / r[..., None], atol=1e-6)
    np.testing.assert_array_equal(gen[2], gen[0].ravel())
    np.testing.assert_array_equal(gen[3], gen[1].reshape(10, 4))


def test_float4_result_from_floats_and_result_given(device, m, forced):
    rng = np.random.default_rng(6)
    xs = rng.standard_normal(33).astype(np.float32)
    us = rng.standard_normal((33, 4)).astype(np.float32)

    def run():
        a = pydiff.tensor([0.75], device=device, requires_grad=True)
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        into4 = pydiff.zeros((33,), dtype="float4", device=device)
        into = pydiff.zeros((33, 4), device=device)
        assert m.spread(a, x, _result=into4) is into4
        assert m.spread(0.75, x, _result=into) is into
        y = m.spread(a, x)
        m.spread.bwds(a, x, _result=y.with_grads(grad_in=_vec(device, us, "float4")))
        assert y.dtype == "float4" and y.shape == (33,)
        return [into4.numpy(), into.numpy(), y.numpy(), a.grad.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward: vector"] == 3 and counts["backward: broadcast"] == 1
    _same(gen, ref)
    x64, u = xs.astype(np.float64), us.astype(np.float64)
    want = np.stack([0.75 * x64, 0.75 * x64 * x64, np.sin(x64), np.full(33, 0.75)], 1)
    for got in gen[:3]:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    ga = (u[:, 0] * x64 + u[:, 1] * x64 * x64 + u[:, 3]).sum()
    assert abs(float(gen[3][0]) - ga) <= 1e-5 * (1 + abs(ga))
    gx = u[:, 0] * 0.75 + u[:, 1] * 1.5 * x64 + u[:, 2] * np.cos(x64)
    np.testing.assert_allclose(gen[4], gx, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# gradients holding earlier values: policies, deterministic mode, tapes


@pytest.mark.parametrize("policy", ["accumulate", "reset", "strict"])
def test_policies_on_earlier_gradients(device, m, forced, policy):
    rng = np.random.default_rng(8)
    ns, ls, us, g0 = (rng.standard_normal((70, 3)).astype(np.float32) for _ in range(4))

    def run():
        N = _vec(device, ns, "float3", requires_grad=True)
        L = _vec(device, ls, "float", requires_grad=True)
        N.grad.copy_from_numpy(g0)  # earlier gradients
        L.grad.copy_from_numpy(-g0)
        y = m.shade(N, L, 2.0, _result="tensor")
        yg = y.with_grads(grad_in=_vec(device, us, "float3"))
        with pydiff.zero_policy(policy):
            m.shade.bwds(N, L, 2.0, _result=yg)
            first = [N.grad.numpy(), L.grad.numpy()]
            if policy == "strict":
                with pytest.raises(pydiff.StaleGradientError):
                    m.shade.bwds(N, L, 2.0, _result=yg)
                return first
            m.shade.bwds(N, L, 2.0, _result=yg)
        return first + [N.grad.numpy(), L.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: vector"] >= 1 and not counts.get("backward_fallback")
    _same(gen, ref)
    _, gn, gl, _ = _shade64(*(a.astype(np.float64) for a in (ns, ls)), 2.0, us.astype(np.float64))
    if policy == "reset":  # zeroed once per backward: each call's own gradients
        np.testing.assert_allclose(gen[0], gn, atol=1e-5)
        np.testing.assert_allclose(gen[1], gl, atol=1e-5)
        _same(gen[2:], gen[:2])
    else:  # added to what the buffers held (strict refuses only the second call)
        np.testing.assert_allclose(gen[0], g0 + gn, atol=1e-5)
        np.testing.assert_allclose(gen[1], -g0 + gl, atol=1e-5)
    if policy == "accumulate":
        np.testing.assert_allclose(gen[3], -g0 + 2 * gl, atol=1e-5)


def test_deterministic_mode_and_shared_buffers(device, m, forced):
    rng = np.random.default_rng(9)
    ns, us = (rng.standard_normal((40, 3)).astype(np.float32) for _ in range(2))

    def run():
        N = _vec(device, ns, "float", requires_grad=True)
        k = pydiff.tensor([2.0], device=device, requires_grad=True)
        y = m.shade(N, N, k, _result="tensor").with_grads(grad_in=_vec(device, us, "float3"))
        with pydiff.deterministic():
            m.shade.bwds(N, N, k, _result=y)  # N twice: declined there
        with pydiff.deterministic():
            m.shade.bwds(N.detach(), N, k, _result=y)
        return [N.grad.numpy(), k.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["declined: deterministic mode: a shared gradient buffer"] == 1
    assert counts["backward: vector"] == 1 and counts["backward: broadcast"] == 1
    _same(gen, ref)


def test_shared_gradient_buffer_adds_both_partials(device, m, forced):
    rng = np.random.default_rng(10)
    ns, us = (rng.standard_normal((50, 3)).astype(np.float32) for _ in range(2))
    N = _vec(device, ns, "float3", requires_grad=True)
    y = m.shade(N, N, 2.0, _result="tensor").with_grads(grad_in=_vec(device, us, "float3"))
    m.shade.bwds(N, N, 2.0, _result=y)
    assert generated.stats()["backward: vector"] == 1
    n64, u64 = ns.astype(np.float64), us.astype(np.float64)
    _, gn, gl, _ = _shade64(n64, n64, 2.0, u64)
    np.testing.assert_allclose(N.grad.numpy(), gn + gl, rtol=1e-5, atol=1e-5)


def test_tape_backward_takes_the_vector_kernels_bitwise(device, m, forced):
    rng = np.random.default_rng(11)
    vs = rng.standard_normal((129, 2)).astype(np.float32)
    angles = rng.uniform(-2, 2, 129).astype(np.float32)
    ls = rng.standard_normal((129, 3)).astype(np.float32)
    ups = rng.standard_normal(129).astype(np.float32)

    def run():
        v = _vec(device, vs, "float2", requires_grad=True)
        a = pydiff.tensor(angles, device=device, requires_grad=True)
        L = _vec(device, ls, "float", requires_grad=True)
        with pydiff.Tape() as tape:
            r = m.rot(v, a)  # float2 (129,)
            s = m.spread(1.0, a)  # float4 (129,)
            y = m.len4(s, 2.0)  # float (129,)
            z = m.shade(L, L, 0.5)
        tape.backward(y, grad=ups)
        return [r.numpy(), y.numpy(), z.numpy(), a.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: in tape.backward"] == 2 and counts["backward: vector"] == 2
    _same(gen, ref)
    a64, u64 = angles.astype(np.float64), ups.astype(np.float64)

    def y64(a):
        s = np.stack([a, a * a, np.sin(a), np.ones_like(a)], 1)
        return 2.0 * np.sqrt((s * s).sum(1) + 1.0)

    np.testing.assert_allclose(gen[1], y64(a64), rtol=1e-6)
    h = 1e-6
    fd = u64 * (y64(a64 + h) - y64(a64 - h)) / (2 * h)
    np.testing.assert_allclose(gen[3], fd, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# .fwds


def test_fwds_matches_finite_differences_and_slangpy_bitwise(device, m, forced):
    rng = np.random.default_rng(12)
    ns, ls, un, ul = (rng.standard_normal((300, 3)).astype(np.float32) for _ in range(4))

    def run():
        N = _vec(device, ns, "float").with_tangent(un)
        L = _vec(device, ls, "float3").with_tangent(_vec(device, ul, "float3"))
        y, dy = m.shade.fwds(N, L, (2.0, 0.5))
        w, dw = m.shade.fwds(N, _vec(device, ls, "float"), 2.0)  # L without a tangent
        assert y.dtype == "float3" and y.shape == (300,)
        return [y.numpy(), dy.numpy(), w.numpy(), dw.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["fwds: vector"] == 2 and not counts.get("fwds_fallback")
    _same(gen, ref)
    n64, l64, un64, ul64 = (a.astype(np.float64) for a in (ns, ls, un, ul))
    h = 1e-6

    def f(t):
        return _shade64(n64 + t * un64, l64 + t * ul64, 2.0 + 0.5 * t, n64)[0]

    np.testing.assert_allclose(gen[1], (f(h) - f(-h)) / (2 * h), rtol=1e-4, atol=1e-4)

    def g(t):
        return _shade64(n64 + t * un64, l64, 2.0, n64)[0]

    np.testing.assert_allclose(gen[3], (g(h) - g(-h)) / (2 * h), rtol=1e-4, atol=1e-4)


def test_fwds_float4_parameter_and_result(device, m, forced):
    rng = np.random.default_rng(14)
    vs, uv = (rng.standard_normal((65, 4)).astype(np.float32) for _ in range(2))
    xs, ux = (rng.standard_normal(65).astype(np.float32) for _ in range(2))

    def run():
        v = _vec(device, vs, "float4").with_tangent(_vec(device, uv, "float4"))
        y, dy = m.len4.fwds(v, 1.5)  # no_diff number: no tangent
        a = pydiff.tensor([0.5], device=device).with_tangent([2.0])  # broadcast with a tangent
        x = pydiff.tensor(xs, device=device).with_tangent(ux)
        s, ds = m.spread.fwds(a, x, _result="numpy")
        assert y.dtype == "float" and s.shape == (65, 4)
        return [y.numpy(), dy.numpy(), s, ds]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["fwds: vector"] == 2 and not counts.get("fwds_fallback")
    _same(gen, ref)
    v64, uv64, x64, ux64 = (a.astype(np.float64) for a in (vs, uv, xs, ux))
    r = np.sqrt((v64 * v64).sum(1) + 1.0)
    np.testing.assert_allclose(gen[1], 1.5 * (v64 * uv64).sum(1) / r, rtol=1e-5, atol=1e-6)
    h = 1e-6

    def spread64(t):
        a, x = 0.5 + 2.0 * t, x64 + t * ux64
        return np.stack([a * x, a * x * x, np.sin(x), np.full_like(x, a)], 1)

    np.testing.assert_allclose(gen[2], spread64(0.0), rtol=1e-6, atol=1e-7)
    fd = (spread64(h) - spread64(-h)) / (2 * h)
    np.testing.assert_allclose(gen[3], fd, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# what keeps SlangPy's path


def test_vector_given_a_number_or_broadcast_keeps_slangpy_path(device, m, forced):
    rng = np.random.default_rng(13)
    ns = rng.standard_normal((20, 3)).astype(np.float32)
    N = _vec(device, ns, "float", requires_grad=True)
    one = _vec(device, np.array([[0.0, 1.0, 0.0]]), "float")  # (1, 3): a broadcast float3
    y = m.shade(N, one, 2.0)
    z = m.shade(N, 0.5, 2.0)  # a number fills every component
    s = generated.stats()
    assert s["declined: parameter 'l': tensor of call shape (1,), not the call's (20,)"] == 1
    assert s["declined: parameter 'l': float argument for a vector"] == 1
    assert s.get("forward: vector", 0) == 0
    d = np.maximum(ns[:, 1], 0)[:, None]
    np.testing.assert_allclose(y.numpy(), 2 * d * ns + 0.1 * np.array([0, 1, 0]), atol=1e-6)
    dz = np.maximum(ns.sum(1) * 0.5, 0)[:, None]
    np.testing.assert_allclose(z.numpy(), 2 * dz * ns + 0.05, atol=1e-5)


@pytest.mark.parametrize("layout", ["float", "float4"])
def test_negative_zero_gradients_keep_slangpy_bits(device, m, forced, layout):
    vs = np.zeros((9, 4), np.float32)  # d/dv = up * s * v / r: -0.0 where up < 0
    ups = np.where(np.arange(9) % 2 == 0, -1.0, 1.0).astype(np.float32)
    earlier = np.where(np.arange(36).reshape(9, 4) % 3 == 0, -0.0, 0.0).astype(np.float32)

    def run():
        v = _vec(device, vs, layout, requires_grad=True)
        v.grad.copy_from_numpy(earlier if layout == "float" else earlier.reshape(9, 4))
        y = m.len4(v, 1.5)
        m.len4.bwds(v, 1.5, _result=y.with_grads(grad_in=pydiff.tensor(ups, device=device)))
        return [v.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: vector"] == 1
    _same(gen, ref)


def test_threads_walk_the_call_past_the_dispatch_limit(device, m, forced):
    """Past MAX_GROUPS groups each thread loops over several elements (here 2 groups of 256
    threads for 1000 elements, as 2^24 elements would on a GPU's 65535 groups)."""
    forced.setattr(pydiff.generated_vector, "MAX_GROUPS", 2)
    rng = np.random.default_rng(15)
    ns, ls, us = (rng.standard_normal((1000, 3)).astype(np.float32) for _ in range(3))

    def run():
        N = _vec(device, ns, "float3", requires_grad=True)
        L = _vec(device, ls, "float", requires_grad=True)
        y = m.shade(N, L, 2.0)
        m.shade.bwds(N, L, 2.0, _result=y.with_grads(grad_in=_vec(device, us, "float3")))
        v, dv = m.shade.fwds(N.detach().with_tangent(_vec(device, us, "float3")), L, 2.0)
        return [y.numpy(), N.grad.numpy(), L.grad.numpy(), v.numpy(), dv.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward: vector"] == 1 and counts["backward: vector"] == 1
    assert counts["fwds: vector"] == 1
    _same(gen, ref)
    y, gn, gl, _ = _shade64(*(a.astype(np.float64) for a in (ns, ls)), 2.0, us.astype(np.float64))
    np.testing.assert_allclose(gen[0], y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gen[1], gn, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gen[2], gl, rtol=1e-5, atol=1e-5)
