"""Generated elementwise kernels (pydiff.generated): forward values and gradients against
float64 NumPy closed forms and against pydiff's SlangPy path, odd sizes, NaN/inf inputs, and
the calls the generator declines (None/False, nothing done)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import generated
from pydiff.tensor import Tensor

SAMPLES = Path(__file__).resolve().parent.parent / "samples"

SOURCE = """
import slangpy;
[Differentiable] float g_exp(float a, float x) { return exp(a * x); }
[Differentiable] float g_sinpow(float x, float y) { return sin(x) * pow(y, 2.5); }
[Differentiable] float g_div(float x, float y) { return x / y; }
[Differentiable] float g_nodiff(no_diff float s, float x) { return s * x * x; }
[Differentiable] float3 g_vec(float3 v) { return v * 2.0; }
[Differentiable] void g_out(float x, out float y) { y = x * 2.0; }
[Differentiable] float g_tensor(DiffTensor<float, 1> t, int i) { return t[i]; }
int g_int(float x) { return int(x); }
float g_plain(float x) { return x * 3.0; }
"""

# name -> (args builder from arrays, closed forms: value and gradient per tensor parameter)
CASES = {
    "g_exp": (
        lambda a, b: [0.5, a],
        lambda a, b: (np.exp(0.5 * a), {1: 0.5 * np.exp(0.5 * a)}),
    ),
    "g_sinpow": (
        lambda a, b: [a, np.abs(b) + 0.1],
        lambda a, b: (
            np.sin(a) * (np.abs(b) + 0.1) ** 2.5,
            {
                0: np.cos(a) * (np.abs(b) + 0.1) ** 2.5,
                1: 2.5 * np.sin(a) * (np.abs(b) + 0.1) ** 1.5,
            },
        ),
    ),
    "g_div": (
        lambda a, b: [a, b],
        lambda a, b: (a / b, {0: 1.0 / b, 1: -a / b**2}),
    ),
    "g_nodiff": (
        lambda a, b: [1.5, a],
        lambda a, b: (1.5 * a * a, {1: 3.0 * a}),
    ),
}


@pytest.fixture
def mods(device):
    poly = pydiff.load_module(SAMPLES / "polynomial.slang", device=device)
    return poly, pydiff.load_module_from_source("gen_cases", SOURCE, device=device)


def _tensors(device, values: list) -> list:
    return [
        pydiff.tensor(v.astype(np.float32), device=device, requires_grad=True)
        if isinstance(v, np.ndarray)
        else v
        for v in values
    ]


def _slangpy_path(fn, args, up):
    """pydiff's SlangPy path: forward values and gradients (fresh tensors on the same data)."""
    fresh = [
        pydiff.tensor(a.numpy(), device=a.device, requires_grad=True)
        if isinstance(a, Tensor)
        else a
        for a in args
    ]
    y = fn(*fresh, _result="tensor")
    fn.bwds(*fresh, _result=y.with_grads(grad_in=up))
    return y.numpy(), {i: a.grad.numpy() for i, a in enumerate(fresh) if isinstance(a, Tensor)}


def _run(fn, args, up):
    y = generated.forward(fn, args, up.shape)
    assert y is not None
    grads = {i: a.grad_out for i, a in enumerate(args) if isinstance(a, Tensor)}
    if fn.signature.params[0].no_diff:
        grads.pop(0, None)
    assert generated.backward(fn, args, up, grads)
    return y.numpy(), {i: g.numpy() for i, g in grads.items()}


@pytest.mark.parametrize("n", [1, 3, 1023, 4097])
def test_polynomial_matches_closed_form_and_slangpy(device, mods, n):
    poly, _ = mods
    rng = np.random.default_rng(n)
    xs = rng.standard_normal(n).astype(np.float32)
    ups = rng.standard_normal(n).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    up = pydiff.tensor(ups, device=device)
    args = [2.0, np.float32(8.0), -1, x]  # numbers: Python and NumPy floats, ints
    y, grads = _run(poly.polynomial, args, up)
    x64 = xs.astype(np.float64)
    np.testing.assert_allclose(y, 2 * x64 * x64 + 8 * x64 - 1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[3], ups * (4 * x64 + 8), rtol=1e-5, atol=1e-5)
    y_ref, g_ref = _slangpy_path(poly.polynomial, args, up)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_allclose(grads[3], g_ref[3], rtol=1e-6, atol=1e-6)


def test_gradients_add_into_existing_buffers(device, mods):
    poly, _ = mods
    x = pydiff.tensor(np.arange(5, dtype=np.float32), device=device, requires_grad=True)
    up = pydiff.tensor(np.ones(5, np.float32), device=device)
    for _ in range(2):
        assert generated.backward(poly.polynomial, [2.0, 8.0, -1.0, x], up, {3: x.grad_out})
    np.testing.assert_allclose(x.grad.numpy(), 2 * (4 * np.arange(5) + 8))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("n", [3, 1023])
def test_functions_match_closed_form_and_slangpy(device, mods, name, n):
    _, m = mods
    rng = np.random.default_rng(7)
    a = rng.uniform(-2, 2, n).astype(np.float32)
    b = rng.uniform(0.5, 2, n).astype(np.float32) * rng.choice([-1, 1], n).astype(np.float32)
    build, closed = CASES[name]
    args = _tensors(device, build(a, b))
    ups = rng.standard_normal(n).astype(np.float32)
    up = pydiff.tensor(ups, device=device)
    fn = getattr(m, name)
    y, grads = _run(fn, args, up)
    value, dvalue = closed(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(y, value, rtol=2e-5, atol=1e-5)
    for i, d in dvalue.items():
        np.testing.assert_allclose(grads[i], ups * d, rtol=2e-4, atol=1e-4)
    y_ref, g_ref = _slangpy_path(fn, args, up)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-7)
    for i in dvalue:
        np.testing.assert_allclose(grads[i], g_ref[i], rtol=1e-5, atol=1e-6)


