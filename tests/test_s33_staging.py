"""Large float transfers go through staging buffers the device keeps (pydiff.staging): 40 MB
took 24 ms up and 40 ms back through SlangPy's new staging memory each time, 5 and 18 ms
through kept buffers on lavapipe. Every value comes back bit for bit (NaN payloads, -0.0,
subnormals), at chunk boundaries, at a view's offset, with kernels before and after.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import ops, staging


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 KiB + 12 bytes (not a multiple of 16) and transfers from 8 KiB: many
    chunks, cheaply."""
    monkeypatch.setattr(staging, "CHUNK_BYTES", 4096 + 12)
    monkeypatch.setattr(staging, "STAGING_MIN_BYTES", 8192)
    monkeypatch.setattr(staging, "IN_ORDER_MAX_BYTES", 4096)  # (else 40 KB join the list)


def _vulkan(device):
    if device.type != "vulkan":
        pytest.skip("staged transfers are Vulkan's (SlangPy's path elsewhere)")


def _awkward(n: int, seed: int) -> np.ndarray:
    """Floats with every awkward bit pattern among random ones."""
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-42, -3.4e38], np.float32)
    values[:: max(1, n // 50)][: special.size] = special[: values[:: max(1, n // 50)].size]
    bits = values.view(np.uint32)
    bits[7] = 0x7FC0_1234  # a NaN with a payload
    return values


def test_a_large_round_trip_is_bit_exact_and_staged(device, small_chunks):
    _vulkan(device)
    device.empty_cache()
    values = _awkward(10_001, 0)  # 40,004 bytes: 10 chunks, the last partial
    x = pydiff.tensor(values, device=device)
    assert "upload" in device.queue.staging  # (SlangPy's own path before)
    back = x.numpy()
    assert "read_back" in device.queue.staging
    assert back.dtype == np.float32 and back.shape == values.shape
    np.testing.assert_array_equal(back.view(np.uint32), values.view(np.uint32))


def test_a_2d_tensor_and_a_view_at_an_offset(device, small_chunks):
    _vulkan(device)
    values = _awkward(64 * 97, 1).reshape(64, 97)
    x = pydiff.tensor(np.zeros((64, 97), np.float32), device=device)
    x.copy_from_numpy(values)
    np.testing.assert_array_equal(x.numpy().view(np.uint32), values.view(np.uint32))
    rows = x[5:60]  # contiguous, at an offset of 5 rows
    np.testing.assert_array_equal(rows.numpy().view(np.uint32), values[5:60].view(np.uint32))
    np.testing.assert_array_equal(x.T.numpy(), values.T)  # strided: SlangPy's path


def test_a_view_at_an_offset_reads_and_writes_its_own_elements(device, small_chunks):
    """(Slices are copies in pydiff; a SlangPy view of the same storage is not.)"""
    _vulkan(device)
    base = pydiff.tensor(np.full(9000, 7.0, np.float32), device=device)
    n = base.native
    view = pydiff.Tensor(spy.Tensor(n.storage, n.dtype, [7000], [1], 1000), device)
    view.copy_from_numpy(np.arange(7000, dtype=np.float32))
    want = np.full(9000, 7.0, np.float32)
    want[1000:8000] = np.arange(7000)
    np.testing.assert_array_equal(base.numpy(), want)
    np.testing.assert_array_equal(view.numpy(), np.arange(7000, dtype=np.float32))


def test_kernels_before_and_after_a_staged_transfer(device, small_chunks):
    _vulkan(device)
    xs = _awkward(5000, 2)
    xs[np.isnan(xs) | np.isinf(xs)] = 1.0
    x = pydiff.tensor(xs, device=device)
    y = ops.relu(x)  # deferred: the read must see it run
    np.testing.assert_array_equal(y.numpy(), np.maximum(xs, 0))
    y.copy_from_numpy(-xs)  # overwritten on the host, then read by a kernel
    np.testing.assert_array_equal(ops.relu(y).numpy(), np.maximum(-xs, 0))


def test_ints_are_staged_and_other_dtypes_keep_slangpys_path(device, small_chunks):
    _vulkan(device)
    labels = (np.arange(5000, dtype=np.int64) * 7919 % 10007 - 5000).astype(np.int32)
    t = pydiff.tensor(labels, device=device)
    np.testing.assert_array_equal(t.numpy(), labels)
    words = np.arange(3000, dtype=np.uint32) * np.uint32(2654435761)
    u = pydiff.tensor(words, device=device, dtype="uint")
    got = u.numpy()
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, words)
    halves = np.linspace(-2, 2, 5000).astype(np.float16)  # 2 bytes: SlangPy's path
    np.testing.assert_array_equal(pydiff.tensor(halves, device=device).numpy(), halves)
    x = pydiff.tensor(np.ones(5000, np.float64), device=device)  # cast to float32, staged
    np.testing.assert_array_equal(x.numpy(), np.ones(5000, np.float32))


def test_threads_transfer_their_own_tensors(device, small_chunks):
    _vulkan(device)
    failures = []

    def work(seed):
        try:
            for k in range(5):
                values = np.random.default_rng([seed, k]).standard_normal(3000).astype(np.float32)
                t = pydiff.tensor(values, device=device)
                if not np.array_equal(t.numpy(), values):
                    failures.append((seed, k))
        except Exception as exc:  # noqa: BLE001 (reported below)
            failures.append(repr(exc))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_empty_cache_releases_the_staging_buffers(device, small_chunks):
    _vulkan(device)
    pydiff.tensor(np.ones(5000, np.float32), device=device).numpy()
    assert device.queue.staging
    device.empty_cache()
    assert device.queue.staging == {}
