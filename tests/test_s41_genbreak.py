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
