"""Arguments whose shapes do not fit the call get pydiff's own ValueError naming the argument
and both shapes, on the forward call, ``.bwds``, small (planned) and large (generated) calls,
instead of SlangPy's "Shape mismatch for ... between value ... and call ..." with its table of
every argument.
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float times(float x, float y) { return x * y; }
"""

_modules: dict = {}


def _module(device):
    if id(device) not in _modules:
        _modules[id(device)] = pydiff.load_module_from_source("s35_shapes", SOURCE, device=device)
    return _modules[id(device)]


def _t(n, device, grads=False):
    x = pydiff.tensor(np.linspace(-1, 1, n, dtype=np.float32), device=device)
    return x.with_grads() if grads else x


@pytest.mark.parametrize("n", [16, 1 << 16])
def test_result_of_another_length(device, n):
    m = _module(device)
    x = _t(n, device)
    with pytest.raises(
        ValueError, match=rf"_result has shape \({n - 1},\).*broadcast to shape \({n},\)"
    ):
        m.sq(x, _result=pydiff.zeros((n - 1,), device=device))


def test_result_of_another_shape_2d(device):
    m = _module(device)
    x = pydiff.tensor(np.ones((4, 3), np.float32), device=device)
    with pytest.raises(
        ValueError, match=r"_result has shape \(3, 4\).*broadcast to shape \(4, 3\)"
    ) as err:
        m.sq(x, _result=pydiff.zeros((3, 4), device=device))
    assert "Name " not in str(err.value)  # (not SlangPy's table)


@pytest.mark.parametrize("n", [16, 1 << 16])
def test_parameter_that_does_not_broadcast(device, n):
    m = _module(device)
    with pytest.raises(ValueError, match=r"parameter 'y' does not broadcast") as err:
        m.times(_t(n, device), _t(n - 1, device))
    assert f"size {n - 1} where the call's has {n}" in str(err.value)


@pytest.mark.parametrize("n", [16, 1 << 16])
def test_bwds_result_of_another_length(device, n):
    m = _module(device)
    x = _t(n, device, grads=True)
    m.sq(x)
    wrong = pydiff.zeros((n + 1,), device=device).with_grads()
    with pytest.raises(ValueError, match=rf"_result has shape \({n + 1},\)"):
        m.sq.bwds(x, _result=wrong)
    assert not np.any(x.grad.numpy())  # nothing added before the refusal


def test_after_a_planned_call(device):
    """A layout run many times (a call plan) and then a call of a mismatching layout."""
    m = _module(device)
    x, y = _t(16, device), _t(16, device)
    for _ in range(40):
        out = m.times(x, y)
    np.testing.assert_allclose(out.numpy(), x.numpy().astype(np.float64) ** 2, rtol=1e-6)
    with pytest.raises(
        ValueError, match=r"parameter 'y' does not broadcast.* size 15 where the call's has 16"
    ):
        m.times(x, _t(15, device))
