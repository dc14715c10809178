"""Deterministic mode promises the same bits from a layout's first call on (docs/determinism.md):
a new float result must live in pydiff's pool on every call of a layout, since a linear layer
reading it takes another kernel on SlangPy's own buffer (another rounding). Two calls still
got SlangPy's buffer: the first call of a function with an int tensor or a whole-tensor
parameter, and a planned call that could not be deferred (another thread's batch open): their
layer outputs differed from the other calls' in the last bit. Checked against the same
computation's bits on a later call and against NumPy's closed form."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import call_plan, nn

SOURCE = """import slangpy;
[Differentiable] float sn(float x) { return sin(x); }
[Differentiable] float gt(float a, IDiffTensor<float, 1> w) { return sin(a) * w[0]; }
[Differentiable] float gi(float a, int k) { return sin(a) * float(k); }
"""


def _setup(device, tag):
    m = pydiff.load_module_from_source(f"s36_brk36_{tag}", SOURCE, device=device)
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((32, 16)).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    layer = nn.Linear(16, 4, seed=1, device=device)
    return m, xs, x, layer


def _first_equals_later(layer, call, want):
    with pydiff.deterministic():
        ys = [call() for _ in range(3)]
        outs = [layer(y).numpy() for y in ys]
    # the layout the linear layer's kernel choice reads (SlangPy's buffer differs by chance)
    assert [y.float4 for y in ys] == [True] * 3
    w, b = (p.numpy().astype(np.float64) for p in layer.parameters())
    np.testing.assert_allclose(outs[0], want @ w.T + b, rtol=1e-4, atol=1e-5)
    for later in outs[1:]:
        np.testing.assert_array_equal(later, outs[0])


@pytest.mark.parametrize("which", ["int", "whole"])
def test_first_call_with_int_or_whole_tensor_parameter_is_pooled(device, which):
    m, xs, x, layer = _setup(device, which)
    if which == "int":
        k = pydiff.tensor(np.full((32, 16), 2, np.int32), device=device)
        _first_equals_later(layer, lambda: m.gi(x, k), 2 * np.sin(xs.astype(np.float64)))
    else:
        w = pydiff.tensor(np.array([0.7], np.float32), device=device)
        _first_equals_later(layer, lambda: m.gt(x, w), 0.7 * np.sin(xs.astype(np.float64)))


def test_planned_call_not_deferred_is_pooled(device, monkeypatch):
    """Deferral off (as while another thread's batch is open): the plan called SlangPy
    without a result, which made its own buffer."""
    monkeypatch.setattr(call_plan, "DEFER", False)
    m, xs, x, layer = _setup(device, "nodefer")
    _first_equals_later(layer, lambda: m.sn(x), np.sin(xs.astype(np.float64)))


def test_recorded_result_that_lost_its_gradient_buffers_is_refused_before_any_kernel(device):
    """docs/tape.md: a recorded call's result whose gradient buffers were dropped afterwards
    makes the backward raise RuntimeError before any kernel runs. Only a Function's outputs
    were checked: for a shader call the backward raised f.bwds's ValueError ('_result has no
    gradient buffer') after the later node had already added into w.grad."""
    m = pydiff.load_module_from_source("s36_brk36_lost", SOURCE, device=device)
    xs = np.linspace(-1, 1, 8).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    w = pydiff.tensor(xs, device=device, requires_grad=True)
    for _ in range(3):  # first run, and planned ones
        with pydiff.Tape() as tape:
            y = m.gi(x, 3)
            z = m.gi(y, 2)  # (an int parameter: a number)
            v = m.sn(w)
            q = m.gi(v, 1)
        y.requires_grad_(False)
        with pytest.raises(RuntimeError, match="lost its gradient buffers"):
            tape.backward(z, grad=np.ones(8))
        tape.backward(q, grad=np.ones(8))  # the untouched branch still works
    xd = xs.astype(np.float64)  # q = sin(sin(w))
    np.testing.assert_allclose(w.grad.numpy(), 3 * np.cos(xd) * np.cos(np.sin(xd)), rtol=1e-5)
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(8))
