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


FIXED_POINT_IEEE = {
    "plus_inf": [INF, 1.0, 2.0],
    "minus_inf": [-INF, 1.0],
    "both": [INF, 3.0, -INF],
    "nan": [NAN, 1.0],
    "nan_and_inf": [INF, NAN],
    "inf_beside_an_out_of_range_sum": [2.0**29] * 5 + [INF],  # inf + anything finite = inf
    "inf_beside_an_out_of_range_contribution": [1e30, -INF],
}


@pytest.mark.parametrize("name", list(FIXED_POINT_IEEE))
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_fixed_point_carries_ieee_values(device, m, name, deterministic):
    """FwdDiffTensor gradients are int64 fixed point; the inf and NaN it cannot hold are
    carried per element beside it, so the gradient is what a float64 sum gives."""
    X = np.asarray(FIXED_POINT_IEEE[name])
    w = pydiff.tensor([1.0], device=device, requires_grad=True)
    y = pydiff.empty(X.shape, device=device).with_grads(ones=True)
    _bwds(
        m.gather_first, w, pydiff.tensor(X, device=device), _result=y, deterministic=deterministic
    )
    _check(w.grad.numpy()[0], _ieee_sum(X), 0.0)


@pytest.mark.parametrize(
    "values",
    [[1e30], [-1e30], [2.0**29] * 4, [-(2.0**29)] * 5],
    ids=["huge", "-huge", "2^31", "-2^31-"],
)
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_fixed_point_refuses_finite_values_out_of_range(device, m, values, deterministic):
    """A finite contribution or partial sum out of the int64 range raises (never a wrapped or
    silently clipped number). -2^31 - 2^29: the negative side, detected by comparisons (no
    signed wrap-around, which CUDA C++ may fold away)."""
    X = np.asarray(values)
    w = pydiff.tensor([1.0], device=device, requires_grad=True)
    y = pydiff.empty(X.shape, device=device).with_grads(ones=True)
    with pytest.raises(pydiff.GradientOverflowError, match=r"gather_first: parameter 'w'.*range"):
        _bwds(
            m.gather_first,
            w,
            pydiff.tensor(X, device=device),
            _result=y,
            deterministic=deterministic,
        )


def test_fixed_point_ieee_values_stay_in_their_elements(device, m):
    """Per element: inf in one gradient element, NaN in another, finite in the rest, each
    added to what the gradient held (inf + -inf = NaN there too)."""
    mm = pydiff.load_module_from_source(
        "accumulation_gather_all",
        "import pydiff;\n"
        "[Differentiable] float gather(FwdDiffTensor<1> w, int i, float x) "
        "{ return w.load({i}) * x; }",
        device=device,
    )
    idx = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4], dtype=np.int32)
    X = np.array([INF, 1.0, INF, -INF, NAN, 2.0, 1.5, -0.25, 1.0])
    before = np.array([1.0, 0.0, 0.0, 2.0, -INF], dtype=np.float32)
    w = pydiff.tensor(np.zeros(5), device=device, requires_grad=True)
    w.grad.copy_from_numpy(before)
    y = pydiff.empty((9,), device=device).with_grads(ones=True)
    mm.gather.bwds(
        w,
        pydiff.tensor(idx, dtype="int", device=device),
        pydiff.tensor(X, device=device),
        _result=y,
    )
    got = w.grad.numpy().astype(np.float64)
    for e in range(5):
        want = _ieee_sum(np.concatenate([[before[e]], X[idx == e]]))
        _check(got[e], want, 0.0)


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


# Coverage: broadcast parameters pydiff now sums itself (no float atomics, no
# NondeterminismWarning): half vectors, float tensors for float vector/matrix parameters
# (element axes), and calls whose other arguments are call_id/thread_id/wang_hash.

