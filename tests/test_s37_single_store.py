"""`.bwds` of a call over a grid skips the per-element store counts (written_mask, a flush and
a wait per call) only where the function's text shows one store per thread at its own grid
element and the grid has the tensor's shape (pydiff.single_store): gradients stay right
against NumPy's float64 closed forms there, and every other pattern is still counted (two
stores, a loop, a shifted or transposed index, an index a helper may change, a larger grid),
so races and stores outside the tensor are still refused."""

from __future__ import annotations

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import written_mask

SOURCE = """import slangpy;
[Differentiable]
void sq1(int idx, float a, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = a * v * v; }
[Differentiable]
void blur(int2 px, IDiffTensor<float, 2> img, IWDiffTensor<float, 2> result)
{
    int h = int(img.shape[0]);
    int w = int(img.shape[1]);
    int r = px.y;
    int c = px.x;
    result[r, c] = 0.5 * img[r, c] + 0.25 * img[r, max(c - 1, 0)]
        + 0.25 * img[min(r + 1, h - 1), c];
}
[Differentiable]
void halved(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ y[idx / 2] = x[idx]; }
void zero_it(inout int i) { i = 0; }
[Differentiable]
void moved(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ zero_it(idx); y[idx] = x[idx]; }
[Differentiable]
void transposed(int2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y)
{ y[px.x, px.y] = x[px.y, px.x]; }
"""


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s37_single_store", SOURCE, device=device)


@pytest.fixture(params=["generated", "slangpy"])
def path(request, monkeypatch):
    if request.param == "slangpy":
        monkeypatch.setenv("PYDIFF_GENERATED", "0")
    else:
        monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    return request.param


@pytest.fixture
def checks(monkeypatch):
    """How many store-count read-backs ran."""
    calls = []
    real = written_mask.WrittenMask.check_single_writes
    monkeypatch.setattr(
        written_mask.WrittenMask,
        "check_single_writes",
        lambda self, *a: (calls.append(1), real(self, *a))[1],
    )
    return calls


def test_one_store_at_the_grid_index_is_not_counted_and_right(device, mod, path, checks):
    xs = np.random.default_rng(1).standard_normal(37).astype(np.float32)
    up = np.random.default_rng(2).standard_normal(37).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((37,), device=device).with_grads()
    y.grad.copy_from_numpy(up)
    mod.sq1(spy.grid((37,)), 1.5, x, y)
    np.testing.assert_allclose(y.numpy(), 1.5 * xs.astype(np.float64) ** 2, rtol=1e-6)
    mod.sq1.bwds(spy.grid((37,)), 1.5, x, y)
    want = 2 * 1.5 * xs.astype(np.float64) * up
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    assert checks == []


def _blur_grad(img_shape, up):
    h, w = img_shape
    g = np.zeros(img_shape)
    for r in range(h):
        for c in range(w):
            g[r, c] += 0.5 * up[r, c]
            g[r, max(c - 1, 0)] += 0.25 * up[r, c]
            g[min(r + 1, h - 1), c] += 0.25 * up[r, c]
    return g


def test_a_stencil_storing_at_its_pixel_through_locals(device, mod, path, checks):
    shape = (5, 7)
    rng = np.random.default_rng(3)
    img = pydiff.tensor(rng.standard_normal(shape).astype(np.float32), device=device)
    img.requires_grad_()
    up = rng.standard_normal(shape)
    out = pydiff.zeros(shape, device=device).with_grads()
    out.grad.copy_from_numpy(up.astype(np.float32))
    mod.blur.bwds(spy.grid(shape), img, out)
    np.testing.assert_allclose(img.grad.numpy(), _blur_grad(shape, up), rtol=1e-5, atol=1e-6)
    assert checks == []


# (two stores in one thread and stores under a condition are refused by the trap scan, a
# store in a loop does not compile: none reaches the counts)
@pytest.mark.parametrize("name", ["halved", "moved"])
def test_other_patterns_are_still_counted_and_refused(device, mod, path, checks, name):
    x = pydiff.tensor(np.ones(8, np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((8,), device=device).with_grads(ones=True)
    with pytest.raises(ValueError, match="stored 2 times|stored [0-9]+ times"):
        getattr(mod, name).bwds(spy.grid((8,)), x, y)
    assert checks, "the store counts were not checked"


def test_transposed_and_larger_grids_are_still_counted(device, mod, path, checks):
    x = pydiff.tensor(np.ones((3, 5), np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((3, 5), device=device).with_grads(ones=True)
    with pytest.raises(ValueError, match="outside the tensor|stored"):
        mod.transposed.bwds(spy.grid((3, 5)), x, y)
    assert checks
    checks.clear()
    x1 = pydiff.tensor(np.ones(6, np.float32), device=device, requires_grad=True)
    y1 = pydiff.zeros((6,), device=device).with_grads(ones=True)
    with pytest.raises(ValueError, match="outside the tensor"):
        mod.sq1.bwds(spy.grid((9,)), 2.0, x1, y1)  # a grid larger than its tensors
    assert checks
