"""A backward's store counts are checked on the device (pydiff.written_mask): the store that
finds an element already stored once records it (how many such elements, the lowest flat
index), and only those 8 bytes come back, not 4 bytes per element (16 MB at 2^22: the
readback and NumPy's max cost bench_grid's ``.bwds`` about 5 ms). The element a refused call
names is checked against NumPy's count of which thread stored where; calls without a race
against float64 closed forms.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated

SOURCE = """import slangpy;
// Thread idx stores element idx, except thread a (stores b) and thread c (stores d).
int target(int idx, int a, int b, int c, int d)
{
    if (idx == a)
        return b;
    if (idx == c)
        return d;
    return idx;
}
[Differentiable]
void scatter1(int idx, float a, float b, float c, float d, IDiffTensor<float, 1> x,
              IWDiffTensor<float, 1> y)
{
    int j = no_diff target(idx, int(a), int(b), int(c), int(d));
    float v = x[idx];
    y[j] = 1.5 * v * v;
}
[Differentiable]
void scatter2(int idx, float a, float b, float c, float d, float width,
              IDiffTensor<float, 1> x, IWDiffTensor<float, 2> y)
{
    int j = no_diff target(idx, int(a), int(b), int(c), int(d));
    int w = int(width);
    float v = x[idx];
    y[j / w, j % w] = 1.5 * v * v;
}
// In place, every third element (the others' upstream passes through).
[Differentiable]
void double_thirds(int idx, float a, float b, IRWDiffTensor<float, 1> y)
{
    int j = 3 * no_diff target(idx, int(a), int(b), -1, -1);
    y[j] = 2.0 * y[j];
}
"""
_names = itertools.count()
NONE = -1.0  # no thread redirected


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source(f"s34_counts34_{next(_names)}", SOURCE, device=device)


def _grid_backwards() -> int:
    return generated.stats().get("backward: grid", 0)


def _targets(numel: int, a: float, b: float, c: float, d: float) -> np.ndarray:
    """Which element each thread stores (the shader's ``target``)."""
    idx = np.arange(numel)
    return np.where(idx == int(a), int(b), np.where(idx == int(c), int(d), idx))


def _scatter(mod, device, shape, moves, up=None):
    """Run the scatter of ``shape`` with ``moves`` (a, b, c, d) over one thread per element;
    returns x's values and gradient."""
    numel = int(np.prod(shape))
    xs = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros(shape, device=device).with_grads(zero=True)
    y.grad.copy_from_numpy((np.ones(numel) if up is None else up).reshape(shape).astype(np.float32))
    if len(shape) == 1:
        mod.scatter1.bwds(spy.grid((numel,)), *moves, x, y)
    else:
        mod.scatter2.bwds(spy.grid((numel,)), *moves, float(shape[1]), x, y)
    return xs, x.grad.numpy()


RACES = [
    ((10,), (3.0, 7.0, NONE, NONE)),  # small: SlangPy's kernel (unless forced)
    ((1001,), (999.0, 1000.0, 5.0, 1000.0)),  # the last element, in the tail past 960, 3 stores
    ((1001,), (998.0, 997.0, 1000.0, 0.0)),  # element 0 and one in the tail: 2 elements
    ((4100,), (1.0, 0.0, 4099.0, 4098.0)),  # generated kernel: element 0 named of 2
    ((4100,), (4097.0, 4099.0, NONE, NONE)),  # generated kernel: the last element
    ((7, 13), (50.0, 90.0, 3.0, 0.0)),  # 2-D: (0, 0) and the last element
    ((65, 67), (4354.0, 4300.0, 17.0, 4300.0)),  # 2-D, generated: (64, 12) stored 3 times
    ((65, 67), (4354.0, 4353.0, NONE, NONE)),  # 2-D: the one before the last
]


@pytest.mark.parametrize("shape, moves", RACES)
def test_a_race_names_the_element_numpy_finds(mod, device, shape, moves):
    numel = int(np.prod(shape))
    counts = np.bincount(_targets(numel, *moves), minlength=numel)
    raced = np.flatnonzero(counts > 1)
    at = tuple(int(i) for i in np.unravel_index(raced[0], shape))
    want = (
        rf"'y': element {re.escape(str(at))} was stored {counts[raced[0]]} times by one call "
        rf"\({len(raced)} element\(s\) stored more than once\)"
    )
    before = _grid_backwards()
    with pytest.raises(ValueError, match=want):
        _scatter(mod, device, shape, moves)
    covered = numel >= generated.MIN_ELEMENTS and device.type != "cuda"  # (generated_grid)
    assert _grid_backwards() == before + covered


@pytest.mark.parametrize("shape", [(10,), (1001,), (4100,), (7, 13), (65, 67)])
def test_no_race_no_error_and_the_closed_form(mod, device, shape):
    numel = int(np.prod(shape))
    up = np.random.default_rng(7).uniform(-2.0, 2.0, numel)
    xs, grad = _scatter(mod, device, shape, (NONE, NONE, NONE, NONE), up)
    want = 3.0 * xs.astype(np.float64) * up.astype(np.float32)  # d(1.5 x^2)/dx * upstream
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6)