COVERAGE_SOURCE = """
[Differentiable] half3 hshift(half3 b, half3 x) { return x * b + b; }
[Differentiable] float3 fshift(float3 b, float3 x) { return x * b + b; }
[Differentiable] float2x2 mshift(float2x2 b, float2x2 x) { return x + b * 3.0; }
[Differentiable] float arr3(float a[3], float x) { return (a[0] + 2.0 * a[1] + 3.0 * a[2]) * x; }
[Differentiable] float by_id(int i, float a) { return a * float(i); }
[Differentiable] float by_id2(int2 ij, float a) { return a * float(ij.x + 7 * ij.y); }
[Differentiable] float by_thread(int3 t, float a) { return a * float(t.x); }
[Differentiable] float by_hash(uint h, float a) { return a * float(h % 5u); }
"""


@pytest.fixture(scope="module")
def cov(device):
    return pydiff.load_module_from_source("accumulation_coverage", COVERAGE_SOURCE, device=device)


def _repeat_bits(run, times=3):
    """run() -> gradient array, called ``times`` in deterministic mode with
    NondeterminismWarning as an error; returns the first result after checking all are
    bitwise equal."""
    out = []
    for _ in range(times):
        with warnings.catch_warnings():
            warnings.simplefilter("error", pydiff.NondeterminismWarning)
            with pydiff.deterministic():
                out.append(run())
    assert len({o.tobytes() for o in out}) == 1
    return out[0]


def refuse_half3_on_cuda(device) -> bool:
    """half3 gradients are refused on CUDA (wrong there, seen on an H200): check that."""
    if device.type != "cuda":
        return False
    with pytest.raises(TypeError, match="half3"):
        pydiff.tensor([[1.0, 2.0, 3.0]], dtype="half3", device=device, requires_grad=True)
    return True


@pytest.mark.parametrize("n", [5, 1000], ids=["small", "large"])
def test_half3_broadcast_is_summed_by_pydiff(device, cov, n):
    if refuse_half3_on_cuda(device):
        return
    X = np.random.default_rng(n).uniform(-1, 1, (n, 3)).astype(np.float16)

    def run():
        b = pydiff.tensor([[0.5, 1.0, -2.0]], dtype="half3", device=device, requires_grad=True)
        y = pydiff.zeros((n,), dtype="half3", device=device).with_grads(ones=True)
        cov.hshift.bwds(b, pydiff.tensor(X, dtype="half3", device=device), _result=y)
        return b.grad.numpy()

    got = _repeat_bits(run).astype(np.float64).reshape(3)
    want = (X.astype(np.float64) + 1.0).sum(0)  # d/db (x b + b) = x + 1, summed
    # one rounding to half at the end (the half32 sum of 1000 terms would be off by far more)
    np.testing.assert_allclose(got, want, rtol=2**-10, atol=2**-14)


def test_half3_components_follow_ieee(device, cov):
    if refuse_half3_on_cuda(device):
        return
    X = np.ones((40, 3))
    X[7, 0] = INF
    X[8, 1], X[9, 1] = INF, -INF
    X[:3, 2] = 60000.0  # the half total overflows: rounds to inf once, at the end
    b = pydiff.tensor([[1.0, 1.0, 1.0]], dtype="half3", device=device, requires_grad=True)
    y = pydiff.zeros((40,), dtype="half3", device=device).with_grads(ones=True)
    cov.hshift.bwds(b, pydiff.tensor(X, dtype="half3", device=device), _result=y)
    got = b.grad.numpy().astype(np.float64).reshape(3)
    assert got[0] == INF and np.isnan(got[1]) and got[2] == INF


