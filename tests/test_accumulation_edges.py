"""Edge values in every accumulation mode (issue 15, class 2): broadcast sums (default and
deterministic, float, half, float3), fixed-point accumulators (FwdDiffTensor) and gradients
added by Functions. The references are NumPy float64 sums (math.fsum for exactness) with
IEEE's rules: inf stays inf, +inf + -inf and NaN give NaN, a finite total stays finite even
where a float32 running sum would overflow."""

import math
import warnings

import numpy as np
import pytest

import slangpy as spy

import pydiff

SOURCE = """
import pydiff;
[Differentiable] float scaled(float a, float x) { return a * x; }
[Differentiable] half scaled_h(half a, half x) { return a * x; }
[Differentiable] float3 scaled3(float3 a, float3 x) { return a * x; }
[Differentiable] float gather_first(FwdDiffTensor<1> w, float x) { return w.load({0}) * x; }
[Differentiable] float ramp(int2 ij, float a) { return a * float(ij.x + 100 * ij.y); }
"""

INF, NAN = np.inf, np.nan


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("accumulation_edges", SOURCE, device=device)


def _ieee_sum(x, axis=None):
    """float64 sum with IEEE's inf/NaN rules and the exact (fsum) finite total."""
    x = np.asarray(x, dtype=np.float64)
    if axis is not None:
        return np.array([_ieee_sum(c) for c in np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])])
    if np.isnan(x).any() or (np.isposinf(x).any() and np.isneginf(x).any()):
        return np.nan
    if np.isinf(x).any():
        return x[np.isinf(x)][0]
    return math.fsum(x)


def _check(got, want, scale):
    got, want = np.float64(got), np.float64(want)
    if np.isnan(want):
        assert np.isnan(got), (got, want)
    elif np.isinf(want):
        assert got == want, (got, want)
    else:
        # float64 summation error of the magnitudes, plus float32 rounding of the result
        assert abs(got - want) <= 1e-14 * scale + 2e-7 * abs(want) + 1e-30, (got, want)


def _bwds(fn, *args, deterministic, **kw):
    if deterministic:
        with pydiff.deterministic():
            fn.bwds(*args, **kw)
    else:
        fn.bwds(*args, **kw)


