"""Session 48 (fix48): leftovers of s47. References: closed-form derivatives, exact integers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff

SOURCE = """
import slangpy;
[Differentiable]
float ex(float x) { return exp(x); }
"""


@pytest.fixture
def exps(device):
    return pydiff.load_module_from_source("s48_fix48", SOURCE, device=device)


def _flow_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, pydiff.GradientFlowWarning)]


@pytest.mark.parametrize("taken", ["native", "bwds"])
def test_handle_of_a_detached_tensor_is_not_warned_of(device, exps, taken):
    # x's handle handed out too (by the user, or by a call given x): the detached tensor's
    # handle shares x's buffer but says no gradient is wanted; it was warned of as x's (s47).
    xs = np.linspace(-1.0, 1.0, 6).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    if taken == "native":
        kept = x.native
    else:
        exps.ex.bwds(x, _result=1.0)
        np.testing.assert_allclose(x.grad.numpy(), np.exp(xs.astype(np.float64)), rtol=1e-5)
    view = pydiff.Tensor(x.detach().native, device)
    np.testing.assert_array_equal(view.numpy(), xs)
    assert _flow_warnings(lambda: exps.ex.bwds(view, _result=1.0)) == []
    # x's own handle, wrapped, is still warned of (a message of its own: another shape, as
    # GradientFlowWarning is once per message and line).
    n = 5 if taken == "native" else 7
    ys = np.linspace(-1.0, 1.0, n).astype(np.float32)
    y = pydiff.tensor(ys, device=device, requires_grad=True)
    kept = y.detach().native  # (a detached handle alive alongside)
    wrapped = pydiff.Tensor(y.native, device)
    got = _flow_warnings(lambda: exps.ex.bwds(wrapped, _result=1.0))
    assert any("handle" in m and f"({n},)" in m for m in got), got
    del kept
