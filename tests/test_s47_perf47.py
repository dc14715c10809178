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


# --- small reads (pydiff.staging.read_small): the copy joins the pending work's submission ---


@pytest.mark.parametrize("n", [1, 7, 1024, 1025])  # 1024 floats: SMALL_READ_BYTES; 1025: past it
def test_small_reads_after_pending_work_match_numpy(dev, n):
    rng = np.random.default_rng(10 + n)
    x = rng.standard_normal(n).astype(np.float32)
    t = pydiff.tensor(x, device=dev)
    y = ops.tanh(t * 2.0 - 0.5)  # pending in the deferred list when read
    np.testing.assert_allclose(y.numpy(), np.tanh(x.astype(np.float64) * 2 - 0.5), rtol=1e-5)
    s = y.sum()
    assert s.item() == pytest.approx(np.tanh(x.astype(np.float64) * 2 - 0.5).sum(), rel=1e-4)


def test_small_reads_of_views_and_integer_tensors(dev):
    rng = np.random.default_rng(20)
    a = rng.standard_normal((6, 8)).astype(np.float32)
    t = pydiff.tensor(a, device=dev) * 3.0
    np.testing.assert_allclose(t[2].numpy(), a[2].astype(np.float64) * 3, rtol=1e-6)
    np.testing.assert_allclose(t[1:3].numpy(), a[1:3].astype(np.float64) * 3, rtol=1e-6)
    labels = rng.integers(-5, 5, 37).astype(np.int32)
    np.testing.assert_array_equal(pydiff.tensor(labels, device=dev).numpy(), labels)
    words = rng.integers(0, 2**31, 9).astype(np.uint32)
    np.testing.assert_array_equal(pydiff.tensor(words, device=dev).numpy(), words)


def test_small_reads_on_threads_each_see_their_own_work(dev):
    """Four threads read their own small results while the others queue work: the shared
    read-back buffer is used under the queue's lock, each read after its own work."""
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                x = rng.standard_normal(64).astype(np.float32)
                y = ops.relu(pydiff.tensor(x, device=dev) * 1.5)
                ref = np.maximum(x.astype(np.float64) * 1.5, 0)
                np.testing.assert_allclose(y.numpy(), ref, rtol=1e-6)
                assert y.sum().item() == pytest.approx(ref.sum(), rel=1e-4, abs=1e-5)
        except Exception as exc:  # (reported on the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(30 + k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


def test_loss_item_each_step_matches_torch_float64(dev):
    """``loss.item()`` after each eager step of the benchmarks' MLP (the waited step) reads
    that step's loss: against PyTorch in float64 on the same weights."""
    torch = pytest.importorskip("torch")
    from pydiff import nn, optim

    rng = np.random.default_rng(40)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 5, 32).astype(np.int32)
    layers = [nn.Linear(16, 16, seed=0, activation="relu"), nn.Linear(16, 5, seed=1)]
    params = [p for layer in layers for p in layer.parameters()]
    tparams = [torch.tensor(p.numpy(), dtype=torch.float64, requires_grad=True) for p in params]
    opt = optim.AdamW(params, lr=1e-2)
    topt = torch.optim.AdamW(tparams, lr=1e-2)
    xt, yt = pydiff.tensor(x, device=dev), pydiff.tensor(y, device=dev)
    tx, ty = torch.tensor(x, dtype=torch.float64), torch.tensor(y.astype(np.int64))
    for _ in range(4):
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xt)), yt)
        tape.backward(loss)
        opt.step()
        topt.zero_grad()
        w1, b1, w2, b2 = tparams
        tloss = torch.nn.functional.cross_entropy(torch.relu(tx @ w1.T + b1) @ w2.T + b2, ty)
        tloss.backward()
        topt.step()
        assert loss.item() == pytest.approx(tloss.item(), rel=1e-4)


def test_poll_wait_switch(dev):
    """PYDIFF_POLL_WAIT=0: no tracker, the blocking waits and reads (the same values);
    a value it does not take stops the import, naming the variable."""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, pydiff\n"
        "d = pydiff.default_device()\n"
        "assert d.queue.submits is None\n"
        "x = pydiff.tensor(np.arange(5, dtype=np.float32), device=d) * 2.0\n"
        "d.wait()\n"
        "print(x.sum().item())\n"
    )
    env = dict(os.environ, PYDIFF_POLL_WAIT="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) == 20.0
    env["PYDIFF_POLL_WAIT"] = "maybe"
    out = subprocess.run(
        [sys.executable, "-c", "import pydiff"], env=env, capture_output=True, text=True
    )
    assert out.returncode != 0 and "PYDIFF_POLL_WAIT" in out.stderr
