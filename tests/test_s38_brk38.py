"""Grid ``.bwds`` call plans (pydiff.grid_plan) against the full path: a repeated call of one
layout must refuse, warn and compute exactly what the first call (or a fresh module's) does."""

from __future__ import annotations

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff.errors import EnvironmentSettingError
from pydiff.grid_plan import GridBackwardPlan
from test_s37_grid_plans import SOURCE as GRID_SOURCE  # (blur over a grid)

SOURCE = (
    GRID_SOURCE
    + """
[Differentiable]
void two(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y, IWDiffTensor<float, 1> z)
{ float v = x[idx]; y[idx] = v * v; z[idx] = 3.0 * v; }
[Differentiable]
void apart(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y, IWDiffTensor<float, 1> z)
{ float v = x[idx]; y[idx] = v * v; z[idx + 4] = 3.0 * v; }
"""
)


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s38_brk38", SOURCE, device=device)


def _planned(fn) -> bool:
    return any(type(p) is GridBackwardPlan for p in fn.bwds_plans.values())


@pytest.mark.usefixtures("auto_sizes")  # a small call's plan, in every mode
def test_mistyped_generated_switch_refused_by_a_planned_call(device, mod, monkeypatch):
    """The full path reads PYDIFF_GENERATED at every grid .bwds and refuses a value it does
    not take; a planned call passed it silently."""
    img = pydiff.tensor(np.ones((4, 6), np.float32), device=device, requires_grad=True)
    out = pydiff.zeros((4, 6), device=device).with_grads(ones=True)
    for _ in range(2):
        mod.blur.bwds(spy.grid((4, 6)), img, out)
    assert _planned(mod.blur)
    monkeypatch.setenv("PYDIFF_GENERATED", "of")
    with pytest.raises(EnvironmentSettingError, match="PYDIFF_GENERATED"):
        mod.blur.bwds(spy.grid((4, 6)), img, out)
    monkeypatch.delenv("PYDIFF_GENERATED")
    want = 2 * (0.75 + 0.25 * np.array([0, 1, 1, 2], np.float64))[:, None] * np.ones((4, 6))
    np.testing.assert_allclose(img.grad.numpy(), want, rtol=1e-6)


@pytest.mark.usefixtures("auto_sizes")  # a small call's plan, in every mode
@pytest.mark.parametrize("warm", [False, True])
def test_one_tensor_stored_through_two_parameters_refused(device, warm):
    """y[idx] = x*x and z[idx] = 3x into one tensor: the forward keeps 3x, while the backward
    added both stores' gradients (2x + 3, silently), on the first call and on a planned one
    (which declines to the first call's path)."""
    mod = pydiff.load_module_from_source(f"s38_brk38_two_{warm}", SOURCE, device=device)
    xs = np.linspace(0.5, 2.0, 8).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    if warm:
        for _ in range(2):
            y, z = (pydiff.zeros((8,), device=device).with_grads(ones=True) for _ in range(2))
            mod.two.bwds(spy.grid((8,)), x, y, z)
        assert _planned(mod.two)
        np.testing.assert_allclose(x.grad.numpy(), 2 * (2 * xs.astype(np.float64) + 3), rtol=1e-6)
        x.zero_grad()
    y = pydiff.zeros((8,), device=device).with_grads(ones=True)
    mod.two(spy.grid((8,)), x, y, y)
    np.testing.assert_allclose(y.numpy(), 3 * xs, rtol=1e-6)  # the last store kept
    for z in (y, y.reshape((2, 4)).reshape((8,))):  # the tensor, or a view of its storage
        with pytest.raises(ValueError, match="parameters 'y' and 'z' are the same tensor"):
            mod.two.bwds(spy.grid((8,)), x, y, z)
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(8))


