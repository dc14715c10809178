"""The deferred list (pydiff.command_queue): pydiff's kernels issued outside a batch wait
unsubmitted until something needs their results. Each test below goes through one point that
must submit them first (a host read or write, a SlangPy call, a copy, the SlangPy objects
handed out, buffer reuse, a capture, another thread) and fails with a stale or overtaken
value if that flush is missing. References: NumPy in float64."""

import sys
import threading

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import command_queue, ops

RNG = np.random.default_rng(7)


def _vulkan(device):
    if device.type != "vulkan":
        pytest.skip("pydiff's float4 kernels with typed loads: the Vulkan fast path")


def _linear_ref(x, w, b=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if b is None else y + b


def _deferred_linear(device, rows=64, cols=16, out=8, alone=True):
    """A linear layer's output, still unsubmitted (unless another thread flushed: not
    ``alone``), with its inputs and the reference."""
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    w = RNG.standard_normal((out, cols)).astype(np.float32)
    xt, wt = pydiff.tensor(x, device=device), pydiff.tensor(w, device=device)
    y = ops.linear(xt, wt)
    if alone and command_queue.DEFER:  # (PYDIFF_DEFER=0 submits each command at once)
        assert device.queue.deferred, "the kernel should wait in the deferred list"
    return xt, wt, y, _linear_ref(x, w)


def test_forward_ops_wait_and_a_host_read_submits_them(device):
    _vulkan(device)
    device.flush()  # work an earlier test left deferred (test_call_plan's) is not this one's
    before = device.queue.submissions
    _, _, y, ref = _deferred_linear(device)
    h = ops.linear(y, pydiff.tensor(np.eye(8, dtype=np.float32), device=device))
    if command_queue.DEFER:  # the identity's small upload joined the list: nothing flushed
        assert device.queue.submissions == before
    np.testing.assert_allclose(h.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert not device.queue.deferred


def test_item_submits(device):
    _vulkan(device)
    x = RNG.standard_normal((32, 8)).astype(np.float32)
    labels = RNG.integers(0, 8, 32).astype(np.int32)
    loss = ops.cross_entropy(
        ops.linear(pydiff.tensor(x, device=device), pydiff.tensor(np.eye(8, dtype=np.float32))),
        pydiff.tensor(labels, device=device),
    )
    z = x.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    assert loss.item() == pytest.approx(np.mean(lse - z[np.arange(32), labels]), rel=1e-5)


def test_host_write_does_not_overtake_a_kernel_reading_the_old_values(device):
    _vulkan(device)
    xt, _, y, ref = _deferred_linear(device)
    xt.copy_from_numpy(np.zeros(xt.shape, np.float32))  # the kernel must read the old x
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_fill_and_upload_do_not_overtake(device):
    _vulkan(device)
    xt, _, y, ref = _deferred_linear(device)
    xt.fill(3.0)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_a_freed_buffer_is_not_reused_while_a_deferred_kernel_reads_it(device):
    """The deferred list holds its buffers: the pool must not hand x's buffer out as a new
    gradient buffer, which is zeroed at once (that clear would overtake the kernel)."""
    _vulkan(device)
    device.empty_cache()  # x's buffer is then the pool's only free one of its size
    xt, _, y, ref = _deferred_linear(device)
    later = [pydiff.empty(xt.shape, device=device) for _ in range(2)]
    del xt
    for t in later:
        t.requires_grad_(True)  # a zeroed gradient buffer of x's size
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    for t in later:
        np.testing.assert_array_equal(t.grad.numpy(), 0.0)


def test_slangpy_call_of_a_library_function_sees_the_results(device):
    _vulkan(device)
    _, _, y, ref = _deferred_linear(device)
    e = ops.exp(y)  # a SlangPy call (pydiff's library)
    np.testing.assert_allclose(e.numpy(), np.exp(ref), rtol=1e-4)


def test_user_function_call_and_bwds_see_the_results(device):
    _vulkan(device)
    m = pydiff.load_module_from_source(
        "deferred_user", "[Differentiable] float sq(float x) { return x * x; }", device=device
    )
    _, _, y, ref = _deferred_linear(device)
    # (float32 sums of 16 products against float64: near-zero outputs need an absolute bound)
    np.testing.assert_allclose(m.sq(y, _result="tensor").numpy(), ref**2, rtol=1e-4, atol=1e-6)
    _, _, y2, ref2 = _deferred_linear(device)
    y2.requires_grad_(True)
    out = m.sq(y2, _result="tensor").with_grads(ones=True)
    _, _, y3, ref3 = _deferred_linear(device)  # deferred again before .bwds
    y2.zero_grad()
    m.sq.bwds(y3.requires_grad_(True), _result=out)
    np.testing.assert_allclose(y3.grad.numpy(), 2 * ref3, rtol=1e-4, atol=1e-5)


def test_native_and_bind_hand_out_submitted_values(device):
    _vulkan(device)
    _, _, y, ref = _deferred_linear(device)
    np.testing.assert_allclose(y.native.to_numpy(), ref, rtol=1e-5, atol=1e-5)
    _, _, y2, ref2 = _deferred_linear(device)
    np.testing.assert_allclose(y2.bind().to_numpy(), ref2, rtol=1e-5, atol=1e-5)


def test_device_copy_and_clone_see_the_results(device):
    _vulkan(device)
    _, _, y, ref = _deferred_linear(device)
    np.testing.assert_allclose(y.clone().numpy(), ref, rtol=1e-5, atol=1e-5)
    _, _, y2, ref2 = _deferred_linear(device)
    dst = pydiff.zeros(y2.shape, device=device)
    np.testing.assert_allclose(dst.copy_(y2).numpy(), ref2, rtol=1e-5, atol=1e-5)


def test_zeroing_is_in_order_with_the_kernels(device):
    """zero_grad outside a batch is deferred too: after a kernel that wrote the buffer (as
    the optimizer's own zero_grad before the forward pass), before one that writes it."""
    _vulkan(device)
    xt, wt, y, ref = _deferred_linear(device)
    y.zero_()  # deferred after the kernel: zeros win
    np.testing.assert_array_equal(y.numpy(), 0.0)
    out = pydiff.empty((64, 8), device=device)
    out.zero_()
    from pydiff.products import fast_product

    assert fast_product("mm_nt", xt, wt, out, 1.0)  # out = out + x W^T: after the zeroing
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_optimizer_step_leaves_nothing_deferred(device):
    """A training step ends submitted: a device wait after opt.step() waits for its work."""
    _vulkan(device)
    layer = pydiff.nn.Linear(16, 8, seed=3)
    opt = pydiff.optim.SGD(layer.parameters(), lr=0.1)
    x = pydiff.tensor(RNG.standard_normal((64, 16)).astype(np.float32), device=device)
    opt.zero_grad()
    with pydiff.Tape() as tape:
        loss = ops.mse_loss(layer(x), pydiff.zeros((64, 8), device=device))
    tape.backward(loss)
    opt.step()
    assert not layer.weight.device.queue.deferred


def test_capture_after_deferred_work_replays_right(device):
    _vulkan(device)
    x = RNG.standard_normal((64, 16)).astype(np.float32)
    w = RNG.standard_normal((8, 16)).astype(np.float32)
    xt, wt = pydiff.tensor(x, device=device), pydiff.tensor(w, device=device)
    ops.linear(xt, wt)  # pending when the capture starts
    step = pydiff.capture(lambda: ops.linear(xt, wt))
    assert not device.queue.deferred
    xt.copy_from_numpy(2 * x)
    np.testing.assert_allclose(step.replay().numpy(), _linear_ref(2 * x, w), rtol=1e-5, atol=1e-4)


def test_another_thread_reads_what_this_thread_left_deferred(device):
    _vulkan(device)
    _, _, y, ref = _deferred_linear(device)
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("y", y.numpy()))
    reader.start()
    reader.join()
    np.testing.assert_allclose(got["y"], ref, rtol=1e-5, atol=1e-5)


def test_threads_appending_and_reading_at_once(device):
    _vulkan(device)
    errors = []

    def work(k):
        try:
            for _ in range(40):
                _, _, y, ref = _deferred_linear(device, rows=32 + 8 * k, alone=False)
                h = ops.linear(y, pydiff.tensor(np.eye(8, dtype=np.float32), device=device))
                np.testing.assert_allclose(h.numpy(), ref, rtol=1e-5, atol=1e-5)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: a thread may find the list being
    try:  # submitted by another, and must wait for that submission (not overtake it)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]


def test_a_long_run_without_reads_is_submitted_in_bounded_lists(device, monkeypatch):
    _vulkan(device)
    monkeypatch.setattr(command_queue, "DEFER_MAX", 8)
    device.flush()
    before = device.queue.submissions
    x = pydiff.tensor(RNG.standard_normal((16, 8)).astype(np.float32), device=device)
    w = pydiff.tensor(np.eye(8, dtype=np.float32), device=device)
    for _ in range(20):
        x = ops.linear(x, w)
    assert device.queue.submissions - before >= 2
    device.flush()


def test_device_native_and_wait_submit_first(device):
    """A wait through the SlangPy device (``dev.native.wait_for_idle()``, how benchmarks and
    user code wait) or ``dev.wait()`` must find pydiff's kernels submitted, or it returns at
    once while they have not run; raw reads of a buffer then see them done."""
    _vulkan(device)
    for wait in (lambda: device.native.wait_for_idle(), device.wait):
        _, _, y, ref = _deferred_linear(device)
        wait()
        assert not device.queue.deferred
        raw = y.buffer.to_numpy().view(np.float32)[: y.numel].reshape(y.shape)
        np.testing.assert_allclose(raw, ref, rtol=1e-5, atol=1e-5)


def test_library_module_submits_first(device):
    _vulkan(device)
    assert device.library is not None  # loaded before: its first load flushes by itself
    _, _, y, ref = _deferred_linear(device)
    # A SlangPy tensor on y's buffer made without pydiff (no flush on the way).
    raw = spy.Tensor(y.buffer, device.dtype("float"), list(y.shape), [y.shape[1], 1], 0)
    out = device.library.op_exp(raw, _result="tensor")
    np.testing.assert_allclose(out.to_numpy(), np.exp(ref), rtol=1e-4)


def test_another_threads_submission_takes_an_open_batch_along(device, monkeypatch):
    """Where batches are swept (every backend but Vulkan; forced on here): a thread's open
    batch, holding a recorded kernel, is submitted by another thread's flush, after the
    deferred list, and the batch's owner goes on in a new encoder with its order kept: the
    values read afterwards are the float64 references."""
    monkeypatch.setattr(device.queue, "sweep_batches", True)
    x = RNG.standard_normal((16, 8)).astype(np.float32)
    w = RNG.standard_normal((4, 8)).astype(np.float32)
    xt, wt = pydiff.tensor(x, device=device), pydiff.tensor(w, device=device)
    recorded, swept = threading.Event(), threading.Event()
    out = {}

    def owner():
        token = device.queue.begin_batch()
        try:
            y = ops.linear(xt, wt)  # recorded into this thread's batch
            recorded.set()
            swept.wait(10)
            out["taken"] = not device.queue.pending  # the other thread submitted it
            out["z"] = ops.linear(y, pydiff.tensor(np.eye(4, dtype=np.float32), device=device))
        finally:
            device.queue.end_batch(token)
        out["y"] = y.numpy()

    t = threading.Thread(target=owner)
    t.start()
    recorded.wait(10)
    assert device.queue.open_batches, "the owner's batch should be open, with its kernel"
    device.queue.flush()  # this thread's flush: the owner's batch goes too
    assert not device.queue.open_batches
    swept.set()
    t.join()
    assert out["taken"]
    np.testing.assert_allclose(out["y"], _linear_ref(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["z"].numpy(), _linear_ref(x, w), rtol=1e-5, atol=1e-5)
    assert not device.queue.open_batches


class _HeldSubmissions:
    """The device's native device, but a submission made by the thread ``hold`` names waits
    (up to 0.5 s) for ``release`` first: a slow submission, or a thread switch inside it."""

    def __init__(self, native):
        self._native, self.hold, self.entered = native, None, threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._native, name)

    def _wait(self):
        if threading.get_ident() == self.hold:
            self.entered.set()
            self.release.wait(0.5)

    def submit_command_buffer(self, buffer):
        self._wait()
        return self._native.submit_command_buffer(buffer)

    def submit_command_buffers(self, buffers):
        self._wait()
        return self._native.submit_command_buffers(buffers)


def test_a_batchs_owner_waits_for_the_sweep_that_took_it(device, monkeypatch):
    """Another thread's submission has taken this thread's batch (a zeroing) and not yet
    submitted it: the owner's flush must wait for that submission before the owner goes on,
    else a read through SlangPy (``native.to_numpy()``) overtakes the zeroing and sees the
    old values. It did: the sweep emptied the batch and the set of open batches before
    submitting, so the owner's flush found nothing pending and returned at once."""
    monkeypatch.setattr(device.queue, "sweep_batches", True)
    held = _HeldSubmissions(device.queue.native)
    y = pydiff.tensor(np.ones(64, np.float32), device=device)
    y.numpy()
    monkeypatch.setattr(device.queue, "native", held)
    recorded, out = threading.Event(), {}

    def owner():
        token = device.queue.begin_batch()
        try:
            y.zero_()  # recorded into this thread's batch
            recorded.set()
            held.entered.wait(10)  # the sweeper is inside its submission, with the zeroing
            device.queue.flush()
            out["read"] = y.native.to_numpy()
            held.release.set()
        finally:
            device.queue.end_batch(token)

    def sweeper():
        held.hold = threading.get_ident()
        recorded.wait(10)
        device.queue.flush_deferred()  # takes the owner's open batch along

    threads = [threading.Thread(target=owner), threading.Thread(target=sweeper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert held.entered.is_set(), "the sweeper should have taken the owner's batch"
    np.testing.assert_array_equal(out["read"], np.zeros(64, np.float32))
    assert not device.queue.open_batches and not device.queue.deferred


def test_only_vulkan_leaves_other_threads_batches_alone(device, monkeypatch):
    monkeypatch.delenv("PYDIFF_SWEEP_BATCHES", raising=False)
    queue = command_queue.CommandQueue(device.native)
    assert queue.sweep_batches is (device.type != "vulkan")
    monkeypatch.setenv("PYDIFF_SWEEP_BATCHES", "1")
    assert command_queue.CommandQueue(device.native).sweep_batches
