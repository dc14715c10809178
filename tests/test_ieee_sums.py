"""Gradients of broadcast parameters follow IEEE sums (issue 15, class 2): inf stays inf,
inf + -inf and NaN give NaN, a finite sum past float32's range is inf. The reference is
NumPy's float64 sum rounded to float32."""

import math

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] float scaled(float a, float x) { return a * x; }
"""

INF, NAN = np.inf, np.nan
CASES = {
    "plus_inf": [1.0, INF, 2.0, -3.0],
    "minus_inf": [-INF, 1.0, 1e30, 5.0],
    "inf_first_then_finite": [INF] + [1.0] * 40,
    "finite_then_inf_last": [1.0] * 40 + [INF],
    "both_infs": [INF, 1.0, -INF, 2.0],
    "nan": [1.0, NAN, 3.0],
    "overflow_to_inf": [3e38] * 8,
    "overflow_to_minus_inf": [-3e38] * 8,
    "huge_cancelling": [3e38, -3e38, 1.0, 3e38, -3e38],
    "long_with_inf": list(np.linspace(-1.0, 1.0, 5000)) + [INF],
}


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("ieee_sums", SOURCE, device=device)


def _reference(x):
    """The exact sum (math.fsum) rounded once to float32, with IEEE's infinities and NaN."""
    x = np.asarray(x, dtype=np.float64)
    if np.isnan(x).any() or (np.isposinf(x).any() and np.isneginf(x).any()):
        return np.float32(np.nan)
    if np.isinf(x).any():
        return np.float32(x[np.isinf(x)][0])
    with np.errstate(over="ignore"):
        return np.float32(math.fsum(x))


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("name", list(CASES))
def test_broadcast_gradient_sums_follow_ieee(device, m, name, deterministic):
    X = np.asarray(CASES[name], dtype=np.float64)
    a = pydiff.tensor([2.0], device=device, requires_grad=True)
    x = pydiff.tensor(X, device=device)
    y = pydiff.zeros(X.shape, device=device).with_grads(ones=True)
    if deterministic:
        with pydiff.deterministic():
            m.scaled.bwds(a, x, _result=y)
    else:
        m.scaled.bwds(a, x, _result=y)
    got, want = a.grad.numpy()[0], _reference(X)
    if np.isnan(want):
        assert np.isnan(got), f"{name}: got {got}, want NaN"
    elif np.isinf(want):
        assert got == want, f"{name}: got {got}, want {want}"
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