def test_positional_result_bwds_repeated(device):
    """SlangPy's ``f.bwds(x, y)`` (the result as the last positional argument): its second
    call ran the plan of the first with no result (AttributeError: 'object' object has no
    attribute 'device'); the ``_result=`` form keeps its plan."""
    src = "[Differentiable]\nfloat sq(float x) { return x * x; }\n"
    mod = pydiff.load_module_from_source("s38_brk38_positional", src, device=device)
    xs = np.arange(1, 6, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((5,), device=device).with_grads(ones=True)
    for _ in range(3):
        mod.sq.bwds(x, y)
    np.testing.assert_allclose(x.grad.numpy(), 3 * 2 * xs.astype(np.float64), rtol=1e-6)
    for _ in range(2):
        mod.sq.bwds(x, _result=y)
    assert mod.sq.bwds_plans  # (the keyword form is planned)
    mod.sq.bwds(x, y)
    np.testing.assert_allclose(x.grad.numpy(), 6 * 2 * xs.astype(np.float64), rtol=1e-6)


RACE = """import slangpy;
[Differentiable]
void sq2(int idx, IDiffTensor<float, 1> x, IDiffTensor<float, 1> w, IWDiffTensor<float, 1> y)
{ int n = int(x.shape[0]); y[idx] = x[idx] * w[(idx + 1) % n] * w[(idx + 1) % n]; }
"""


@pytest.mark.usefixtures("auto_sizes")  # a small call's plan, in every mode
@pytest.mark.parametrize("warm", [False, True])
def test_read_tensor_that_is_a_gradient_buffer_refused(device, warm):
    """w read at idx+1 while the backward adds dL/dx into x's gradient buffer, which is w's
    storage: the threads race (x.grad off by up to 3.3, w.grad by 4.3 on lavapipe, no error),
    on the first call and on a planned one."""
    mod = pydiff.load_module_from_source(f"s38_brk38_race_{warm}", RACE, device=device)
    n = 64
    xs = np.linspace(0.5, 2, n).astype(np.float32)
    ws = np.linspace(1, 3, n).astype(np.float32)
    w = pydiff.tensor(ws, device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device).with_grads(ones=True)
    if warm:
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        for _ in range(2):
            mod.sq2.bwds(spy.grid((n,)), x, w, y)
        assert _planned(mod.sq2)
        wn = np.roll(ws.astype(np.float64), -1)
        np.testing.assert_allclose(x.grad.numpy(), 2 * wn**2, rtol=1e-5)
        np.testing.assert_allclose(w.grad.numpy(), 2 * np.roll(2 * xs * wn, 1), rtol=1e-5)
        w.zero_grad()
    before = w.numpy()
    for shared in (w.detach(), w.reshape((8, 8)).reshape((n,)).detach()):
        x = pydiff.tensor(xs, device=device).with_grads(grad_in=shared, grad_out=shared)
        with pytest.raises(ValueError, match="parameter 'w' reads a tensor that is"):
            mod.sq2.bwds(spy.grid((n,)), x, w, y)
    np.testing.assert_array_equal(w.numpy(), before)
    np.testing.assert_array_equal(w.grad.numpy(), np.zeros(n))


def test_one_tensor_stored_through_two_parameters_counted_together(device):
    """Where the stores are counted (a grid smaller than the tensor), two written parameters
    given one tensor shared no count: y[idx] and z[idx] into one tensor gave x.grad = 2x + 3
    silently. One count per storage: refused, naming both; stores to elements of their own
    (z[idx + 4]) pass, with the right gradient."""
    mod = pydiff.load_module_from_source("s38_brk38_counted", SOURCE, device=device)
    xs = np.linspace(0.5, 2.0, 4).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((8,), device=device).with_grads(ones=True)
    mod.apart(spy.grid((4,)), x, y, y)
    np.testing.assert_allclose(y.numpy(), np.concatenate([xs * xs, 3 * xs]), rtol=1e-6)
    for _ in range(2):
        mod.apart.bwds(spy.grid((4,)), x, y, y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * (2 * xs.astype(np.float64) + 3), rtol=1e-6)
    for z in (y, y.reshape((2, 4)).reshape((8,))):
        with pytest.raises(ValueError, match="parameters 'y' and 'z' are one tensor"):
            mod.two.bwds(spy.grid((4,)), x, y, z)


TWO_D = """import slangpy;
[Differentiable]
void two2(int2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y, IWDiffTensor<float, 2> z)
{ float v = x[px.y, px.x]; y[px.y, px.x] = v * v; z[px.y, px.x] = 3.0 * v; }
"""


def test_written_views_of_one_storage_in_other_shapes_refused(device):
    """Two written parameters on views of one storage in different shapes: a store through
    each may reach one element (here: y[0, 1] and z[0, 1] are elements 1 and 1; y[1, 0] and
    z[1, 0] are 4 and 8), which neither a shared count (one shape) nor the single-store scan
    (y's own element) sees: the backward added both stores' gradients. Refused, whether y
    stores once per thread (the grid of y's shape) or the stores are counted."""
    mod = pydiff.load_module_from_source("s38_brk38_views", TWO_D, device=device)
    x = pydiff.tensor(np.ones((4, 4), np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((4, 4), device=device).with_grads(ones=True)
    z = y.reshape((2, 8))
    for grid in ((4, 4), (2, 2)):
        with pytest.raises(ValueError, match="parameters 'y' and 'z'"):
            mod.two2.bwds(spy.grid(grid), x, y, z)
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros((4, 4)))
    apart = pydiff.zeros((2, 8), device=device).with_grads(ones=True)
    mod.two2.bwds(spy.grid((2, 2)), x, y, apart)  # tensors of their own: 2x + 3 = 5 where read
    want = np.zeros((4, 4))
    want[:2, :2] = 5.0
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6)


def test_a_counted_refusal_says_the_gradients_were_left_as_they_were(device):
    """The store counts are read after the backward kernel ran: pydiff puts back the gradient
    buffers it added into (pydiff.grad_restore), and the refusal says so."""
    mod = pydiff.load_module_from_source("s38_brk38_said", SOURCE, device=device)
    xs = np.linspace(0.5, 2.0, 4).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((8,), device=device).with_grads(ones=True)
    with pytest.raises(ValueError, match="gradients were left as they were before the call"):
        mod.two.bwds(spy.grid((4,)), x, y, y)
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(4))  # (what the message says)
