"""Calls over a grid take call plans (plan_layout.layout_key keys a grid by its shape,
stride and offset): a repeated small grid call skips the full path's checks (131 -> 36 us a
call for a 2x2 stencil on lavapipe, raw SlangPy 50 us) and is deferred like other SlangPy
calls. Values stay right against NumPy's float64 at every call as inputs change, gradients
after planned forwards too, and whatever a plan cannot decide (aliasing, a tape, large
grids, another shape) takes the full path with its checks."""

from __future__ import annotations

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated

SOURCE = """import slangpy;
[Differentiable]
void poly(int idx, float a, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = a * v * v + 1.0; }
[Differentiable]
void blur(int2 px, IDiffTensor<float, 2> img, IWDiffTensor<float, 2> result)
{
    int h = int(img.shape[0]);
    int r = px.y;
    int c = px.x;
    result[r, c] = 0.75 * img[r, c] + 0.25 * img[min(r + 1, h - 1), c];
}
void copy_plus(int idx, float a, ITensor<float, 1> x, IWTensor<float, 1> y) { y[idx] = x[idx] + a; }
"""


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s37_grid_plans", SOURCE, device=device)


def _blur(img: np.ndarray) -> np.ndarray:
    down = np.concatenate([img[1:], img[-1:]], axis=0)
    return 0.75 * img + 0.25 * down


@pytest.mark.usefixtures("auto_sizes")  # a small call's plan, in every mode
def test_repeated_grid_calls_are_planned_and_right(device, mod):
    rng = np.random.default_rng(37)
    x = pydiff.tensor(np.zeros(9, np.float32), device=device)
    y = pydiff.zeros((9,), device=device)
    img = pydiff.tensor(np.zeros((4, 6), np.float32), device=device)
    out = pydiff.zeros((4, 6), device=device)
    kept = []
    for i in range(300):  # past DEFER_MAX: submissions in between
        xs = rng.standard_normal(9).astype(np.float32)
        x.copy_from_numpy(xs)
        a = float(i % 7) - 3.0
        mod.poly(spy.grid((9,)), a, x, y)
        if i % 50 == 0:
            np.testing.assert_allclose(y.numpy(), a * xs.astype(np.float64) ** 2 + 1, rtol=1e-6)
        ims = rng.standard_normal((4, 6)).astype(np.float32)
        img.copy_from_numpy(ims)
        mod.blur(spy.grid((4, 6)), img, out)
        if i % 37 == 0:
            kept.append((out.numpy(), ims))
    assert any(k[0][0] is spy.grid((1,)).__class__ for k in mod.poly.plans), "no grid plan"
    for got, ims in kept:
        np.testing.assert_allclose(got, _blur(ims.astype(np.float64)), rtol=1e-6, atol=1e-6)


def test_gradients_after_planned_grid_forwards(device, mod):
    xs = np.linspace(-1, 1, 11).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((11,), device=device).with_grads(ones=True)
    for _ in range(5):
        mod.poly(spy.grid((11,)), 2.0, x, y)
    mod.poly.bwds(spy.grid((11,)), 2.0, x, y)
    np.testing.assert_allclose(x.grad.numpy(), 4.0 * xs.astype(np.float64), rtol=1e-6)
    # an input written after the call the result came from: refused, as without a plan
    x.copy_from_numpy(xs * 2)
    with pytest.raises(ValueError):
        mod.poly.bwds(spy.grid((11,)), 2.0, x, y)


def test_what_a_plan_cannot_decide_takes_the_full_path(device, mod):
    xs = np.arange(6, dtype=np.float32)
    x = pydiff.tensor(xs, device=device)
    y = pydiff.zeros((6,), device=device)
    for _ in range(3):
        mod.copy_plus(spy.grid((6,)), 1.0, x, y)
    np.testing.assert_array_equal(y.numpy(), xs + 1)
    # aliasing: the same tensor read and written (the full path decides, as at a first call)
    outcomes = []
    for _ in range(2):
        z = pydiff.tensor(xs, device=device)
        try:
            mod.copy_plus(spy.grid((6,)), 1.0, z, z)
            outcomes.append(("ran", z.numpy().tolist()))
        except Exception as exc:  # noqa: BLE001 (the outcome itself is compared)
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1]
    # another grid shape (a new layout) and on a tape: right values, gradients through it
    x2 = pydiff.tensor(np.linspace(0, 1, 5).astype(np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y2 = pydiff.zeros((5,), device=device)
        mod.poly(spy.grid((5,)), 3.0, x2, y2)
    tape.backward(y2, grad=np.ones(5))
    np.testing.assert_allclose(x2.grad.numpy(), 6.0 * np.linspace(0, 1, 5), rtol=1e-5, atol=1e-7)


def test_a_large_grid_keeps_the_full_paths_kernel(device, mod, monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 16)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()
    xs = np.linspace(-2, 2, 64).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    y = pydiff.zeros((64,), device=device)
    for _ in range(3):
        mod.poly(spy.grid((64,)), 0.5, x, y)
    np.testing.assert_allclose(y.numpy(), 0.5 * xs.astype(np.float64) ** 2 + 1, rtol=1e-6)
    if device.type != "cuda":  # (CUDA keeps SlangPy's kernel for grids)
        assert generated.stats().get("forward: grid", 0) == 3
