"""Generated kernels beyond the elementwise first slice (pydiff.generated): broadcast
one-element tensor parameters with gradients, ``.fwds``, and backwards inside a tape or a
zeroing policy. Each against an independent reference (float64 finite differences or
closed forms) and against SlangPy's path, bitwise (the project's determinism promise)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import generated
from generated_paths import run_both_paths

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
SOURCE = """
import slangpy;
[Differentiable] float g_mix(float a, float x, float b) { return a * sin(x) + b * x * x; }
[Differentiable] float g_scaled(no_diff float s, float x) { return s * x * x; }
"""


@pytest.fixture
def poly(device):
    return pydiff.load_module(SAMPLES / "polynomial.slang", device=device)


@pytest.fixture
def mix(device):
    return pydiff.load_module_from_source("gen_paths", SOURCE, device=device)


def _same(a: list, b: list) -> None:
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)  # NaN == NaN; -0.0 and 0.0 compared by value
        assert np.array_equal(np.signbit(u), np.signbit(v))


def _poly64(a, b, c, x):
    return a * x * x + b * x + c


def _fd(loss, value: float, h: float = 1e-4) -> float:
    return (loss(value + h) - loss(value - h)) / (2 * h)


# --------------------------------------------------------------------------------------------
# broadcast parameters


@pytest.mark.parametrize("n", [3, 1023, 4097])
@pytest.mark.parametrize("scalar_shape", [(1,), ()])
def test_broadcast_gradients_match_slangpy_bitwise_and_finite_differences(
    device, poly, forced, n, scalar_shape
):
    rng = np.random.default_rng(n)
    xs = rng.standard_normal(n).astype(np.float32)
    ups = rng.standard_normal(n).astype(np.float32)

    def run():
        a = pydiff.tensor(np.full(scalar_shape, 2.0, np.float32), device=device).requires_grad_()
        b = pydiff.tensor(np.full((1,), 8.0, np.float32), device=device).requires_grad_()
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = poly.polynomial(a, b, -1.0, x, _result="tensor")
        up = pydiff.tensor(ups, device=device)
        poly.polynomial.bwds(a, b, -1.0, x, _result=y.with_grads(grad_in=up))
        return [y.numpy(), a.grad.numpy(), b.grad.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward"] == 1 and counts["backward: broadcast"] == 1
    _same(gen, ref)
    x64, u64 = xs.astype(np.float64), ups.astype(np.float64)
    np.testing.assert_allclose(gen[0], _poly64(2, 8, -1, x64), rtol=1e-5, atol=1e-5)
    fd_a = _fd(lambda a: (u64 * _poly64(a, 8, -1, x64)).sum(), 2.0)
    fd_b = _fd(lambda b: (u64 * _poly64(2, b, -1, x64)).sum(), 8.0)
    scale = np.abs(u64).sum() * 10
    assert abs(float(gen[1].ravel()[0]) - fd_a) <= 1e-6 * scale
    assert abs(float(gen[2][0]) - fd_b) <= 1e-6 * scale
    np.testing.assert_allclose(gen[3], ups * (4 * x64 + 8), rtol=1e-5, atol=1e-5)


def test_broadcast_negative_zero_partials_keep_slangpy_bits(device, poly, forced):
    xs = np.zeros(9, np.float32)  # d/da = up * x^2 = -0.0 where up < 0
    ups = -np.ones(9, np.float32)

    def run():
        a = pydiff.tensor(np.full((1,), 2.0, np.float32), device=device, requires_grad=True)
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        up = pydiff.tensor(ups, device=device)
        y = pydiff.tensor(np.zeros(9, np.float32), device=device)
        poly.polynomial.bwds(a, 8.0, -1.0, x, _result=y.with_grads(grad_in=up))
        return [a.grad.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: broadcast"] == 1
    _same(gen, ref)


def test_broadcast_in_deterministic_mode_and_shared_buffers(device, mix, forced):
    rng = np.random.default_rng(3)
    xs = rng.uniform(-2, 2, 257).astype(np.float32)

    def run():
        a = pydiff.tensor([1.5], device=device, requires_grad=True)
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        up = pydiff.tensor(np.ones(257, np.float32), device=device)
        y = pydiff.tensor(np.zeros(257, np.float32), device=device)
        with pydiff.deterministic():
            mix.g_mix.bwds(a, x, a, _result=y.with_grads(grad_in=up))  # a twice: two sums
            mix.g_mix.bwds(x, x, 0.5, _result=y.with_grads(grad_in=up))  # x twice: declined
        return [a.grad.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: broadcast"] == 1
    assert counts["declined: deterministic mode: a shared gradient buffer"] == 1
    _same(gen, ref)
    x64 = xs.astype(np.float64)
    want_a = np.sin(x64).sum() + (x64 * x64).sum()
    assert abs(float(gen[0][0]) - want_a) <= 1e-5 * abs(want_a)


def test_broadcast_python_numbers_and_other_shapes_decline(device, poly, forced):
    x = pydiff.tensor(np.ones(8, np.float32), device=device, requires_grad=True)
    row = pydiff.tensor(np.ones((2, 1), np.float32), device=device, requires_grad=True)
    up = pydiff.tensor(np.ones(8, np.float32), device=device)
    assert not generated.backward(poly.polynomial, [2.0, 8.0, -1.0, x], up, {0: x.grad_out})
    assert generated.forward(poly.polynomial, [row, 8.0, -1.0, x], None) is None
    a = pydiff.tensor([2.0], device=device, requires_grad=True)
    other = pydiff.zeros((1,), device=device)
    assert not generated.backward(poly.polynomial, [a, 8.0, -1.0, x], up, {0: other})
    s = generated.stats()
    assert s["declined: gradient wanted for a number"] == 1
    assert s["declined: broadcast gradient not the parameter's own buffer"] == 1


# --------------------------------------------------------------------------------------------
# tapes and zeroing policies


def _chain(device, poly, mix, xs, ups, a_value=2.0):
    a = pydiff.tensor([a_value], device=device, requires_grad=True)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        h = poly.polynomial(a, 8.0, -1.0, x, _result="tensor")
        y = mix.g_mix(0.5, h, a, _result="tensor")
    tape.backward(y, grad=ups)
    return tape, y, a, x


def test_tape_backward_takes_generated_kernels_bitwise(device, poly, mix, forced):
    rng = np.random.default_rng(5)
    xs = rng.uniform(-1, 1, 1001).astype(np.float32)
    ups = rng.standard_normal(1001).astype(np.float32)

    def run():
        _, y, a, x = _chain(device, poly, mix, xs, ups)
        return [y.numpy(), a.grad.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: in tape.backward"] == 2 and counts.get("backward_fallback", 0) == 0
    _same(gen, ref)
    x64, u64 = xs.astype(np.float64), ups.astype(np.float64)

    def loss(a):
        h = _poly64(a, 8, -1, x64)
        return (u64 * (0.5 * np.sin(h) + a * h * h)).sum()

    assert abs(float(gen[1][0]) - _fd(loss, 2.0, 1e-5)) <= 1e-5 * np.abs(u64).sum() * 100
    h = _poly64(2, 8, -1, x64)
    dh = u64 * (0.5 * np.cos(h) + 2 * 2 * h)
    np.testing.assert_allclose(gen[2], dh * (4 * x64 + 8), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["accumulate", "reset", "strict"])
def test_tape_zeroing_policies_on_both_paths(device, poly, mix, forced, policy):
    xs = np.linspace(-1, 1, 64, dtype=np.float32)
    ups = np.ones(64, np.float32)

    def run():
        with pydiff.zero_policy(policy):
            tape, y, a, x = _chain(device, poly, mix, xs, ups)
            first = [a.grad.numpy(), x.grad.numpy()]
            if policy == "strict":
                with pytest.raises(pydiff.StaleGradientError):
                    tape.backward(y, grad=ups)
                return first
            tape.backward(y, grad=ups)
            return first + [a.grad.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: in tape.backward"] >= 2
    _same(gen, ref)
    if policy == "accumulate":
        np.testing.assert_array_equal(gen[3], 2 * gen[1])
    elif policy == "reset":
        _same(gen[2:], gen[:2])


def test_tape_overwritten_result_and_read_values(device, poly, mix, forced):
    xs = np.linspace(-1, 1, 40, dtype=np.float32)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = pydiff.tensor(np.full(40, 3.0, np.float32), device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            z = mix.g_mix(1.0, y, 0.0, _result="tensor")  # reads y's old values
            poly.polynomial(2.0, 8.0, -1.0, x, _result=y)  # then overwrites y
            w = mix.g_mix(1.0, y, 0.5, _result="tensor")
            out = poly.polynomial(1.0, 1.0, 0.0, w, _result="tensor")
        with pytest.raises(RuntimeError, match="overwritten"):
            tape.backward(z, grad=np.ones(40))
        tape.backward(out, grad=np.ones(40))
        return [out.numpy(), x.grad.numpy(), y.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: in tape.backward"] == 3
    _same(gen, ref)
    np.testing.assert_array_equal(gen[2], 0.0)  # y's old value fed nothing of `out`


# --------------------------------------------------------------------------------------------
# forward mode


@pytest.mark.parametrize("n", [5, 4097])
def test_fwds_matches_closed_form_and_slangpy_bitwise(device, poly, mix, forced, n):
    rng = np.random.default_rng(n)
    xs = rng.uniform(-2, 2, n).astype(np.float32)
    us = rng.standard_normal(n).astype(np.float32)

    def run():
        x = pydiff.tensor(xs, device=device).with_tangent(us)
        a = pydiff.tensor([1.5], device=device).with_tangent([0.25])
        y, dy = poly.polynomial.fwds(2.0, (8.0, 1.0), -1.0, x)
        v, dv = mix.g_mix.fwds(a, x, 0.5)  # a broadcast tensor with a tangent
        s, ds = mix.g_scaled.fwds(3.0, x, _result="numpy")  # no_diff parameter
        return [y.numpy(), dy.numpy(), v.numpy(), dv.numpy(), s, ds]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["fwds"] == 3 and counts.get("fwds_fallback", 0) == 0
    _same(gen, ref)
    x64, u64 = xs.astype(np.float64), us.astype(np.float64)
    close = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gen[0], _poly64(2, 8, -1, x64), **close)
    np.testing.assert_allclose(gen[1], (4 * x64 + 8) * u64 + x64, **close)
    np.testing.assert_allclose(
        gen[3], 0.25 * np.sin(x64) + (1.5 * np.cos(x64) + x64) * u64, **close
    )
    np.testing.assert_allclose(gen[5], 6 * x64 * u64, **close)


def test_fwds_declines_what_it_does_not_cover(device, poly, forced):
    x = pydiff.tensor(np.ones(4, np.float32), device=device)
    u = pydiff.tensor(np.ones(3, np.float32), device=device)
    assert generated.fwds(poly.polynomial, [2.0, 8.0, -1.0, x], [None, None, None, u]) is None
    y, dy = poly.polynomial.fwds(2.0, 8.0, -1.0, (np.ones(4), np.ones(4)))  # NumPy: SlangPy's
    np.testing.assert_allclose(dy, 12.0)
    # both named (the NumPy pair's since break49: it took SlangPy's path uncounted before)
    assert generated.stats()["fwds_fallback"] == 2
    assert generated.stats()["declined: parameter 'x': a NumPy tangent"] == 1


def test_hand_written_infinite_derivative_keeps_its_nan(device, forced):
    """The add into the gradient buffer is kept apart from the user's derivative: fused,
    the compiler turned ``3 d / (x - x)`` into 0 (SlangPy's path: NaN)."""
    m = pydiff.load_module(SAMPLES.parent / "tests" / "shaders" / "check_nan.slang", device=device)
    ups = np.array([0.3, -1.2, 0.0, 2.0, 1.0], np.float32)

    def run():
        x = pydiff.tensor(np.linspace(-1, 1, 5, dtype=np.float32), device=device)
        x.requires_grad_()
        y = pydiff.zeros((5,), device=device)
        m.inf_grad.bwds(x, _result=y.with_grads(grad_in=pydiff.tensor(ups, device=device)))
        return [x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward"] == 1
    _same(gen, ref)
    assert not np.isfinite(gen[0]).any()


def test_half_conversions_in_the_users_function_round_to_nearest(device, forced):
    # Mesa folded a float texel load followed by half() into one load rounding toward zero:
    # half(0.3337) was 0.33349609 on the generated path, 0.33374023 on SlangPy's and NumPy's
    m = pydiff.load_module_from_source(
        "gen_half_inside",
        """
[Differentiable] float hmul(float s, float x) {
    half hs = half(s); half hx = half(x); return float(hs * hx);
}
""",
        device=device,
    )
    values = np.float32([0.2, 0.3337, 1.0001, 3.14159, 1000.3, 7.0, 1e-6, 6e-8] * 8)
    want = (np.float16(1.1) * values.astype(np.float16)).astype(np.float32)

    def run():
        x = pydiff.tensor(values, device=device, requires_grad=True)
        s = pydiff.tensor(np.float32([1.1]), device=device)
        return [m.hmul(v, x, _result="tensor").numpy() for v in (1.1, s)]

    gen, slang, counts = run_both_paths(forced, run)
    assert counts.get("forward") == 2, counts
    for got in gen + slang:
        np.testing.assert_array_equal(got, want)