def test_nan_and_inf_inputs_follow_ieee(device, mods):
    _, m = mods
    xs = np.array([np.nan, np.inf, -np.inf, 1.0, 0.0, 2.0, -0.0], np.float32)
    ys = np.array([1.0, 1.0, 2.0, 0.0, 0.0, np.inf, 1.0], np.float32)
    args = _tensors(device, [xs, ys])
    up = pydiff.tensor(np.ones(7, np.float32), device=device)
    y, grads = _run(m.g_div, args, up)
    with np.errstate(all="ignore"):
        x64, y64 = xs.astype(np.float64), ys.astype(np.float64)
        np.testing.assert_array_equal(y, (x64 / y64).astype(np.float32))
        # Slang's quotient rule divides by y*y: 0 and inf divisors give NaN gradients, as on
        # SlangPy's path (below); finite, nonzero ones match the closed form.
        ok = np.isfinite(x64) & np.isfinite(y64) & (y64 != 0)
        np.testing.assert_allclose(grads[0][ok], (1 / y64)[ok], rtol=1e-6)
        np.testing.assert_allclose(grads[1][ok], (-x64 / y64**2)[ok], rtol=1e-6)
    y_ref, g_ref = _slangpy_path(m.g_div, args, up)
    np.testing.assert_array_equal(y, y_ref)
    for i in (0, 1):
        np.testing.assert_array_equal(grads[i], g_ref[i])


def test_last_float4_keeps_elements_beyond_the_call(device, mods):
    poly, _ = mods
    base = pydiff.tensor(np.full(8, 100.0, np.float32), device=device)
    view = Tensor(base.native.view((5,)), device, storage=base.storage)
    x = pydiff.tensor(np.ones(5, np.float32), device=device)
    up = pydiff.tensor(np.ones(5, np.float32), device=device)
    assert generated.backward(poly.polynomial, [2.0, 8.0, -1.0, x], up, {3: view})
    np.testing.assert_array_equal(base.numpy(), [112.0] * 5 + [100.0] * 3)


def test_same_gradient_buffer_for_two_parameters_sums(device, mods):
    _, m = mods
    xs = np.array([0.3, 1.0, -0.5], np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    up = pydiff.tensor(np.ones(3, np.float32), device=device)
    assert generated.backward(m.g_sinpow, [x, x], up, {0: x.grad_out, 1: x.grad_out})
    x64 = np.abs(xs.astype(np.float64))
    want = np.cos(x64) * x64**2.5 + 2.5 * np.sin(x64) * x64**1.5
    np.testing.assert_allclose(x.grad.numpy(), np.where(xs > 0, want, np.nan), rtol=1e-5)


def test_declined_calls_fall_back(device, mods, monkeypatch):
    poly, m = mods
    x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
    up = pydiff.tensor(np.ones(4, np.float32), device=device)
    short = pydiff.tensor(np.ones(3, np.float32), device=device)
    generated.reset_stats()
    assert generated.forward(m.g_vec, [x], (4,)) is None  # float3 parameter
    assert generated.forward(m.g_out, [x, x], (4,)) is None  # out parameter
    assert generated.forward(m.g_tensor, [x, 0], (4,)) is None  # tensor-typed parameter
    assert generated.forward(m.g_int, [x], (4,)) is None  # int result
    assert generated.forward(poly.polynomial, [2.0, 8.0, -1.0, np.ones(4)], (4,)) is None
    assert generated.forward(poly.polynomial, [2.0, 8.0, -1.0, short], (4,)) is None  # broadcast
    assert generated.forward(poly.polynomial, [2.0, 8.0, -1.0, 3.0], ()) is None  # no tensor
    assert not generated.backward(poly.polynomial, [2.0, 8.0, -1.0, x], up, {3: x})  # reads x
    wants_number = {0: pydiff.zeros((4,), device=device)}
    assert not generated.backward(poly.polynomial, [2.0, 8.0, -1.0, x], up, wants_number)
    assert not generated.backward(m.g_plain, [x], up, {0: x.grad_out})  # not differentiable
    assert not generated.backward(m.g_nodiff, [x, x], up, {0: x.grad_out})  # no_diff parameter
    with monkeypatch.context() as patch:
        patch.setitem(poly.traps, "polynomial", ["a trap finding"])
        assert generated.forward(poly.polynomial, [2.0, 8.0, -1.0, x], (4,)) is None
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    assert generated.forward(poly.polynomial, [2.0, 8.0, -1.0, x], (4,)) is None
    s = generated.stats()
    assert s["forward_fallback"] == 9 and s["backward_fallback"] == 4
    assert s["declined: PYDIFF_GENERATED=0"] == 1 and s["declined: trap findings"] == 1
    assert s.get("forward", 0) == 0 and s.get("backward", 0) == 0


def test_forward_writes_into_a_given_result(device, mods):
    _, m = mods
    x = pydiff.tensor(np.array([1.0, 2.0], np.float32), device=device)
    out = pydiff.zeros((2,), device=device)
    assert generated.forward(m.g_plain, [x], (2,), out=out) is out
    np.testing.assert_array_equal(out.numpy(), [3.0, 6.0])
    y = generated.forward(m.g_plain, [x], None)  # the shape of the tensor arguments
    assert y.shape == (2,)
    np.testing.assert_array_equal(y.numpy(), [3.0, 6.0])
    assert generated.forward(m.g_plain, [x], (2,), out=pydiff.zeros((3,), device=device)) is None
    np.testing.assert_array_equal(out.numpy(), [3.0, 6.0])