@pytest.mark.parametrize("b_shape", [(1, 3), (3,)], ids=["1x3", "3"])
def test_float_tensor_for_float3_parameter(device, cov, b_shape):
    """Float tensors of shape (..., 3) for float3 parameters: the last axis is the element,
    so a (1, 3) or (3,) b is broadcast over the call shape (n,) and summed by pydiff."""
    n = 333
    rng = np.random.default_rng(7)
    X = rng.standard_normal((n, 3))
    U = rng.standard_normal((n, 3))
    B = np.array([0.5, -1.0, 2.0]).reshape(b_shape)

    def run():
        b = pydiff.tensor(B, device=device, requires_grad=True)
        x = pydiff.tensor(X, device=device)
        y = pydiff.zeros((n, 3), device=device).with_grads(pydiff.tensor(U, device=device))
        cov.fshift.bwds(b, x, _result=y)
        return b.grad.numpy()

    got = _repeat_bits(run)
    want = (U * (X.astype(np.float32) + 1.0)).sum(0).reshape(b_shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    got_default = run()  # the default mode takes the same ordered sum
    assert got_default.tobytes() == got.tobytes()


def test_float_tensor_for_matrix_parameter(device, cov):
    n = 64
    U = np.random.default_rng(8).standard_normal((n, 2, 2))

    def run():
        b = pydiff.tensor(np.zeros((1, 2, 2)), device=device, requires_grad=True)
        x = pydiff.tensor(np.zeros((n, 2, 2)), device=device)
        y = pydiff.zeros((n, 2, 2), device=device).with_grads(pydiff.tensor(U, device=device))
        cov.mshift.bwds(b, x, _result=y)
        return b.grad.numpy()

    np.testing.assert_allclose(_repeat_bits(run), 3 * U.sum(0, keepdims=True), rtol=1e-5)


def test_float_tensor_for_array_parameter(device, cov):
    """A (1, 3) float tensor for a float[3] parameter, broadcast over 257 calls."""
    X = np.random.default_rng(9).standard_normal(257)

    def run():
        a = pydiff.tensor([[1.0, 1.0, 1.0]], device=device, requires_grad=True)
        y = pydiff.zeros((257,), device=device).with_grads(ones=True)
        cov.arr3.bwds(a, pydiff.tensor(X, device=device), _result=y)
        return a.grad.numpy()

    s = math.fsum(X.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(_repeat_bits(run), [[s, 2 * s, 3 * s]], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kind", ["call_id", "call_id_2d", "thread_id", "wang_hash"])
def test_generated_arguments_leave_the_call_shape_known(device, cov, kind):
    """spy.call_id/thread_id/wang_hash follow the call shape (set here by the result), so a
    (1,) parameter beside them is summed by pydiff in order, with ids the forward sees."""
    shape = (6, 5) if kind == "call_id_2d" else (300,)
    fn, arg = {
        "call_id": (cov.by_id, spy.call_id()),
        "call_id_2d": (cov.by_id2, spy.call_id()),
        "thread_id": (cov.by_thread, spy.thread_id()),
        "wang_hash": (cov.by_hash, spy.wang_hash()),
    }[kind]
    if kind == "thread_id" and device.type == "cuda":
        # Slang 2026.12 cannot differentiate SlangPy's thread_id load for CUDA (E41901,
        # "unsupported L-value for auto differentiation", seen on an H200): loud, not wrong.
        with pytest.raises(Exception, match="auto differentiation"):
            a = pydiff.tensor([2.0], device=device, requires_grad=True)
            fn.bwds(arg, a, _result=pydiff.zeros(shape, device=device).with_grads(ones=True))
        return
    seen = fn(arg, pydiff.tensor([1.0], device=device), _result=pydiff.zeros(shape, device=device))
    want = math.fsum(seen.numpy().astype(np.float64).ravel())  # d/da sum(a * g) = sum(g)

    def run():
        a = pydiff.tensor([2.0], device=device, requires_grad=True)
        fn.bwds(arg, a, _result=pydiff.zeros(shape, device=device).with_grads(ones=True))
        return a.grad.numpy()

    assert _repeat_bits(run)[0] == np.float32(want)


def test_fixed_point_sum_at_the_edge_of_the_range_is_exact(device, m):
    """-2^31 exactly is the lowest partial sum int64 holds (4 x -2^29): no overflow."""
    X = np.full(4, -(2.0**29))
    w = pydiff.tensor([0.0], device=device, requires_grad=True)
    y = pydiff.empty(X.shape, device=device).with_grads(ones=True)
    m.gather_first.bwds(w, pydiff.tensor(X, device=device), _result=y)
    assert w.grad.numpy()[0] == -(2.0**31)