OVERFLOWING_RUNNING_SUMS = {
    # a float32 running sum reaches inf, the float64 total is finite
    "up_then_down": [3e38] * 4 + [-3e38] * 4,
    "chunks_of_opposite_sign": [3e38] * 100 + [-3e38] * 100 + [1.0],
    "several_passes": [3e38] * 3000 + [-3e38] * 3000 + [5.0],
    "finite_total_past_float32": [2e38] * 3 + [-2e38],  # 4e38 -> inf in float32
    "plus_inf_in_a_later_pass": [1.0] * 6000 + [INF],
    "minus_inf_and_plus_inf_in_different_chunks": [INF] + [0.5] * 6000 + [-INF],
    "nan_among_huge": [3e38, NAN, -3e38],
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("name", list(OVERFLOWING_RUNNING_SUMS))
def test_broadcast_sum_against_float64(device, m, name, deterministic):
    X = np.asarray(OVERFLOWING_RUNNING_SUMS[name], dtype=np.float64)
    a = pydiff.tensor([1.0], device=device, requires_grad=True)
    x = pydiff.tensor(X, device=device)
    y = pydiff.zeros(X.shape, device=device).with_grads(ones=True)
    _bwds(m.scaled, a, x, _result=y, deterministic=deterministic)
    want = _ieee_sum(X.astype(np.float32))
    if np.isfinite(want) and abs(want) > float(np.finfo(np.float32).max):
        want = np.copysign(INF, want)  # rounded once to float32
    scale = np.abs(X[np.isfinite(X)]).sum()
    _check(a.grad.numpy()[0], want, scale)


def test_broadcast_sum_is_added_to_an_existing_inf_gradient(device, m):
    a = pydiff.tensor([1.0], device=device, requires_grad=True)
    a.grad.copy_from_numpy(np.array([INF], dtype=np.float32))
    X = np.array([-INF, 1.0])
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    m.scaled.bwds(a, pydiff.tensor(X, device=device), _result=y)
    assert np.isnan(a.grad.numpy()[0])  # inf + (-inf) = NaN


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_float3_components_follow_ieee_independently(device, m, deterministic):
    X = np.ones((70, 3))
    X[3, 0] = INF  # component 0: +inf
    X[5, 1], X[60, 1] = INF, -INF  # component 1: NaN
    X[:4, 2], X[4:8, 2] = 3e38, -3e38  # component 2: finite (float32 running sum overflows)
    a = pydiff.tensor([[1.0, 1.0, 1.0]], dtype="float3", device=device, requires_grad=True)
    x = pydiff.tensor(X, dtype="float3", device=device)
    y = pydiff.zeros((70,), dtype="float3", device=device).with_grads(ones=True)
    _bwds(m.scaled3, a, x, _result=y, deterministic=deterministic)
    got = a.grad.numpy().reshape(3)
    want = _ieee_sum(X.astype(np.float32), axis=0)
    for c in range(3):
        _check(got[c], want[c], np.abs(X[np.isfinite(X[:, c]), c]).sum())


@pytest.mark.parametrize(
    "values,want",
    [([INF, 1.0, 2.0], INF), ([-INF, 1.0], -INF), ([INF, -INF], NAN), ([NAN, 1.0], NAN)],
    ids=["plus_inf", "minus_inf", "both", "nan"],
)
def test_half_broadcast(device, m, values, want):
    X = np.asarray(values)
    a = pydiff.tensor([1.0], dtype="half", device=device, requires_grad=True)
    x = pydiff.tensor(X, dtype="half", device=device)
    y = pydiff.zeros(X.shape, dtype="half", device=device).with_grads(ones=True)
    m.scaled_h.bwds(a, x, _result=y)
    _check(a.grad.numpy().astype(np.float64)[0], want, 0.0)


@pytest.mark.parametrize(
    "values,match",
    [
        ([INF, 1.0], "NaN or infinite"),
        ([-INF], "NaN or infinite"),
        ([INF, -INF], "NaN or infinite"),
        ([NAN], "NaN or infinite"),
        ([1e30], "range"),
        ([2.0**29] * 4, "range"),
    ],
    ids=["plus_inf", "minus_inf", "both", "nan", "huge", "partial_sums_past_2^31"],
)
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_fixed_point_refuses_what_int64_cannot_hold(device, m, values, match, deterministic):
    """FwdDiffTensor gradients are int64 fixed point: inf, NaN and out-of-range values cannot
    be held, so the backward raises (never a wrapped or silently finite number)."""
    X = np.asarray(values)
    w = pydiff.tensor([1.0], device=device, requires_grad=True)
    y = pydiff.empty(X.shape, device=device).with_grads(ones=True)
    with pytest.raises(
        pydiff.GradientOverflowError, match=rf"gather_first: parameter 'w'.*{match}"
    ):
        _bwds(
            m.gather_first,
            w,
            pydiff.tensor(X, device=device),
            _result=y,
            deterministic=deterministic,
        )


def test_fixed_point_finite_values_match_float64(device, m):
    X = np.array([1e8, -1e8, 3.5, 2.0**-30, -7.25] * 20)
    w = pydiff.tensor([0.0], device=device, requires_grad=True)
    y = pydiff.empty(X.shape, device=device).with_grads(ones=True)
    m.gather_first.bwds(w, pydiff.tensor(X, device=device), _result=y)
    _check(w.grad.numpy()[0], math.fsum(X.astype(np.float32)), 0.0)


class _FixedGradient(pydiff.Function):
    """Identity whose backward returns the gradient saved on the context (``ctx.g``)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return pydiff.ops.mul(x, pydiff.ones(x.shape, device=x.device))

    @staticmethod
    def backward(ctx, grad):
        return ctx.g, None


@pytest.mark.parametrize("n", [6, 8], ids=["padded", "whole_float4s"])
def test_function_gradients_add_with_ieee_rules(device, n):
    """A Function's gradient is added into x.grad by the float4 accumulate kernel."""
    before = np.array([INF, INF, -INF, 1.0, NAN, 3e38, 2.0, -1.0], dtype=np.float32)[:n]
    added = np.array([1.0, -INF, -INF, INF, 1.0, 3e38, NAN, 1.0], dtype=np.float32)[:n]
    x = pydiff.tensor(np.zeros(n), device=device, requires_grad=True)
    x.grad.copy_from_numpy(before)
    g = pydiff.tensor(added, device=device)
    with pydiff.Tape() as tape:
        y = _FixedGradient.apply(x, g)
    with pydiff.zero_policy("accumulate"):
        tape.backward(y, grad=np.ones(n))
    with np.errstate(all="ignore"):
        want = before.astype(np.float64) + added.astype(np.float64)
        want = np.where(np.abs(want) > float(np.finfo(np.float32).max), np.sign(want) * INF, want)
    got = x.grad.numpy().astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])


@pytest.mark.parametrize(
    "grid",
    [
        {"shape": (40, 3)},
        {"shape": (40, 3), "stride": (2, 3)},
        {"shape": (40, 3), "offset": (5, 1)},
    ],
    ids=["plain", "strided", "offset"],
)
def test_grid_calls_are_summed_by_pydiff_in_deterministic_mode(device, m, grid):
    """A broadcast parameter of a call driven by spy.grid (any stride or offset) gets pydiff's
    ordered sum: no NondeterminismWarning, bitwise repeatable, and d/da sum(a * id) is the
    float64 sum of the ids the forward sees (read back with a = 1)."""
    ids = m.ramp(spy.grid(**grid), pydiff.tensor([1.0], device=device), _result="tensor")
    want = math.fsum(ids.numpy().astype(np.float64).ravel())
    bits = set()
    for _ in range(3):
        a = pydiff.tensor([3.0], device=device, requires_grad=True)
        y = pydiff.zeros(grid["shape"], device=device).with_grads(ones=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", pydiff.NondeterminismWarning)
            with pydiff.deterministic():
                m.ramp.bwds(spy.grid(**grid), a, _result=y)
        bits.add(a.grad.numpy().tobytes())
        assert a.grad.numpy()[0] == np.float32(want)
    assert len(bits) == 1
