"""gradcheck divides each finite difference by the step the float32 inputs really take:
x +- eps rounded to float32 near |x| = 1e3 moves by a multiple of 6.1e-5, not by 1e-3, so a
correct derivative failed by the ratio (2.3%) and a wrong one could pass. Checked against
the closed forms of sin and of float32 rounding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pydiff
from pydiff import finite_diff as fd

_names = itertools.count()

_SRC = """
[Differentiable]
float s(float x) { return sin(x); }

void s_wrong_bwd(inout DifferentialPair<float> x, float dOut) {
    x = diffPair(x.p, dOut * 1.05 * cos(x.p));
}
[BackwardDerivative(s_wrong_bwd)]
float s_wrong(float x) { return sin(x); }
"""


def _module(device):
    return pydiff.load_module_from_source(f"s29_realstep_{next(_names)}", _SRC, device=device)


def test_realised_direction_is_the_float32_step_over_eps():
    x = {"x": np.array([1000.0, 1.0])}
    got = fd.realised_direction(x, {"x": np.array([1.0, -1.0])}, 1e-3, {"x": fd.f32})["x"]
    plus = np.float32(1000.0 + 1e-3).astype(np.float64)
    minus = np.float32(1000.0 - 1e-3).astype(np.float64)
    assert got[0] == (plus - minus) / 2e-3 and abs(got[0] - 0.9765625) < 1e-12
    one = (np.float32(1.0 - 1e-3).astype(np.float64) - np.float32(1.0 + 1e-3)) / 2e-3
    assert got[1] == one


def test_correct_derivative_at_large_inputs_passes_and_a_wrong_one_fails(device):
    m = _module(device)
    xs = np.array([1000.3, -1500.7, 2000.1], np.float32)
    x = pydiff.tensor(xs, requires_grad=True, device=device)
    assert pydiff.gradcheck(m.s, (x,))  # failed by 2.3% (the step ratio) before
    y = pydiff.tensor(xs, requires_grad=True, device=device)
    with pytest.raises(pydiff.GradcheckError, match="analytic"):
        pydiff.gradcheck(m.s_wrong, (y,), check_forward=False)


def test_a_step_rounding_away_is_named(device):
    m = _module(device)
    x = pydiff.tensor(np.array([1.0e5], np.float32), requires_grad=True, device=device)
    with pytest.raises(pydiff.GradcheckError, match=r"rounds to one value.*raise eps"):
        pydiff.gradcheck(m.s, (x,))
    assert pydiff.gradcheck(m.s, (x,), eps=100.0 / 1024, atol=5e-3, rtol=5e-2)
