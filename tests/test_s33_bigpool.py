"""The buffer pool keeps large buffers too (over 4 MiB), under a budget of their own.

A new large buffer cost lavapipe far more than the kernel writing it (relu over 10M floats:
14 ms into a used buffer, 44 ms into a new one and 16 ms to free it), so `y = ops.relu(x)`
on large tensors now reuses the buffer of a freed result. Values are checked against NumPy,
including a buffer handed out again while the kernel that read it may still be running.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pydiff
from pydiff import buffer_pool, ops

LARGE = (1 << 21) + 12  # floats: 8 MiB, past POOL_MAX_FLOAT4S (4 MiB), not a power of two
LARGE_BUDGET = buffer_pool.LARGE_POOL_MAX_BYTES  # (before the fixture lowers it)


class _CountingDevice:
    """The SlangPy device, counting the buffers created through it."""

    def __init__(self, native):
        self._native, self.created = native, 0

    def create_buffer(self, **kwargs):
        self.created += 1
        return self._native.create_buffer(**kwargs)

    def __getattr__(self, name):
        return getattr(self._native, name)


def test_a_large_result_reuses_a_freed_buffer(device, monkeypatch):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal(LARGE).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    y = ops.relu(x)
    np.testing.assert_array_equal(y.numpy(), np.maximum(xs, 0))
    del y
    counting = _CountingDevice(device.pool.native)
    monkeypatch.setattr(device.pool, "native", counting)
    for _ in range(3):
        y = ops.relu(x)
        np.testing.assert_array_equal(y.numpy(), np.maximum(xs, 0))
        del y
    assert counting.created == 0  # (3 before: large buffers were never kept)


def test_values_stay_right_when_large_buffers_change_hands(device):
    rng = np.random.default_rng(1)
    for k in range(4):
        xs = rng.standard_normal(LARGE).astype(np.float32)
        a = pydiff.tensor(xs, device=device)
        y = ops.relu(a)
        device.flush()  # submitted: lavapipe may not have run it yet when `a` goes
        del a
        # Likely `a`'s buffer: the upload must land after the relu that reads it has run.
        b = pydiff.tensor(np.full(LARGE, float(k) - 9.0, np.float32), device=device)
        z = y * 2.0
        np.testing.assert_array_equal(y.numpy(), np.maximum(xs, 0))
        np.testing.assert_array_equal(z.numpy(), 2 * np.maximum(xs, 0))
        np.testing.assert_array_equal(b.numpy(), float(k) - 9.0)


@pytest.fixture
def small_classes(monkeypatch):
    """Sizes of a few float4s: above 64 float4s a buffer counts as large."""
    monkeypatch.setattr(buffer_pool, "POOL_MAX_FLOAT4S", 64)
    monkeypatch.setattr(buffer_pool, "POOL_MAX_BYTES", 16 * 256)
    monkeypatch.setattr(buffer_pool, "LARGE_POOL_MAX_BYTES", 16 * 1000)
    monkeypatch.setattr(buffer_pool, "LARGE_POOL_MAX_PER_SIZE", 4)
    monkeypatch.setattr(buffer_pool, "LARGE_POOL_MAX_FREE_BYTES", 16 * 400)


def test_large_buffers_are_bounded_per_size_and_in_all(device, small_classes):
    pool = buffer_pool.BufferPool(device.native, device.queue)
    held = [pool.float4_buffer(100) for _ in range(6)]  # in use: all six kept (an optimizer's
    assert len({id(b) for b in held}) == 6  # state is many tensors of one size)
    assert pool.large_bytes == 16 * 600
    held += [pool.float4_buffer(n) for n in range(200, 700, 100)]
    assert pool.large_bytes <= 16 * 1000
    del held
    for n in (300, 500, 900):  # the free ones are released to make room
        pool.float4_buffer(n)
        assert pool.large_bytes <= 16 * 1000
    pool.prune()
    assert pool.sizes() == {"buffers": 0, "bytes": 0} and pool.large_bytes == 0


def test_free_large_buffers_of_one_size_are_trimmed_to_four(device, small_classes):
    pool = buffer_pool.BufferPool(device.native, device.queue)
    held = [pool.float4_buffer(70) for _ in range(6)]
    del held
    pool.float4_buffer(71)  # a new large buffer: the free ones are trimmed
    assert pool.large_bytes == 16 * (4 * 70 + 71)


def test_large_buffers_never_crowd_the_small_ones(device, small_classes):
    pool = buffer_pool.BufferPool(device.native, device.queue)
    large = [pool.float4_buffer(n) for n in (400, 500)]  # 14,400 bytes kept, in use
    small = pool.float4_buffer(32)
    kept = id(small)
    del small
    assert id(pool.float4_buffer(32)) == kept  # still pooled and reused
    # and a large budget reached prunes only large buffers: the free small one stays
    free_small = pool.float4_buffer(16)
    del free_small
    before = pool.bytes - pool.large_bytes
    del large
    pool.float4_buffer(900)
    assert pool.bytes - pool.large_bytes == before


def test_empty_cache_releases_large_buffers(device):
    gc.collect()
    device.empty_cache()
    in_use = device.pool.large_bytes  # (large tensors earlier tests of the session keep)
    x = pydiff.tensor(np.ones(LARGE, np.float32), device=device)
    y = x * 3.0
    assert y.numpy()[-1] == 3.0 and device.pool.large_bytes >= in_use + 8 * LARGE
    del x, y
    device.empty_cache()
    assert device.pool.large_bytes <= in_use


def test_long_lived_large_tensors_leave_room_for_temporaries(device, small_classes):
    """bench_train's 10M-float AdamW state (7 tensors of 40 MB alive) filled a first budget
    of 256 MiB, buffers in use counted, and `ops.relu(x)` there was never reused (29 ms a
    call against 14): the budget of buffers kept is now 512 MiB, and the free ones are
    bounded apart (below)."""
    assert 9 * 40_000_000 <= LARGE_BUDGET
    pool = buffer_pool.BufferPool(device.native, device.queue)
    state = [pool.float4_buffer(200) for _ in range(3)]  # 9,600 of the 16,000 bytes
    first = pool.float4_buffer(150)
    kept = id(first)
    del first
    assert id(pool.float4_buffer(150)) == kept
    assert len(state) == 3


def test_free_large_buffers_past_their_budget_are_released(device, small_classes):
    pool = buffer_pool.BufferPool(device.native, device.queue)
    held = [pool.float4_buffer(n) for n in (100, 110, 120, 130)]  # 7,360 bytes, kept
    assert pool.large_bytes == 16 * 460
    del held  # all free now: more than LARGE_POOL_MAX_FREE_BYTES (6,400)
    pool.float4_buffer(140)  # a new size: the free ones past the budget go
    free = pool.large_bytes - 16 * 140
    assert 0 < free <= 16 * 400
