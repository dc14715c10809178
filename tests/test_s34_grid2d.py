"""Calls over grids of two and three dimensions take the generated kernel (pydiff.generated_grid):
``spy.grid((H, W))`` at an ``int2``/``uint2`` parameter, ``spy.grid((D, H, W))`` at
``int3``/``uint3``, forward and ``.bwds`` (through the store-counting wrapper).

SlangPy's grid gives the call at row i, column j the index ``int2(j, i)`` (``.x`` is the last
axis); the generated kernel must do the same. Every call runs generated (``MIN_ELEMENTS`` = 1,
counted by ``stats()``) and on SlangPy's path (``PYDIFF_GENERATED=0``): values are compared bit
for bit, gradients that several threads add into one element (atomics, in any order) to a few
ulps, and both against float64 NumPy. Shapes are not square (swapped axes would fail) and not
multiples of the 256-thread group.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated, generated_grid

SOURCE = """import slangpy;
// A clamped five-point stencil, weights unequal per neighbour (swapped axes change it).
[Differentiable]
void blur(int2 px, float a, IDiffTensor<float, 2> img, IWDiffTensor<float, 2> result)
{
    int h = int(img.shape[0]);
    int w = int(img.shape[1]);
    int r = px.y;
    int c = px.x;
    int left = max(c - 1, 0);
    int right = min(c + 1, w - 1);
    int up = max(r - 1, 0);
    int down = min(r + 1, h - 1);
    float s = 0.5 * img[r, c] + 0.2 * img[r, left] + 0.1 * img[r, right]
        + 0.15 * img[up, c] + 0.05 * img[down, c];
    result[r, c] = a * s;
}
// Even rows only: the rest of `result` is left as it was.
[Differentiable]
void even_rows(int2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> result)
{
    float v = x[2 * px.y, px.x];
    result[2 * px.y, px.x] = v * v;
}
// Two threads store one element (columns 2k and 2k + 1).
[Differentiable]
void collide(int2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> result)
{
    result[px.y, px.x / 2] = x[px.y, px.x];
}
// A vector index: SlangPy's order (.x the last axis), unsigned.
[Differentiable]
void vec_square(uint2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> result)
{
    result[px] = 3.0 * x[px] * x[px];
}
[Differentiable]
void volume(int3 p, float a, IDiffTensor<float, 3> x, IDiffTensor<float, 1> wx,
            IDiffTensor<float, 1> wz, IWDiffTensor<float, 3> result)
{
    float v = x[p.z, p.y, p.x];
    result[p.z, p.y, p.x] = a * v * v * wx[p.x] + wz[p.z];
}
[Differentiable]
void vec_volume(uint3 p, IDiffTensor<float, 3> x, IWDiffTensor<float, 3> result)
{
    result[p] = x[p] * x[p] + 1.0;
}
void label2(int2 px, IWTensor<float, 2> result) { result[px.y, px.x] = float(px.x * 1000 + px.y); }
void label3(uint3 p, IWTensor<float, 3> result)
{
    result[p] = float(p.x * 10000u + p.y * 100u + p.z);
}
void shifted(int2 px, ITensor<float, 2> x, IWTensor<float, 2> result)
{
    result[px.y, px.x] = x[px.y, px.x] + 1.0;
}
"""

_modules: dict = {}


@pytest.fixture
def mod(device):
    key = id(device)
    if key not in _modules:
        with warnings.catch_warnings():  # (the vector indices' order warning: meant here)
            warnings.simplefilter("ignore", pydiff.ShaderTrapWarning)
            _modules[key] = pydiff.load_module_from_source("s34_grid2d", SOURCE, device=device)
    return _modules[key]


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)


def _taken() -> tuple[int, int]:
    s = generated.stats()
    return s.get("forward: grid", 0), s.get("backward: grid", 0)


def _both(monkeypatch, call, device, taken=(1, 0)):
    """``call()`` (a list of arrays) generated, then on SlangPy's path; asserts the generated
    run took ``taken`` (forward, backward) generated grid kernels (none on CUDA, where the
    generator declines: its tensor types hold pointers); returns both lists."""
    if device.type == "cuda":
        taken = (0, 0)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    before = _taken()
    gen = call()
    got = tuple(a - b for a, b in zip(_taken(), before))
    assert got == taken, f"generated grid kernels (forward, backward): {got}, wanted {taken}"
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    try:
        ref = call()
    finally:
        monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    return gen, ref


def _same_bits(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


# --- float64 references ---------------------------------------------------------------------

_TAPS = ((0, 0, 0.5), (0, -1, 0.2), (0, 1, 0.1), (-1, 0, 0.15), (1, 0, 0.05))


def _taps(shape):
    """Per tap: (row indices, column indices, weight), clamped at the borders."""
    h, w = shape
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return [(np.clip(rows + dr, 0, h - 1), np.clip(cols + dc, 0, w - 1), k) for dr, dc, k in _TAPS]


def _blur64(img, a):
    x = img.astype(np.float64)
    return a * sum(k * x[r, c] for r, c, k in _taps(img.shape))


def _blur_grad64(shape, a, upstream):
    g = np.zeros(shape)
    for r, c, k in _taps(shape):
        np.add.at(g, (r, c), a * k * upstream.astype(np.float64))
    return g


# --- forward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 70), (70, 3), (17, 29)])
def test_grid_indices_in_slangpys_order(mod, device, forced, monkeypatch, shape):
    def call():
        y = pydiff.zeros(shape, device=device)
        mod.label2(spy.grid(shape), y)
        return [y.numpy()]

    gen, ref = _both(monkeypatch, call, device)
    rows, cols = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    np.testing.assert_array_equal(gen[0], cols * 1000.0 + rows)  # int2(column, row)
    _same_bits(gen[0], ref[0])


@pytest.mark.parametrize("shape", [(5, 7, 9), (2, 3, 43)])
def test_three_dimensional_indices_in_slangpys_order(mod, device, forced, monkeypatch, shape):
    def call():
        y = pydiff.zeros(shape, device=device)
        mod.label3(spy.grid(shape), y)
        return [y.numpy()]

    gen, ref = _both(monkeypatch, call, device)
    i, j, k = np.meshgrid(*(np.arange(s) for s in shape), indexing="ij")
    np.testing.assert_array_equal(gen[0], k * 10000.0 + j * 100.0 + i)  # uint3(k, j, i)
    _same_bits(gen[0], ref[0])


def test_a_large_stencil_takes_the_generated_kernel_unforced(mod, device, monkeypatch):
    shape = (61, 83)  # 5,063 elements: past MIN_ELEMENTS's default, not a multiple of 256
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 4096)
    xs = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    def call():
        x = pydiff.tensor(xs, device=device)
        y = pydiff.zeros(shape, device=device)
        mod.blur(spy.grid(shape), 1.5, x, y)
        return [y.numpy()]

    gen, ref = _both(monkeypatch, call, device)
    _same_bits(gen[0], ref[0])
    np.testing.assert_allclose(gen[0], _blur64(xs, 1.5), rtol=1e-5, atol=1e-6)


# --- .bwds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 70), (37, 11)])
def test_stencil_bwds_adds_from_several_threads(mod, device, forced, monkeypatch, shape):
    rng = np.random.default_rng(1)
    xs = rng.standard_normal(shape).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)

    def call():
        x = pydiff.tensor(xs, device=device).with_grads(zero=True)
        y = pydiff.zeros(shape, device=device)
        mod.blur(spy.grid(shape), 1.5, x, y)
        y = y.with_grads(grad_in=pydiff.tensor(up, device=device))
        mod.blur.bwds(spy.grid(shape), 1.5, x, y)
        return [y.numpy(), x.grad.numpy()]

    (y, gx), (ry, rgx) = _both(monkeypatch, call, device, taken=(1, 1))
    _same_bits(y, ry)
    np.testing.assert_allclose(y, _blur64(xs, 1.5), rtol=1e-5, atol=1e-6)
    # Up to five threads add into one element, in any order: a few ulps apart at most.
    np.testing.assert_allclose(gx, rgx, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(gx, _blur_grad64(shape, 1.5, up), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(5, 7, 9), (3, 11, 2)])
def test_three_dimensional_bwds(mod, device, forced, monkeypatch, shape):
    rng = np.random.default_rng(2)
    d, _, w = shape
    xs = rng.standard_normal(shape).astype(np.float32)
    wxs = rng.standard_normal(w).astype(np.float32)
    wzs = rng.standard_normal(d).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)

    def call():
        x = pydiff.tensor(xs, device=device).with_grads(zero=True)
        wx = pydiff.tensor(wxs, device=device).with_grads(zero=True)
        wz = pydiff.tensor(wzs, device=device).with_grads(zero=True)
        y = pydiff.zeros(shape, device=device)
        mod.volume(spy.grid(shape), 0.75, x, wx, wz, y)
        y = y.with_grads(grad_in=pydiff.tensor(up, device=device))
        mod.volume.bwds(spy.grid(shape), 0.75, x, wx, wz, y)
        return [y.numpy(), x.grad.numpy(), wx.grad.numpy(), wz.grad.numpy()]

    (y, gx, gwx, gwz), (ry, rgx, rgwx, rgwz) = _both(monkeypatch, call, device, taken=(1, 1))
    x64, wx64, wz64, u64 = (v.astype(np.float64) for v in (xs, wxs, wzs, up))
    wx3, wz3 = wx64[None, None, :], wz64[:, None, None]
    _same_bits(y, ry)
    _same_bits(gx, rgx)  # one thread per element: the same float ops
    np.testing.assert_allclose(y, 0.75 * x64 * x64 * wx3 + wz3, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, 1.5 * x64 * wx3 * u64, rtol=1e-5, atol=1e-6)
    # wx and wz: sums over many threads' atomic adds, in any order.
    np.testing.assert_allclose(gwx, rgwx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gwz, rgwz, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gwx, (0.75 * x64 * x64 * u64).sum((0, 1)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gwz, u64.sum((1, 2)), rtol=1e-4, atol=1e-5)


def test_vector_indices_unsigned_forward_and_bwds(mod, device, forced, monkeypatch):
    xs2 = np.random.default_rng(3).standard_normal((9, 31)).astype(np.float32)
    xs3 = np.random.default_rng(4).standard_normal((4, 6, 13)).astype(np.float32)

    def call():
        out = []
        for xs, fn in ((xs2, mod.vec_square), (xs3, mod.vec_volume)):
            x = pydiff.tensor(xs, device=device).with_grads(zero=True)
            y = pydiff.zeros(xs.shape, device=device)
            fn(spy.grid(xs.shape), x, y)
            y = y.with_grads(ones=True)
            fn.bwds(spy.grid(xs.shape), x, y)
            out += [y.numpy(), x.grad.numpy()]
        return out

    gen, ref = _both(monkeypatch, call, device, taken=(2, 2))
    for g, r in zip(gen, ref):
        _same_bits(g, r)
    x2, x3 = xs2.astype(np.float64), xs3.astype(np.float64)
    np.testing.assert_allclose(gen[0], 3 * x2 * x2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gen[1], 6 * x2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gen[2], x3 * x3 + 1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gen[3], 2 * x3, rtol=1e-6, atol=1e-6)


def test_a_partial_overwrite_on_a_tape(mod, device, forced, monkeypatch):
    """``even_rows`` stores only the even rows of ``y`` (the store-counting wrapper records
    which): the blur's gradient reaches x only through the odd rows it left."""
    shape = (10, 23)
    rng = np.random.default_rng(5)
    xs = rng.standard_normal(shape).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)

    def call():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = pydiff.zeros(shape, device=device)
            mod.blur(spy.grid(shape), 2.0, x, y)
            mod.even_rows(spy.grid((shape[0] // 2, shape[1])), x, y)
        tape.backward(y, grad=pydiff.tensor(up, device=device))
        return [y.numpy(), x.grad.numpy()]

    # (the forward on a tape: SlangPy's path)
    (y, gx), (ry, rgx) = _both(monkeypatch, call, device, taken=(0, 2))
    _same_bits(y, ry)
    np.testing.assert_allclose(gx, rgx, rtol=1e-6, atol=1e-7)
    x64, u64 = xs.astype(np.float64), up.astype(np.float64)
    even = (np.arange(shape[0]) % 2 == 0)[:, None]
    want_y = np.where(even, x64 * x64, _blur64(xs, 2.0))
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    want = _blur_grad64(shape, 2.0, np.where(even, 0.0, u64)) + np.where(even, 2 * x64 * u64, 0)
    np.testing.assert_allclose(gx, want, rtol=1e-5, atol=1e-6)


def test_two_threads_storing_one_element_are_refused(mod, device, forced):
    x = pydiff.tensor(np.ones((6, 10), np.float32), device=device).with_grads(zero=True)
    y = pydiff.zeros((6, 5), device=device).with_grads(ones=True)
    before = _taken()
    with pytest.raises(ValueError, match="stored 2 times"):
        mod.collide.bwds(spy.grid((6, 10)), x, y)
    generated_kernels = 0 if device.type == "cuda" else 1  # (CUDA: SlangPy's kernel counts)
    assert _taken()[1] == before[1] + generated_kernels


def test_grids_past_the_dispatch_limit_loop(mod, device, forced, monkeypatch):
    """Past the dispatch limit (lowered to two groups, 512 threads) the threads walk the
    grid, decomposing each flat index."""
    monkeypatch.setattr(generated_grid, "MAX_GROUPS", 2)
    shape = (37, 41)
    xs = np.random.default_rng(6).standard_normal(shape).astype(np.float32)

    def call():
        x = pydiff.tensor(xs, device=device).with_grads(zero=True)
        y = pydiff.zeros(shape, device=device)
        mod.blur(spy.grid(shape), 1.0, x, y)
        y = y.with_grads(ones=True)
        mod.blur.bwds(spy.grid(shape), 1.0, x, y)
        labels = pydiff.zeros((3, 5, 41), device=device)
        mod.label3(spy.grid((3, 5, 41)), labels)
        return [y.numpy(), x.grad.numpy(), labels.numpy()]

    (y, gx, labels), (ry, rgx, rlabels) = _both(monkeypatch, call, device, taken=(2, 1))
    _same_bits(y, ry)
    _same_bits(labels, rlabels)
    np.testing.assert_allclose(y, _blur64(xs, 1.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, _blur_grad64(shape, 1.0, np.ones(shape)), rtol=1e-5)
    i, j, k = np.meshgrid(np.arange(3), np.arange(5), np.arange(41), indexing="ij")
    np.testing.assert_array_equal(labels, k * 10000.0 + j * 100.0 + i)


# --- what keeps SlangPy's path ----------------------------------------------------------------


def test_strided_and_offset_grids_keep_slangpys_path(mod, device, forced, monkeypatch):
    xs = np.arange(9 * 13, dtype=np.float32).reshape(9, 13)

    def call():
        x = pydiff.tensor(xs, device=device)
        offset = pydiff.zeros((9, 13), device=device)
        mod.shifted(spy.grid((4, 6), offset=(3, 5)), x, offset)
        strided = pydiff.zeros((9, 13), device=device)
        mod.shifted(spy.grid((4, 6), stride=(2, 1)), x, strided)
        labels = pydiff.zeros((2, 3, 8), device=device)
        mod.label3(spy.grid((2, 3, 4), stride=(1, 1, 2)), labels)
        return [offset.numpy(), strided.numpy(), labels.numpy()]

    (offset, strided, labels), ref = _both(monkeypatch, call, device, taken=(0, 0))
    for g, r in zip((offset, strided, labels), ref):
        _same_bits(g, r)
    want = np.zeros((9, 13), np.float32)
    want[3:7, 5:11] = xs[3:7, 5:11] + 1.0
    np.testing.assert_array_equal(offset, want)
    want = np.zeros((9, 13), np.float32)
    want[0:8:2, 0:6] = xs[0:8:2, 0:6] + 1.0
    np.testing.assert_array_equal(strided, want)
    want = np.zeros((2, 3, 8), np.float32)
    i, j, k = np.meshgrid(np.arange(2), np.arange(3), np.arange(0, 8, 2), indexing="ij")
    want[i, j, k] = k * 10000.0 + j * 100.0 + i
    np.testing.assert_array_equal(labels, want)