def test_a_moved_store_without_a_race_is_not_refused(mod, device):
    # thread 3 stores element 0, thread 0 element 3: each element once
    xs, grad = _scatter(mod, device, (1001,), (3.0, 0.0, 0.0, 3.0))
    np.testing.assert_allclose(grad, 3.0 * xs.astype(np.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [10, 1001, 4100])
def test_the_check_reads_back_a_few_bytes(mod, device, monkeypatch, n):
    read: list[int] = []
    numpy = pydiff.Tensor.numpy

    def counting(self):
        values = numpy(self)
        read.append(values.nbytes)
        return values

    xs = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros((n,), device=device).with_grads(ones=True)
    device.wait()
    monkeypatch.setattr(pydiff.Tensor, "numpy", counting)
    mod.scatter1.bwds(spy.grid((n,)), NONE, NONE, NONE, NONE, x, y)
    monkeypatch.undo()
    assert read and max(read) <= 16, read  # (the counts: 4 bytes per element)
    np.testing.assert_allclose(x.grad.numpy(), 3.0 * xs.astype(np.float64), rtol=1e-6)


def test_counts_in_a_reused_buffer_start_from_zero(mod, device):
    # A freed float buffer of the mask's size, full of values that read as counts > 1, and
    # the mask's own buffer of a refused call: neither leaves a count or a race behind.
    n = 1001
    junk = pydiff.tensor(np.full(n + 3, 2.0, np.float32), device=device)
    device.wait()
    del junk
    with pytest.raises(ValueError, match="stored 2 times"):
        _scatter(mod, device, (n,), (0.0, 1.0, NONE, NONE))
    for _ in range(2):
        xs, grad = _scatter(mod, device, (n,), (NONE, NONE, NONE, NONE))
        np.testing.assert_allclose(grad, 3.0 * xs.astype(np.float64), rtol=1e-6, atol=1e-6)


def test_in_place_pass_through_and_its_race(mod, device):
    n = 1001
    ys = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    up = np.random.default_rng(4).uniform(-1.0, 1.0, n).astype(np.float32)
    y = pydiff.tensor(ys, device=device, requires_grad=True)
    y.grad.copy_from_numpy(up)
    threads = (spy.grid((-(-n // 3),)),)
    mod.double_thirds.bwds(*threads, NONE, NONE, y)
    written = np.arange(n) % 3 == 0
    want = np.where(written, 2.0, 1.0) * up.astype(np.float64)  # d(2y)/dy, or passed through
    np.testing.assert_allclose(y.grad.numpy(), want, rtol=1e-6)
    y.grad.copy_from_numpy(up)
    with pytest.raises(ValueError, match=r"'y': element \(999,\) was stored 2 times"):
        mod.double_thirds.bwds(*threads, 300.0, 333.0, y)  # threads 300 and 333 store 999
