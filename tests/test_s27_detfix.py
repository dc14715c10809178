"""FwdDiffTensor's fixed-point sums against exact rational references (negative totals as
exact as positive ones, sum(-v) == -sum(v)), and a zero policy set through a view governing
the gradient buffer it shares with its base."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import pydiff

GATHER = (
    "import slangpy;\nimport pydiff;\n"
    "[Differentiable] float gather(FwdDiffTensor<1> w, int i, float s)\n"
    "{ return w.load({i}) * s; }\n"
)

UNIT = Fraction(1, 2**64)  # the accumulator's resolution


def exact_fixed_point_sum(values) -> np.float32:
    """The documented rule, computed independently: each contribution's magnitude truncated
    to a multiple of 2^-64 (towards zero), summed exactly, rounded to double, then to float."""
    total = Fraction(0)
    for v in values:
        q = Fraction(float(np.float32(v))) / UNIT  # the float32 the shader is given
        total += (
            q.numerator // q.denominator if q >= 0 else -((-q.numerator) // q.denominator)
        ) * UNIT
    return np.float32(float(total))


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("s27_detfix_gather", GATHER, device=device)


def fixed_point_sums(m, device, cases) -> np.ndarray:
    """Element k of w's gradient = sum of cases[k] (dL/dw[i] = sum of s over the threads
    that read w[i], each added as fixed point)."""
    idx = np.concatenate([np.full(len(c), k, np.int32) for k, c in enumerate(cases)])
    s = np.concatenate([np.asarray(c, np.float32) for c in cases])
    w = pydiff.tensor(np.ones(len(cases), np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((len(s),), device=device).with_grads(ones=True)
    m.gather.bwds(
        w,
        pydiff.tensor(idx, dtype="int", device=device),
        pydiff.tensor(s, device=device),
        _result=y,
    )
    return w.grad.numpy().reshape(-1)


A = float(np.float32(1e-10))
B = float(np.nextafter(np.float32(A), np.float32(1)))
_RNG = np.random.default_rng(27)
WIDE = (_RNG.choice([-1.0, 1.0], 500) * 10.0 ** _RNG.uniform(-20, 3, 500)).astype(np.float32)
CASES = [
    [3e-18],
    [1e-16],
    [1e-15],
    [1e-25] * 1000,  # each below 2^-64: truncated to 0
    [2.0**-64] * 1000,
    [-A, B],  # 6.94e-18, exact in float32
    [1.0, -1.0, 3e-18],
    [1e8, 3e-18, -1e8],
    [1e9, -float(np.float32(999999999.9)), 1e-12],
    [0.1] * 10 + [-1.0],
    [1e-5, -2e-5, 3e-18, -7e-19],
    list(WIDE),
    [3e6, 1e-12, -7e-19],  # hi beyond 2^53: the conversion rounds
    [1e9, 1e9, 0.5, 3e-18],
]


def test_fixed_point_sums_match_exact_reference(m, device):
    """Before the fix a negative contribution was split in float32 as floor(s) plus
    s - floor(s) = 1 - tiny, which rounds to 1: -3e-18 came back 0.0, -1e-16 3% off."""
    low_end = [[-(2.0**29)] * 4, [-(2.0**29)] * 4 + [2.0**-64]]  # sums of -2^31: no wrap
    cases = CASES + [[-v for v in c] for c in CASES] + low_end
    got = fixed_point_sums(m, device, cases)
    want = np.array([exact_fixed_point_sum(c) for c in cases], np.float32)
    np.testing.assert_array_equal(got, want)


def test_negated_contributions_give_the_negated_sum(m, device):
    got = fixed_point_sums(m, device, CASES + [[-v for v in c] for c in CASES])
    pos, neg = got[: len(CASES)], got[len(CASES) :]
    assert np.array_equal(neg, -pos)
    assert neg[0] < 0 and neg[5] < 0  # -3e-18 and a - b are not lost


def test_fixed_point_sum_is_the_same_bits_in_any_order(m, device):
    mixed = list(WIDE) + [-3e-18, 1e-25, -1e-25, 5e-19]
    orders = [
        mixed,
        mixed[::-1],
        list(np.random.default_rng(1).permutation(np.array(mixed, np.float32))),
    ]
    got = fixed_point_sums(m, device, orders)
    assert got[0].tobytes() == got[1].tobytes() == got[2].tobytes()
    assert got[0] == exact_fixed_point_sum(mixed)


# --- a zero policy belongs to the gradient buffer a view shares with its base -----------

TIMES = "[Differentiable] float times(float a, float b) { return a * b; }"


@pytest.fixture(scope="module")
def times(device):
    return pydiff.load_module_from_source("s27_detfix_times", TIMES, device=device)


def _backward(times, t, device):
    shape = t.shape
    times.times.bwds(
        t,
        pydiff.ones(shape, device=device),
        _result=pydiff.zeros(shape, device=device).with_grads(ones=True),
    )


def test_strict_set_on_a_view_guards_the_base(times, device):
    x = pydiff.tensor(np.arange(6.0), device=device, requires_grad=True)
    x.reshape((2, 3)).zero_policy = pydiff.ZeroPolicy.STRICT
    assert x.zero_policy is pydiff.ZeroPolicy.STRICT
    _backward(times, x, device)
    with pytest.raises(pydiff.StaleGradientError):
        _backward(times, x, device)
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(6))


def test_strict_set_on_the_base_guards_its_views(times, device):
    x = pydiff.tensor(np.arange(6.0), device=device, requires_grad=True)
    x.zero_policy = "strict"
    assert x.reshape((3, 2)).zero_policy is pydiff.ZeroPolicy.STRICT
    _backward(times, x.reshape((2, 3)), device)
    with pytest.raises(pydiff.StaleGradientError):
        _backward(times, x.reshape((3, 2)), device)


def test_policy_set_on_one_view_is_every_views(times, device):
    x = pydiff.tensor(np.arange(6.0), device=device, requires_grad=True)
    v, u = x.reshape((2, 3)), x.reshape((3, 2))
    v.zero_policy = "reset"
    assert u.zero_policy is x.zero_policy is pydiff.ZeroPolicy.RESET
    _backward(times, x, device)
    _backward(times, u, device)  # RESET: starts from zero, not 2
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(6))
    u.zero_policy = None  # back to the global policy, for all of them
    assert x.zero_policy is None and v.zero_policy is None
