"""The generated-kernel path against SlangPy's path as an adversarial user drives it (s41,
genbreak): the same call on both paths (``run_both_paths``), each checked against float64
closed forms or central finite differences, and against the other bitwise.

Bugs found here (each test below failed before its fix):

- a tensor passed to several parameters (``m.f(x, x, x)``): its partials were added into
  the shared gradient buffer first parameter first, SlangPy's path adds them last parameter
  first (the backward of its loads runs in reverse): other bits, e.g. 1e-8 against 0.

The compact differential cases at the end passed already; they stay as guards.
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from generated_paths import run_both_paths

SOURCE = """
import slangpy;
[Differentiable] float f(float a, float x, float b) { return a * x * x + sin(x) * b; }
[Differentiable] float lin_f(float a, float x, float b) { return a * 1e-8 + x + b * -1.0; }
[Differentiable] float lin_h(float a, float x, float b) { return a + x * -1.0 + b * 1e-8; }
[Differentiable] float2 lin_v(float2 p, float2 q, float2 r)
{ return p * 1e-8 + q + r * -1.0; }
[Differentiable] float d3(float a, float b, float c, float x)
{ return c * x + a * x * x * x + b * sin(x); }
[Differentiable] float2 v(float2 p, float s) { return float2(p.x * p.y * s, sin(p.x) + s * s); }
[Differentiable] float w(float3 p, float4 q) { return dot(p, q.xyz) * q.w; }
"""


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s41_genbreak", SOURCE, device=device)


def _same(gen: list, ref: list) -> None:
    for u, v in zip(gen, ref):
        np.testing.assert_array_equal(u, v)
        assert np.array_equal(np.signbit(u), np.signbit(v))


# --------------------------------------------------------------------------------------------
# a tensor passed to several parameters: one gradient buffer, partials added in SlangPy's order


@pytest.mark.parametrize("name, want", [("lin_f", 1e-8), ("lin_h", 0.0)])
def test_shared_gradient_buffer_adds_in_slangpy_order(device, m, forced, name, want):
    # d/da, d/dx, d/db added into x.grad: ((0 + d_b) + d_x) + d_a on SlangPy's path
    fn = getattr(m, name)

    def run():
        x = pydiff.tensor(np.ones(8, np.float32), device=device, requires_grad=True)
        y = fn(x, x, x)
        fn.bwds(x, x, x, _result=y.with_grads(grad_in=pydiff.ones(8, device=device)))
        return [x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward"] == 1
    np.testing.assert_array_equal(ref[0], np.float32(want))  # SlangPy's bits
    _same(gen, ref)


def test_shared_vector_gradient_buffer_adds_in_slangpy_order(device, m, forced):
    def run():
        p = pydiff.tensor(np.ones((8, 2), np.float32), device=device, dtype="float2")
        p.requires_grad_()
        y = m.lin_v(p, p, p)
        up = pydiff.tensor(np.ones((8, 2), np.float32), device=device, dtype="float2")
        m.lin_v.bwds(p, p, p, _result=y.with_grads(grad_in=up))
        return [p.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: vector"] == 1
    np.testing.assert_array_equal(ref[0], np.float32(1e-8))
    _same(gen, ref)


@pytest.mark.parametrize("pattern", ["aaax", "axax", "xaax"])
def test_shared_buffer_into_earlier_gradients_whatever_the_body(device, m, forced, pattern):
    # the order is the parameters' (reversed), not the body's: c's term comes first there
    rng = np.random.default_rng(7)
    n = 1029
    vals = {k: rng.uniform(-3, 3, n).astype(np.float32) for k in "ax"}
    before = rng.uniform(-50, 50, n).astype(np.float32)

    def run():
        ts = {k: pydiff.tensor(v, device=device, requires_grad=True) for k, v in vals.items()}
        for t in ts.values():
            t.grad.copy_from_numpy(before)
        args = [ts[c] for c in pattern]
        y = m.d3(*args)
        m.d3.bwds(*args, _result=y.with_grads(grad_in=pydiff.full((n,), 1.5, device=device)))
        return [ts["a"].grad.numpy(), ts["x"].grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward"] == 1
    _same(gen, ref)  # before: hundreds of elements an ulp apart
    a, b, c, x = (vals[k].astype(np.float64) for k in pattern)
    partial = {"a": x**3, "b": np.sin(x), "c": x, "x": c + 3 * a * x * x + b * np.cos(x)}
    want = {
        k: before + 1.5 * sum(partial[p] for p, q in zip("abcx", pattern) if q == k) for k in "ax"
    }
    np.testing.assert_allclose(gen[0], want["a"], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gen[1], want["x"], rtol=1e-5, atol=1e-4)


def test_shared_buffer_on_a_tape_and_accumulated(device, m, forced):
    xs = np.linspace(-1, 1, 300, dtype=np.float32)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = m.f(x, x, x)
        tape.backward(y, grad=np.ones(300, np.float32))
        first = x.grad.numpy()
        m.f.bwds(x, x, x, _result=y.with_grads(grad_in=pydiff.ones(300, device=device)))
        return [y.numpy(), first, x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward"] == 2
    _same(gen, ref)
    x = xs.astype(np.float64)
    want = x * x + 2 * x * x + np.cos(x) * x + np.sin(x)
    np.testing.assert_allclose(gen[1], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gen[2], 2 * want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# the user's module's overloads of the core module's functions: the kernels' helpers not theirs

OVERLOADS = """
import slangpy;
float4 select(bool4 c, float4 a, float4 b) { return float4(7.0); }
float4 asfloat(uint4 u) { return float4(7.0); }
uint4 asuint(float4 v) { return uint4(0); }
float asfloat(uint u) { return 7.0; }
uint asuint(float v) { return 0; }
[Differentiable] float f(float a, float x) { return a * x; }
[Differentiable] float d3(float a, float b, float c, float x)
{ return c * x + a * x * x * x + b * sin(x); }
[Differentiable] float2 v(float2 p, float s) { return p * s; }
"""


def test_user_overloads_of_core_functions_do_not_reach_the_kernels(device, forced):
    m = pydiff.load_module_from_source("s41_overloads", OVERLOADS, device=device)
    xs = np.arange(10, dtype=np.float32) - 3
    ps = np.stack([xs, 2 * xs], -1)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = m.f(2.0, x)
        m.f.bwds(2.0, x, _result=y.with_grads(grad_in=pydiff.ones(10, device=device)))
        t = pydiff.tensor(xs, device=device).with_tangent(np.ones(10, np.float32))
        _, dy = m.f.fwds(2.0, t)
        p = pydiff.tensor(ps, device=device, dtype="float2", requires_grad=True)
        w = m.v(p, 3.0)
        up = pydiff.tensor(np.ones((10, 2), np.float32), device=device, dtype="float2")
        m.v.bwds(p, 3.0, _result=w.with_grads(grad_in=up))
        return [y.numpy(), x.grad.numpy(), dy.numpy(), w.numpy(), p.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward"] == 2 and counts["backward"] == 2 and counts["fwds"] == 1
    np.testing.assert_array_equal(gen[0], 2 * xs)  # was 14 everywhere
    np.testing.assert_array_equal(gen[1], np.full(10, 2.0, np.float32))  # was 7
    np.testing.assert_array_equal(gen[2], np.full(10, 2.0, np.float32))
    np.testing.assert_array_equal(gen[3].reshape(10, 2), 3 * ps)
    np.testing.assert_array_equal(gen[4].reshape(10, 2), np.full((10, 2), 3.0, np.float32))
    _same(gen, ref)
