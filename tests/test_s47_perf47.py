"""``Device.wait()`` polls the device's last submission on Vulkan (pydiff.command_queue's
``wait``): it must still wait for every submission, pydiff's own, SlangPy's calls and user
code's (submitted outside pydiff's queue), made on any thread. Each test copies results into
a read-back buffer with a submission of its own and reads the buffer mapped (SlangPy's
``to_numpy`` of read-back memory does not wait): a wait that returned early reads stale
values. References: NumPy in float64."""

import threading

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import ops

N = 1 << 20  # large enough that the kernels are still running when the wait starts


@pytest.fixture
def dev():
    device = pydiff.default_device()
    if device.type != "vulkan":
        pytest.skip("the polling wait is Vulkan's")
    if device.queue.submits is None:
        pytest.skip("PYDIFF_POLL_WAIT=0")
    return device


def _copy_out(device, tensor):
    """A read-back buffer holding ``tensor``'s values once the device has run the copy, which
    is submitted here, outside pydiff's queue (the tensor's pending work submitted first)."""
    native = device.native  # (flushes pydiff's deferred work)
    nbytes = 4 * tensor.numel
    out = native.create_buffer(
        size=nbytes, usage=spy.BufferUsage.copy_destination, memory_type=spy.MemoryType.read_back
    )
    encoder = native.create_command_encoder()
    encoder.copy_buffer(out, 0, tensor.native.storage, 4 * tensor.native.offset, nbytes)
    submit_id = native.submit_command_buffer(encoder.finish())
    return out, submit_id


def _mapped(buffer, n):
    return buffer.to_numpy().view(np.float32)[:n]


def _work(device, rng):
    x = rng.standard_normal(N).astype(np.float32)
    y = pydiff.tensor(x, device=device)
    for _ in range(4):
        y = ops.tanh(y * 1.5 + 0.25)
    ref = x.astype(np.float64)
    for _ in range(4):
        ref = np.tanh(ref * 1.5 + 0.25)
    return y, ref


def test_wait_covers_a_submission_made_outside_pydiffs_queue(dev):
    rng = np.random.default_rng(1)
    dev.wait()
    for _ in range(3):
        y, ref = _work(dev, rng)
        out, submit_id = _copy_out(dev, y)
        assert dev.queue.submits.last >= submit_id  # reported through SlangPy's callback
        dev.wait()
        assert dev.native.is_submit_finished(submit_id)
        np.testing.assert_allclose(_mapped(out, N), ref, rtol=1e-5, atol=1e-6)


def test_wait_covers_another_threads_submission(dev):
    rng = np.random.default_rng(2)
    dev.wait()
    handed = {}
    done = threading.Event()

    def other():
        y, ref = _work(dev, rng)
        handed["out"], handed["id"] = _copy_out(dev, y)
        handed["ref"] = ref
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    assert done.wait(60)
    dev.wait()  # this thread queued nothing: the other thread's submission is waited for
    assert dev.native.is_submit_finished(handed["id"])
    np.testing.assert_allclose(_mapped(handed["out"], N), handed["ref"], rtol=1e-5, atol=1e-6)
    thread.join()


def test_wait_covers_slangpy_calls_and_pydiff_submissions(dev):
    rng = np.random.default_rng(3)
    dev.wait()
    y, ref = _work(dev, rng)
    dev.flush()  # pydiff's own submission
    before = dev.queue.submits.last
    z = pydiff.tensor(np.zeros(4, np.float32), device=dev)
    z.native.copy_from_numpy(np.arange(4, dtype=np.float32))  # SlangPy's own submission
    assert dev.queue.submits.last > before
    out, submit_id = _copy_out(dev, y)
    dev.wait()
    assert dev.native.is_submit_finished(submit_id)
    np.testing.assert_allclose(_mapped(out, N), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(z.numpy(), np.arange(4, dtype=np.float64))


def test_waited_training_steps_match_numpy(dev):
    """A step waited on each time (the benchmarks' pattern) still computes the same step:
    one SGD step of a linear least-squares model against its closed-form gradient."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    t = rng.standard_normal((32, 3)).astype(np.float32)
    w0 = rng.standard_normal((3, 8)).astype(np.float32)
    w = pydiff.tensor(w0, device=dev, requires_grad=True)
    xt, tt = pydiff.tensor(x, device=dev), pydiff.tensor(t, device=dev)
    ref = w0.astype(np.float64)
    for _ in range(5):
        with pydiff.Tape() as tape:
            d = ops.linear(xt, w) - tt
            loss = (d * d).sum()
        tape.backward(loss)
        dev.wait()
        g = 2 * (x.astype(np.float64) @ ref.T - t).T @ x
        np.testing.assert_allclose(w.grad.numpy(), g, rtol=1e-4, atol=1e-3)
        w.grad.zero_()
        ref = ref - 1e-3 * g
        w.copy_from_numpy(ref.astype(np.float32))
        dev.wait()
