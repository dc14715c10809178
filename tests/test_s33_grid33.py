"""Breaker grid33: forward calls over a grid as generated kernels (pydiff.generated_grid) and
staged host transfers (pydiff.staging).

Every grid call is run twice, generated (``generated.MIN_ELEMENTS`` = 1, counted by
``stats()["forward: grid"]``) and on SlangPy's path (``PYDIFF_GENERATED=0``), and the two are
compared bit for bit and against float64 NumPy.

Failing (bugs):
- ``test_a_grid_call_reading_and_writing_negative_stride_views``: a SlangPy view with a negative
  stride, which SlangPy's path indexes fine, makes the generated kernel raise a raw
  ``RuntimeError: std::bad_cast`` (a negative stride bound to a ``uint`` uniform).
- ``test_numpy_of_a_negative_stride_view``: ``Tensor.numpy()`` of such a view returns other
  memory (SlangPy's ``to_numpy``, which ``read_back`` hands negative strides to).
- ``test_staging_buffers_follow_chunk_bytes``: the staging buffers keep the size
  ``CHUNK_BYTES`` had when they were made: after it grows (a test's monkeypatch undone, as
  ``tests/test_s33_staging.py``'s ``small_chunks`` leaves the session's device), every staged
  transfer raises SlangPy's raw ``RuntimeError``.

The others are cheap regression cases that pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated, staging

SOURCE = """import slangpy;
[Differentiable]
void poly(int idx, float a, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = a * v * v + 1.0; }
void copy_plus(int idx, float a, ITensor<float, 1> x, IWTensor<float, 1> y) { y[idx] = x[idx] + a; }
void shifted(uint idx, ITensor<float, 1> x, IWTensor<float, 1> y) { y[idx] = x[idx - 1u]; }
void shifted_int(int idx, ITensor<float, 1> x, IWTensor<float, 1> y) { y[idx] = x[idx - 1]; }
void rows(int idx, ITensor<float, 2> x, IWTensor<float, 2> by_array, IWTensor<float, 2> by_vector)
{
    for (int j = 0; j < int(x.shape[1]); j++)
    {
        int at[2] = { idx, j };
        by_array[at] = x[at] * 2.0;
        by_vector[int2(j, idx)] = x[at] + 1.0;    // SlangPy's vector index: innermost first
    }
}
void wave(int idx, ITensor<float, 1> x, IWTensor<float, 1> y)
{ y[idx] = WaveActiveSum(x[idx]) + 1000.0 * float(WaveGetLaneIndex()); }
void kw(int idx, float a, float b, IWTensor<float, 1> y) { y[idx] = a * 10.0 + b + float(idx); }
void sq(int idx, ITensor<float, 1> x, IWTensor<float, 1> y) { y[idx] = x[idx] * x[idx]; }
void sq_bwd(int idx, ITensor<float, 1> x, ITensor<float, 1> g, IWTensor<float, 1> gx)
{ gx[idx] = 2.0 * x[idx] * g[idx]; }
"""
OTHER = """import slangpy;
void copy_plus(int idx, float a, ITensor<float, 1> x, IWTensor<float, 1> y) { y[idx] = x[idx] - a; }
"""


@pytest.fixture
def mod(device):
    return _module(device, "s33_grid33_m", SOURCE)


_modules: dict = {}


def _module(device, name, source):
    key = (name, id(device))
    if key not in _modules:
        _modules[key] = pydiff.load_module_from_source(name, source, device=device)
    return _modules[key]


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)


GENERATES = True  # (False on CUDA, which keeps SlangPy's kernel for grid calls)


@pytest.fixture(autouse=True)
def _grid_generation(device):
    global GENERATES
    GENERATES = device.type != "cuda"


def _grid_calls() -> int:
    return generated.stats().get("forward: grid", 0)


def _both(monkeypatch, call, taken: bool = True):
    """``call()`` (a list of arrays) generated, then on SlangPy's path; asserts the first took
    the generated grid kernel (``taken``; else that it declined) and the two agree bit for
    bit; returns the generated arrays."""
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    before = _grid_calls()
    gen = call()
    taken = taken and GENERATES
    assert _grid_calls() == before + taken, "the generated grid kernel was taken: " + str(not taken)
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    try:
        ref = call()
    finally:
        monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    for g, r in zip(gen, ref):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(r).view(np.uint32))
    return gen


def _view(base: pydiff.Tensor, shape, strides, offset) -> pydiff.Tensor:
    n = base.native
    return pydiff.Tensor(
        spy.Tensor(n.storage, n.dtype, list(shape), list(strides), offset), base.device
    )


# --- bugs ------------------------------------------------------------------------------------


def test_a_grid_call_reading_and_writing_negative_stride_views(mod, device, forced, monkeypatch):
    n = 64
    values = np.arange(2 * n, dtype=np.float32)

    def read_reversed():
        base = pydiff.tensor(values, device=device)
        y = pydiff.zeros((n,), device=device)
        mod.copy_plus(spy.grid((n,)), 0.5, _view(base, (n,), (-1,), n - 1), y)
        return [y.numpy()]

    def write_reversed():
        base = pydiff.tensor(values, device=device)
        x = pydiff.tensor(np.arange(n, dtype=np.float32), device=device)
        mod.copy_plus(spy.grid((n,)), 1000.0, x, _view(base, (n,), (-1,), 2 * n - 1))
        return [base.numpy()]

    # (Declined: negative strides keep SlangPy's path; they gave a raw std::bad_cast.)
    (got,) = _both(monkeypatch, read_reversed, taken=False)
    np.testing.assert_array_equal(got, values[n - 1 :: -1] + 0.5)
    (got,) = _both(monkeypatch, write_reversed, taken=False)
    want = values.copy()
    want[n:] = np.arange(n, dtype=np.float32)[::-1] + 1000.0
    np.testing.assert_array_equal(got, want)


def test_numpy_of_a_negative_stride_view(device):
    values = np.arange(32, dtype=np.float32)
    base = pydiff.tensor(values, device=device)
    np.testing.assert_array_equal(_view(base, (16,), (-1,), 15).numpy(), values[15::-1])
    two_d = _view(base, (4, 4), (-4, 1), 12)  # rows in reverse order
    np.testing.assert_array_equal(two_d.numpy(), values[:16].reshape(4, 4)[::-1])


def test_staging_buffers_follow_chunk_bytes(device, monkeypatch):
    if device.type != "vulkan":
        pytest.skip("staged transfers are Vulkan's")
    values = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    try:
        device.empty_cache()
        monkeypatch.setattr(staging, "STAGING_MIN_BYTES", 1)
        monkeypatch.setattr(staging, "CHUNK_BYTES", 64)  # as a test would, cheaply
        x = pydiff.tensor(values, device=device)  # the two buffers made, 64 bytes each
        np.testing.assert_array_equal(x.numpy(), values)
        monkeypatch.setattr(staging, "CHUNK_BYTES", 16 << 20)  # the test's monkeypatch undone
        y = pydiff.tensor(values, device=device)
        np.testing.assert_array_equal(y.numpy(), values)
        np.testing.assert_array_equal(x.numpy(), values)
    finally:
        device.empty_cache()  # (leave the session's device with no stale buffer)


# --- regression cases (pass) -------------------------------------------------------------------


def test_grid_poly_then_bwds_against_closed_form(mod, device, forced, monkeypatch):
    xs = np.linspace(-2.0, 2.0, 300, dtype=np.float32)

    def call():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = pydiff.zeros((300,), device=device)
        mod.poly(spy.grid((300,)), 3, x, y)  # an int at a float parameter
        y = y.with_grads(ones=True)
        mod.poly.bwds(spy.grid((300,)), 3, x, y)
        return [y.numpy(), x.grad.numpy()]

    y, gx = _both(monkeypatch, call)
    x64 = xs.astype(np.float64)
    np.testing.assert_allclose(y, 3 * x64 * x64 + 1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gx, 6 * x64, rtol=1e-6, atol=1e-6)


def test_uint_and_int_indices_off_the_start(mod, device, forced, monkeypatch):
    xs = np.arange(1, 101, dtype=np.float32)
    for name in ("shifted", "shifted_int"):

        def call():
            x = pydiff.tensor(xs, device=device)
            y = pydiff.zeros((100,), device=device)
            getattr(mod, name)(spy.grid((100,)), x, y)
            return [y.numpy()]

        (got,) = _both(monkeypatch, call)
        np.testing.assert_array_equal(got[1:], xs[:-1])  # (element 0 reads before x: either path)


def test_a_grid_larger_than_its_tensors_leaves_other_tensors_intact(
    mod, device, forced, monkeypatch
):
    if device.type == "cuda":  # (raw pointers: nothing drops a store past a tensor's end)
        pytest.skip("CUDA has no robust buffer access: stores past a tensor's end land in memory")

    def call():
        before = pydiff.tensor(np.full(64, 1.0, np.float32), device=device)
        x = pydiff.tensor(np.arange(10, dtype=np.float32), device=device)
        y = pydiff.zeros((10,), device=device)
        after = pydiff.tensor(np.full(64, 3.0, np.float32), device=device)
        mod.copy_plus(spy.grid((64,)), 0.0, x, y)
        return [y.numpy(), before.numpy(), after.numpy()]

    y, before, after = _both(monkeypatch, call)
    np.testing.assert_array_equal(y, np.arange(10, dtype=np.float32))
    assert (before == 1.0).all() and (after == 3.0).all()


def test_2d_strided_views_array_and_vector_indices(mod, device, forced, monkeypatch):
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((40, 3)).astype(np.float32)

    def call():
        storage = pydiff.tensor(np.ascontiguousarray(xs.T), device=device)  # (3, 40)
        x = _view(storage, (40, 3), (1, 40), 0)  # its transpose, in place
        by_array = pydiff.zeros((40, 3), device=device)
        by_vector = pydiff.zeros((40, 3), device=device)
        mod.rows(spy.grid((40,)), x, by_array, by_vector)
        return [by_array.numpy(), by_vector.numpy()]

    by_array, by_vector = _both(monkeypatch, call)
    np.testing.assert_array_equal(by_array, xs * np.float32(2.0))
    np.testing.assert_array_equal(by_vector, xs + np.float32(1.0))


def test_strided_write_at_an_offset_touches_only_its_elements(mod, device, forced, monkeypatch):
    n = 50
    values = np.arange(4 * n, dtype=np.float32)

    def call():
        base = pydiff.tensor(values, device=device)
        x = pydiff.tensor(np.arange(n, dtype=np.float32), device=device)
        mod.copy_plus(spy.grid((n,)), 1000.0, x, _view(base, (n,), (3,), 5))
        return [base.numpy()]

    (got,) = _both(monkeypatch, call)
    want = values.copy()
    want[5 : 5 + 3 * n : 3] = np.arange(n) + 1000.0
    np.testing.assert_array_equal(got, want)


def test_wave_ops_see_the_same_lanes(mod, device, forced, monkeypatch):
    xs = np.arange(1, 1001, dtype=np.float32)

    def call():
        x = pydiff.tensor(xs, device=device)
        y = pydiff.zeros((1000,), device=device)
        mod.wave(spy.grid((1000,)), x, y)
        return [y.numpy()]

    _both(monkeypatch, call)


def test_keyword_arguments_in_another_order(mod, device, forced, monkeypatch):
    def call():
        y = pydiff.zeros((70,), device=device)
        mod.kw(spy.grid((70,)), b=3.0, y=y, a=-2.0)
        return [y.numpy()]

    (got,) = _both(monkeypatch, call)
    np.testing.assert_array_equal(got, -20.0 + 3.0 + np.arange(70, dtype=np.float32))


def test_the_same_name_in_two_modules(mod, device, forced, monkeypatch):
    other = _module(device, "s33_grid33_other", OTHER)
    xs = np.arange(80, dtype=np.float32)
    for m, sign in ((mod, 1.0), (other, -1.0), (mod, 1.0)):

        def call():
            x = pydiff.tensor(xs, device=device)
            y = pydiff.zeros((80,), device=device)
            m.copy_plus(spy.grid((80,)), 5.0, x, y)
            return [y.numpy()]

        (got,) = _both(monkeypatch, call)
        np.testing.assert_array_equal(got, xs + np.float32(sign * 5.0))


def test_grid_calls_in_a_function_forward_and_backward(mod, device, forced, monkeypatch):
    class Square(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            y = pydiff.zeros(x.shape, device=device)
            mod.sq(spy.grid(x.shape), x, y)
            return y

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            gx = pydiff.zeros(x.shape, device=device)
            mod.sq_bwd(spy.grid(x.shape), x, g, gx)
            return gx

    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)  # (pytest --pydiff-generated=off)
    xs = np.linspace(-2.0, 2.0, 90, dtype=np.float32)
    before = _grid_calls()
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        z = Square.apply(Square.apply(x))  # x^4
        loss = z.sum()
    tape.backward(loss)
    assert _grid_calls() == before + 4 * GENERATES
    x64 = xs.astype(np.float64)
    np.testing.assert_allclose(z.numpy(), x64**4, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 4 * x64**3, rtol=1e-5, atol=1e-5)


def test_staged_transfers_of_awkward_inputs(device, monkeypatch):
    if device.type != "vulkan":
        pytest.skip("staged transfers are Vulkan's")
    try:
        device.empty_cache()
        monkeypatch.setattr(staging, "STAGING_MIN_BYTES", 1)
        monkeypatch.setattr(staging, "CHUNK_BYTES", 64)
        rng = np.random.default_rng(7)
        bits = rng.integers(0, 2**32, 37, dtype=np.uint32)
        bits[:4] = [0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800001]  # NaN payloads, -0.0
        a = bits.view(np.float32)
        np.testing.assert_array_equal(pydiff.tensor(a, device=device).numpy().view(np.uint32), bits)
        b = rng.standard_normal(80).astype(np.float32)
        f = np.asfortranarray(rng.standard_normal((7, 9)).astype(np.float32))
        d = rng.standard_normal((5, 11))
        for src, want in ((b[::2], b[::2]), (b[::-1], b[::-1]), (f, f), (d, d.astype(np.float32))):
            np.testing.assert_array_equal(pydiff.tensor(src, device=device).numpy(), want)
        z = pydiff.tensor(np.float32(3.5), device=device)
        z.copy_from_numpy(np.array(-0.0, np.float32))
        assert z.numpy().shape == () and np.signbit(z.numpy())
        base = pydiff.tensor(np.arange(100, dtype=np.float32), device=device)
        _view(base, (40,), (1,), 17).copy_from_numpy(np.full(40, -1.0, np.float32))
        want = np.arange(100, dtype=np.float32)
        want[17:57] = -1.0
        np.testing.assert_array_equal(base.numpy(), want)
        np.testing.assert_array_equal(
            _view(base, (5, 6), (10, 1), 3).numpy(), want[3:53].reshape(5, 10)[:, :6]
        )
    finally:
        device.empty_cache()
