"""Storage reuse (pydiff keeps freed float buffers for new tensors) never hands out a buffer
something still reads or writes: values are checked against NumPy after each reuse."""

import gc

import numpy as np
import pytest

import pydiff
from pydiff import ops


def test_freed_storage_is_reused_with_fresh_values(device):
    n = 4 * 997  # a size no other test uses, so this size's pool holds only this test's buffers
    pydiff.empty_cache()
    a = pydiff.tensor(np.arange(n, dtype=np.float32), device=device)
    handle = a.native.storage.native_handle.value  # not the buffer: a reference keeps it in use
    del a
    gc.collect()
    b = pydiff.tensor(np.full(n, 7.0, np.float32), device=device)
    np.testing.assert_array_equal(b.numpy(), np.full(n, 7.0, np.float32))
    # float tensors of every backend go through pydiff's own pool
    assert b.native.storage.native_handle.value == handle
    del b
    gc.collect()
    z = pydiff.zeros((n,), device=device)
    np.testing.assert_array_equal(z.numpy(), np.zeros(n, np.float32))


def test_views_keep_their_storage(device):
    a = pydiff.tensor(np.arange(64, dtype=np.float32), device=device)
    view = a.reshape((8, 8))
    del a
    gc.collect()
    others = [pydiff.tensor(np.full(64, -1.0, np.float32), device=device) for _ in range(4)]
    assert all(o.native.storage is not view.native.storage for o in others)
    np.testing.assert_array_equal(view.numpy(), np.arange(64, dtype=np.float32).reshape(8, 8))


def test_repeated_steps_match_numpy(device):
    """Temporaries freed every step are reused by the next; gradients stay exact."""
    rng = np.random.default_rng(3)
    X, W = (
        rng.standard_normal((16, 8)).astype(np.float32),
        rng.standard_normal((4, 8)).astype(np.float32),
    )
    w = pydiff.tensor(W, device=device, requires_grad=True)
    x = pydiff.tensor(X, device=device)
    for step in range(5):
        w.zero_grad()
        scale = float(step + 1)
        with pydiff.Tape() as tape:
            y = ops.relu(ops.linear(x, w))
            loss = ops.sum(
                ops.mul(y, pydiff.tensor(np.full((16, 4), scale, np.float32), device=device))
            )
        tape.backward(loss)
        mask = (X @ W.T > 0).astype(np.float32)
        np.testing.assert_allclose(w.grad.numpy(), (scale * mask).T @ X, rtol=1e-5, atol=1e-5)


def test_empty_cache_releases_and_keeps_working(device):
    kept = pydiff.tensor(np.ones(32, np.float32), device=device)
    for _ in range(3):
        pydiff.zeros((32,), device=device)
    pydiff.empty_cache()
    pydiff.empty_cache(device)
    np.testing.assert_array_equal(kept.numpy(), np.ones(32, np.float32))
    np.testing.assert_array_equal(ops.relu(kept).numpy(), np.ones(32, np.float32))


def test_empty_cache_names_a_bad_device():
    with pytest.raises((ValueError, TypeError), match="device"):
        pydiff.empty_cache("not-a-device")


def test_empty_cache_releases_scratch_and_broadcast_gradients_stay_right(device):
    """A broadcast parameter's gradient is summed through a scratch buffer; empty_cache drops
    this thread's scratch, and the next backward (new scratch) is still right."""
    from pydiff import ops as _ops

    X = np.linspace(-1.0, 1.0, 64).reshape(16, 4).astype(np.float32)
    for _ in range(2):
        x = pydiff.tensor(X, device=device)
        b = pydiff.tensor(
            np.array([0.5, -0.25, 1.0, 2.0], np.float32), device=device, requires_grad=True
        )
        with pydiff.Tape() as tape:
            y = _ops.mul(x, b)
        tape.backward(y, grad=np.ones((16, 4), np.float32))
        np.testing.assert_allclose(b.grad.numpy(), X.sum(0), rtol=1e-5, atol=1e-6)
        assert len(device.scratch) > 0  # the sum went through scratch buffers
        pydiff.empty_cache()
        assert len(device.scratch) == 0
