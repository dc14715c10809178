"""Deterministic, accurate gradient accumulation (docs/determinism.md).

Many contributions into one gradient element, through the two reductions pydiff owns:
broadcast parameters of vectorised calls (full-shape buffer, compensated fixed-order sums)
and pydiff's FwdDiffTensor (fixed-point int64 atomics). Checked: bitwise identical runs,
relative error <= 1e-6 against a float64 NumPy sum, no float saturation, half rounded once.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import lint_atomics

RNG = np.random.default_rng(6)


@pytest.fixture(autouse=True)
def _default_mode():
    pydiff.set_deterministic(False)
    yield
    pydiff.set_deterministic(False)


def _rel(got: float, want: float) -> float:
    return abs(float(got) - want) / abs(want)


def _poly_args(device, n: int):
    m = pydiff.load_module("samples/polynomial.slang", device=device)
    xs = RNG.uniform(0.5, 1.0, n).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    y = pydiff.empty((n,), device=device).with_grads(ones=True)
    return m, xs, x, y


def _broadcast_runs(device, n: int, runs: int) -> tuple[set, float, float]:
    """a.grad of polynomial(a, 8, -1, x) over n elements (= sum x^2), ``runs`` times."""
    m, xs, x, y = _poly_args(device, n)
    a = pydiff.tensor([2.0], device=device, requires_grad=True)
    bits, value = set(), 0.0
    for _ in range(runs):
        a.zero_grad()
        m.polynomial.bwds(a, 8.0, -1.0, x, _result=y)
        got = a.grad.numpy()
        bits.add(got.tobytes())
        value = float(got[0])
    return bits, value, float(np.sum(xs.astype(np.float64) ** 2))


@pytest.mark.parametrize("n", [1 << 20, 1 << 24])
def test_broadcast_parameter_is_bitwise_reproducible_and_accurate(device, n):
    runs = 10 if n == 1 << 20 else 3  # 10 runs at 2^24: test_slow_ten_runs_at_2_24
    with pydiff.deterministic():
        bits, value, want = _broadcast_runs(device, n, runs)
    assert len(bits) == 1
    assert _rel(value, want) <= 1e-6
    _, default_value, default_want = _broadcast_runs(device, n, 1)  # pydiff's sum in every mode
    assert _rel(default_value, default_want) <= 1e-6


@pytest.mark.slow
def test_slow_ten_runs_at_2_24(device, load):
    with pydiff.deterministic():
        bits, value, want = _broadcast_runs(device, 1 << 24, 10)
        assert len(bits) == 1 and _rel(value, want) <= 1e-6
        fixed_bits, fixed_value, fixed_want = _fixed_point_runs(device, load, 1 << 24, 10)
        assert len(fixed_bits) == 1 and _rel(fixed_value, fixed_want) <= 1e-6


def test_four_accumulated_runs_do_not_saturate(device):
    """Float atomics stop at 2^24 = 16777216 adding four such runs; pydiff reaches ~2.6e7."""
    n = 1 << 24
    m, xs, x, y = _poly_args(device, n)
    a = pydiff.tensor([2.0], device=device, requires_grad=True)
    for _ in range(4):
        m.polynomial.bwds(a, 8.0, -1.0, x, _result=y)
    want = 4 * float(np.sum(xs.astype(np.float64) ** 2))
    assert want > 2 * 16777216
    assert _rel(a.grad.numpy()[0], want) <= 1e-6


def test_partial_broadcast_sums_the_right_axes(device):
    """A (cols,) bias and a (rows, 1) column broadcast over a (rows, cols) call."""
    m = pydiff.load_module("samples/polynomial.slang", device=device)
    rows, cols = 300, 7
    xs = RNG.standard_normal((rows, cols)).astype(np.float32)
    g = RNG.standard_normal((rows, cols)).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    b = pydiff.tensor(RNG.standard_normal(cols), device=device, requires_grad=True)
    c = pydiff.tensor(np.zeros((rows, 1)), device=device, requires_grad=True)
    y = pydiff.empty((rows, cols), device=device).with_grads()
    y.grad.copy_from_numpy(g)
    with pydiff.deterministic():
        m.polynomial.bwds(1.5, b, c, x, _result=y)
    np.testing.assert_allclose(
        b.grad.numpy(), (xs * g).astype(np.float64).sum(0), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        c.grad.numpy()[:, 0], g.astype(np.float64).sum(1), rtol=1e-6, atol=1e-6
    )


def test_broadcast_respects_zero_policies(device):
    m, xs, x, y = _poly_args(device, 1000)
    a = pydiff.tensor([2.0], device=device, requires_grad=True)
    want = float(np.sum(xs.astype(np.float64) ** 2))
    m.polynomial.bwds(a, 8.0, -1.0, x, _result=y)
    with pydiff.zero_policy("reset"):
        m.polynomial.bwds(a, 8.0, -1.0, x, _result=y)
    assert _rel(a.grad.numpy()[0], want) <= 1e-6
    with (
        pydiff.zero_policy("strict"),
        pytest.raises(pydiff.StaleGradientError, match="parameter 'a'"),
    ):
        m.polynomial.bwds(a, 8.0, -1.0, x, _result=y)


def test_same_tensor_for_two_parameters_is_reproducible(device):
    """polynomial(x, x, x, x): four adds into each element meet in one order."""
    m = pydiff.load_module("samples/polynomial.slang", device=device)
    xs = RNG.standard_normal(4096).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.empty((4096,), device=device).with_grads(ones=True)
    with pydiff.deterministic():
        m.polynomial.bwds(x, x, x, x, _result=y)
    x64 = xs.astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), 3 * x64**2 + 2 * x64 + 1, rtol=1e-5)


def test_half_parameter_sums_in_float_and_rounds_once(device, load):
    """Half atomics stop at 32.0 here (the ulp of half at 32 exceeds 0.005 * 2): pydiff
    sums in float32 and rounds to half once."""
    d = load("determinism", device)
    n = 1 << 16
    xs = np.full(n, 0.005, np.float16)
    x = pydiff.tensor(xs, device=device)
    a = pydiff.tensor(np.ones(1, np.float16), dtype="half", device=device, requires_grad=True)
    a.grad.copy_from_numpy(np.zeros(1))  # SlangPy's clear() misses an odd trailing half
    y = pydiff.empty((n,), dtype="half", device=device).with_grads(ones=True)
    d.half_scale.bwds(a, x, _result=y)
    want = np.float16(np.sum(xs.astype(np.float64)))  # 327.8 rounded once
    assert a.grad.numpy()[0] == want


def _fixed_point_runs(device, load, n: int, runs: int) -> tuple[set, float, float]:
    d = load("determinism", device)
    xs = RNG.uniform(0.5, 1.0, n).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    y = pydiff.empty((n,), device=device).with_grads(ones=True)
    w = pydiff.tensor([3.0], device=device, requires_grad=True)
    bits, value = set(), 0.0
    for _ in range(runs):
        w.zero_grad()
        d.gather_first.bwds(w, x, _result=y)
        bits.add(w.grad.numpy().tobytes())
        value = float(w.grad.numpy()[0])
    return bits, value, float(np.sum(xs.astype(np.float64)))


@pytest.mark.parametrize("n", [1 << 20, 1 << 24])
def test_fwd_diff_tensor_gradient_is_fixed_point(device, load, n):
    """Every thread adds into w[0] of a FwdDiffTensor: exact and the same bits every run."""
    runs = 10 if n == 1 << 20 else 2
    bits, value, want = _fixed_point_runs(device, load, n, runs)
    assert len(bits) == 1
    assert _rel(value, want) <= 1e-6


def _linear_setup(device, load, batch=4096, fin=16, fout=8):
    d = load("determinism", device)
    X = RNG.uniform(0.5, 1.5, (batch, fin)).astype(np.float32)
    W = RNG.uniform(-1.0, 1.0, (fout, fin)).astype(np.float32)
    G = RNG.uniform(0.5, 1.5, (batch, fout)).astype(np.float32)
    w = pydiff.tensor(W, device=device, requires_grad=True)
    x = pydiff.tensor(X, device=device)
    bias = pydiff.tensor(np.zeros(fout), device=device, requires_grad=True)
    bi = pydiff.tensor(np.arange(batch, dtype=np.int32).reshape(batch, 1), device=device)
    oi = pydiff.tensor(np.arange(fout, dtype=np.int32).reshape(1, fout), device=device)
    return d, (bi, oi, w, x, bias), X, W, G


def test_linear_layer_weight_gradient_over_batch_4096(device, load):
    d, (bi, oi, w, x, bias), X, W, G = _linear_setup(device, load)
    y = d.linear(bi, oi, w, x, bias, _result="tensor")
    np.testing.assert_allclose(y.numpy(), X @ W.T, rtol=1e-5, atol=1e-5)
    y = y.with_grads()
    y.grad.copy_from_numpy(G)
    grads = set()
    with pydiff.deterministic():
        for _ in range(10):
            w.zero_grad()
            bias.zero_grad()
            d.linear.bwds(bi, oi, w, x, bias, _result=y)
            grads.add(w.grad.numpy().tobytes() + bias.grad.numpy().tobytes())
    assert len(grads) == 1
    want = G.astype(np.float64).T @ X.astype(np.float64)
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(bias.grad.numpy(), G.astype(np.float64).sum(0), rtol=1e-6)


def test_linear_layer_through_the_tape(device, load):
    d, (bi, oi, w, x, bias), X, W, G = _linear_setup(device, load, batch=1024)
    results = set()
    with pydiff.deterministic():
        for _ in range(3):
            w.zero_grad()
            with pydiff.Tape() as tape:
                y = d.linear(bi, oi, w, x, bias, _result="tensor")
            tape.backward(y, grad=G)
            results.add(w.grad.numpy().tobytes())
    assert len(results) == 1
    np.testing.assert_allclose(
        w.grad.numpy(), G.astype(np.float64).T @ X.astype(np.float64), rtol=1e-6
    )


def test_ops_linear_weight_gradient_is_bitwise_reproducible(device):
    X = RNG.standard_normal((512, 16)).astype(np.float32)
    W = RNG.standard_normal((8, 16)).astype(np.float32)
    results = set()
    with pydiff.deterministic():
        for _ in range(3):
            x = pydiff.tensor(X, device=device)
            w = pydiff.tensor(W, device=device, requires_grad=True)
            with pydiff.Tape() as tape:
                loss = pydiff.ops.sum(pydiff.ops.linear(x, w))
            tape.backward(loss)
            results.add(w.grad.numpy().tobytes())
    assert len(results) == 1


def test_fixed_point_overflow_raises_and_nan_is_carried(device, load):
    d = load("determinism", device)
    w = pydiff.tensor([1.0], device=device, requires_grad=True)
    x = pydiff.tensor(np.full(4, 2.0**29), device=device)  # 4 * 2^29 = 2^31: out of range
    y = pydiff.empty((4,), device=device).with_grads(ones=True)
    with pytest.raises(pydiff.GradientOverflowError, match=r"gather_first: parameter 'w'.*2\^31"):
        d.gather_first.bwds(w, x, _result=y)
    big = pydiff.tensor([2.0**31], device=device)
    with pytest.raises(pydiff.GradientOverflowError, match="range"):
        d.gather_first.bwds(w, big, _result=pydiff.empty((1,), device=device).with_grads(ones=True))
    # NaN and inf are carried beside the int64 words (IEEE, like any float sum): no error
    w = pydiff.tensor([1.0], device=device, requires_grad=True)
    nan = pydiff.tensor([np.nan], device=device)
    d.gather_first.bwds(w, nan, _result=pydiff.empty((1,), device=device).with_grads(ones=True))
    assert np.isnan(w.grad.numpy()[0])


def test_deterministic_mode_switches():
    assert not pydiff.is_deterministic()
    with pydiff.deterministic():
        assert pydiff.is_deterministic()
        with pydiff.deterministic(False):
            assert not pydiff.is_deterministic()
    pydiff.set_deterministic(True)
    assert pydiff.is_deterministic()


def test_deterministic_mode_warns_about_float_atomics_in_user_shaders(device, load):
    d = load("determinism", device)
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    total = spy.Tensor.zeros(device.native, (1,), "float").storage
    y = pydiff.empty((2,), device=device).with_grads(ones=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d.uses_splat.bwds(x, total, _result=y)  # default mode: no promise, no warning
    with pydiff.deterministic():
        with pytest.warns(
            pydiff.NondeterminismWarning,
            match=r"determinism\.uses_splat\.bwds.*InterlockedAdd' in splat_bwd\(\)",
        ):
            d.uses_splat.bwds(x, total, _result=y)
        w = pydiff.tensor([1.0], device=device, requires_grad=True)
        ids = pydiff.tensor(np.arange(4, dtype=np.int32), device=device)
        with pytest.warns(
            pydiff.NondeterminismWarning, match=r"plain_gather\.bwds.*parameter 'w' is a SlangPy"
        ):
            d.plain_gather.bwds(
                ids, w, _result=pydiff.empty((4,), device=device).with_grads(ones=True)
            )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            d.gather_first.bwds(
                w,
                pydiff.tensor([1.0], device=device),
                _result=pydiff.empty((1,), device=device).with_grads(ones=True),
            )


def test_lint_finds_float_atomics_through_calls_and_derivatives():
    src = """
    void f_bwd(inout DifferentialPair<float> x, float d) { InterlockedAddF32(buf, 0, d); }
    [Differentiable][BackwardDerivative(f_bwd)] float f(float x) { return x; }
    [Differentiable] float g(float x) { return f(x) + 1.0; }
    [Differentiable] float clean(float x) { return x * x; }
    """
    found = lint_atomics.float_atomic_functions(src)
    assert set(found) == {"f_bwd", "f", "g"}
    assert "f_bwd()" in found["g"]


def test_deterministic_mode_warns_when_the_call_shape_is_unknown(device):
    """A struct argument given as a dict of tensors: pydiff cannot tell the call's shape, so
    a (1,) parameter may be broadcast with float atomics; deterministic mode says so. (A
    float tensor for a float3 parameter no longer hides the shape: tests/
    test_accumulation_edges.py.)"""
    m = pydiff.load_module_from_source(
        "det_unknown_shape",
        "struct P { float3 v; };\n"
        "[Differentiable] float f3(float a, P p) { return a * (p.v.x + p.v.y * p.v.z); }",
        device=device,
    )
    V = np.random.default_rng(3).random((64, 3)).astype(np.float32)
    a = pydiff.tensor([1.0], device=device, requires_grad=True)
    v = {"v": pydiff.tensor(V, dtype="float3", device=device)}
    y = m.f3(a, v, _result="tensor")
    with (
        pydiff.deterministic(),
        pytest.warns(
            pydiff.NondeterminismWarning, match=r"cannot tell the shape of this call.*'a'"
        ),
    ):
        m.f3.bwds(a, v, _result=y.with_grads(ones=True))
