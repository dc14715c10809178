"""Session 47: a tensor made from the SlangPy handle of a tensor that requires a gradient
(``pydiff.Tensor(x.native.view(...), device)``) shares x's values but not its gradient
buffers, so ``.bwds`` through it gave x no gradient without a word (break47). It is warned of
now, as a slice made off a tape is; a detached tensor, or a handle of a tensor that needs no
gradient, is not. References: closed-form derivatives of exp."""

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
    return pydiff.load_module_from_source("s47_handle_views", SOURCE, device=device)


def _flow_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, pydiff.GradientFlowWarning)]


@pytest.mark.parametrize("strided", [True, False])
def test_bwds_through_a_handle_view_of_a_grad_tensor_warns(device, exps, strided):
    n = 8 if strided else 6  # (another message: GradientFlowWarning is once per message and line)
    xs = np.linspace(-1.0, 1.0, n).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    native = x.native.view(shape=(4,), strides=(2,)) if strided else x.native
    view = pydiff.Tensor(native, device)
    want_values = xs[::2] if strided else xs
    np.testing.assert_array_equal(view.numpy(), want_values)
    got = _flow_warnings(lambda: exps.ex.bwds(view, _result=1.0))
    assert any("parameter 'x'" in m and "handle" in m for m in got), got
    # What the user wanted instead: the slice on a tape carries exp'(x) = exp(x) back.
    with pydiff.Tape() as tape:
        y = exps.ex(x[::2]) if strided else exps.ex(x)
    tape.backward(y, np.ones(y.shape, np.float32))
    want = np.zeros(n)
    mask = slice(None, None, 2) if strided else slice(None)
    want[mask] = np.exp(xs[mask].astype(np.float64))
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5)


def test_detached_tensors_and_handles_of_constants_do_not_warn(device, exps):
    xs = np.linspace(-1.0, 1.0, 6).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    c = pydiff.tensor(xs, device=device)
    for value in (x.detach(), pydiff.Tensor(c.native, device)):
        assert _flow_warnings(lambda v=value: exps.ex.bwds(v, _result=1.0)) == []
    assert x.grad is None or not np.any(x.grad.numpy())
    # A handle view that asks for its own gradient gets it (and x gets none: separate buffers).
    own = pydiff.Tensor(x.native, device).requires_grad_()
    assert _flow_warnings(lambda: exps.ex.bwds(own, _result=1.0)) == []
    np.testing.assert_allclose(own.grad.numpy(), np.exp(xs.astype(np.float64)), rtol=1e-5)
