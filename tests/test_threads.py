"""Threads sharing one device (issue 15, class 8): each thread's gradients are its own. The
scratch buffers a backward writes and reads back (broadcast gradients, fixed-point words)
are per thread, and command batches are per thread. References are float64 closed forms
per thread."""

import sys
import threading

import numpy as np
import pytest

import pydiff

SOURCE = """
import pydiff;
[Differentiable] float gather_first(FwdDiffTensor<1> w, float x) { return w.load({0}) * x; }
[Differentiable] float3 shift3(float3 b, float3 x) { return x * b + b; }
[Differentiable] float scaled(float a, float x) { return a * x * x; }
[Differentiable] float sq(float x) { return x * x; }
"""
THREADS, ROUNDS = 4, 6


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("threads", SOURCE, device=device)


def _run_threads(work):
    errors = []

    def guarded(k):
        try:
            work(k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((k, exc))

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(THREADS)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: races show up in a few rounds
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_broadcast_gradients_of_concurrent_bwds_stay_per_thread(device, m, deterministic):
    n = 257

    def work(k):
        X = np.linspace(-1.0, 1.0, n) * (k + 1)
        for r in range(ROUNDS):
            a = pydiff.tensor([float(k + 1)], device=device, requires_grad=True)
            x = pydiff.tensor(X, device=device)
            y = pydiff.zeros((n,), device=device).with_grads(ones=True)
            if deterministic:
                with pydiff.deterministic():
                    m.scaled.bwds(a, x, _result=y)
            else:
                m.scaled.bwds(a, x, _result=y)
            got = a.grad.numpy()[0]
            want = np.sum(X**2)
            assert abs(got - want) <= 1e-4 * want, (k, r, got, want)

    _run_threads(work)


def test_concurrent_tapes(device, m):
    def work(k):
        X = np.arange(1.0, 6.0) + k
        for _ in range(ROUNDS):
            a = pydiff.tensor([0.5 * (k + 1)], device=device, requires_grad=True)
            x = pydiff.tensor(X, device=device, requires_grad=True)
            with pydiff.Tape() as tape:
                y = m.scaled(a, x, _result="tensor")  # a x^2 (a broadcast)
                z = m.sq(y, _result="tensor")  # a^2 x^4
            tape.backward(z, grad=np.ones(5))
            A = 0.5 * (k + 1)
            np.testing.assert_allclose(a.grad.numpy(), [np.sum(2 * A * X**4)], rtol=1e-5)
            np.testing.assert_allclose(x.grad.numpy(), 4 * A**2 * X**3, rtol=1e-5)

    _run_threads(work)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_fixed_point_gradients_of_concurrent_bwds_stay_per_thread(device, m, deterministic):
    """FwdDiffTensor gradients: the int64 words are per-thread scratch."""
    n = 300

    def work(k):
        X = np.linspace(0.0, 1.0, n) + k
        for r in range(ROUNDS):
            w = pydiff.tensor([1.0], device=device, requires_grad=True)
            y = pydiff.empty((n,), device=device).with_grads(ones=True)
            if deterministic:
                with pydiff.deterministic():
                    m.gather_first.bwds(w, pydiff.tensor(X, device=device), _result=y)
            else:
                m.gather_first.bwds(w, pydiff.tensor(X, device=device), _result=y)
            np.testing.assert_allclose(w.grad.numpy(), [np.sum(X)], rtol=1e-6, err_msg=(k, r))

    _run_threads(work)


def test_float3_broadcast_and_ops_concurrently(device, m):
    """Vector broadcast sums (per-thread scratch) and ops on a tape (per-thread buffer pool,
    shared kernels under a lock) from several threads, each against float64 NumPy."""

    def work(k):
        rng = np.random.default_rng(k)
        for r in range(ROUNDS):
            X = rng.standard_normal((65, 3))
            b = pydiff.tensor([[1.0, 2.0, 3.0]], dtype="float3", device=device, requires_grad=True)
            y = pydiff.zeros((65,), dtype="float3", device=device).with_grads(ones=True)
            m.shift3.bwds(b, pydiff.tensor(X, dtype="float3", device=device), _result=y)
            np.testing.assert_allclose(b.grad.numpy(), [(X + 1).sum(0)], rtol=1e-5, atol=1e-5)
            A = rng.standard_normal((9, 6)).astype(np.float32)
            W = rng.standard_normal((4, 6)).astype(np.float32)
            x = pydiff.tensor(A, device=device)
            w = pydiff.tensor(W, device=device, requires_grad=True)
            with pydiff.Tape() as tape:
                loss = pydiff.ops.sum(pydiff.ops.linear(x, w))
            tape.backward(loss)
            want = np.ones((9, 4)).T @ A.astype(np.float64)  # d sum(x W^T) / dW
            np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5, atol=1e-5)

    _run_threads(work)


MIXED_SOURCE = """
import pydiff;
[Differentiable] float3 shift3(float3 b, float3 x) { return x * b + b; }
[Differentiable] float ramp(int i, float a) { return a * float(i % 17) * 0.125; }
[Differentiable] float gather_first(FwdDiffTensor<1> w, float x) { return w.load({0}) * x; }
"""


def _mixed_step(mm, device, X):
    """One thread's work, every kind of scratch buffer: a float tensor for a float3 parameter
    (element axes), a spy.call_id call, fixed-point words, and a tape over ops."""
    import slangpy as spy

    n = X.shape[0]
    out = {}
    b = pydiff.tensor([[1.0, 2.0, 3.0]], device=device, requires_grad=True)
    y = pydiff.zeros((n, 3), device=device).with_grads(ones=True)
    mm.shift3.bwds(b, pydiff.tensor(X, device=device), _result=y)
    out["b"] = b.grad.numpy()
    a = pydiff.tensor([1.0], device=device, requires_grad=True)
    mm.ramp.bwds(spy.call_id(), a, _result=pydiff.zeros((n,), device=device).with_grads(ones=True))
    out["a"] = a.grad.numpy()
    w = pydiff.tensor([0.0], device=device, requires_grad=True)
    yw = pydiff.empty((n,), device=device).with_grads(ones=True)
    mm.gather_first.bwds(w, pydiff.tensor(X[:, 0], device=device), _result=yw)
    out["w"] = w.grad.numpy()
    x = pydiff.tensor(X, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        loss = pydiff.ops.sum(pydiff.ops.mul(x, x))
    tape.backward(loss)
    out["x"] = x.grad.numpy()
    return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_threads_repeat_the_single_threaded_bits(device, deterministic):
    """Each thread runs its own inputs: it must get bitwise the gradients the same work gave
    run alone, one thread at a time (any sharing of scratch, pooled buffers or batches
    between threads shows up as a difference), and they match float64 NumPy. pydiff's sums
    are ordered in both modes, so the bits repeat in both."""
    mm = pydiff.load_module_from_source("threads_mixed", MIXED_SOURCE, device=device)
    inputs = [
        np.random.default_rng(11 + k).standard_normal((203, 3)).astype(np.float32) * (k + 1)
        for k in range(THREADS)
    ]
    refs = []
    for k, X in enumerate(inputs):
        with pydiff.deterministic(deterministic):
            ref = _mixed_step(mm, device, X)
        X64 = X.astype(np.float64)
        np.testing.assert_allclose(ref["b"], [(X64 + 1).sum(0)], rtol=1e-6, atol=1e-4)
        want_a = sum((i % 17) * 0.125 for i in range(203))
        np.testing.assert_allclose(ref["a"], [want_a], rtol=1e-7)
        np.testing.assert_allclose(ref["w"], [X64[:, 0].sum()], rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(ref["x"], 2 * X64, rtol=1e-7)
        refs.append(ref)

    def work(k):
        for r in range(ROUNDS):
            with pydiff.deterministic(deterministic):
                got = _mixed_step(mm, device, inputs[k])
            for name in refs[k]:
                assert got[name].tobytes() == refs[k][name].tobytes(), (k, r, name)

    _run_threads(work)


def test_device_memo_under_concurrent_eviction(device, monkeypatch):
    """device.cached from several threads while its bound evicts keys: every call returns the
    value made for its key (no KeyError from a lookup racing an eviction)."""
    import pydiff.device_state as device_state

    monkeypatch.setattr(device_state, "CACHED_MAX_ITEMS", 8)
    dev = device_state.Device(device.native, device.type)

    def work(k):
        for i in range(3000):
            key = ("threads-test", (i * 7 + k) % 40)
            assert dev.cached(key, lambda key=key: key) == key

    _run_threads(work)


def test_a_bool_read_while_a_memo_makes_tensors_does_not_deadlock(device):
    """Lock order: the device's lock (``device.cached`` held it around ``make()``; since s51
    its build lock) comes
    before the queue's (``make()`` creating a tensor: ``pydiff.zeros`` clears it under the
    queue's lock). Reading a bool tensor looked up its word dtype (``device.dtype``: the
    device's lock, the first time) while holding the queue's lock: one thread in each
    waited for the other for ever."""
    import time

    import pydiff.device as device_module

    dev = device_module.Device(device.native, device.type)  # no word dtype looked up yet
    flags = pydiff.tensor(np.array([True, False, True]), device=dev)
    holding, reading, out = threading.Event(), threading.Event(), {}

    def memo():
        def make():
            holding.set()
            reading.wait(10)
            time.sleep(0.2)  # the reader holds the queue's lock, waiting for the device's
            return pydiff.zeros((4,), device=dev)

        out["zeros"] = dev.cached(("threads-test", "lock order"), make).numpy()

    def read():
        holding.wait(10)
        reading.set()
        out["flags"] = flags.numpy()

    threads = [threading.Thread(target=f, daemon=True) for f in (memo, read)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "the two threads deadlocked"
    np.testing.assert_array_equal(out["flags"], [True, False, True])
    np.testing.assert_array_equal(out["zeros"], np.zeros(4))


OPEN_AT_ONCE = r"""
import threading
import pydiff
got, errors = [], []
start = threading.Barrier(6)
def work():
    try:
        start.wait()
        got.append(pydiff.create_device("vulkan"))
        got.append(pydiff.device.default_device())
    except BaseException as exc:
        errors.append(exc)
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
assert len({id(d) for d in got}) == 1, got
assert len(pydiff.device.open_devices()) == 1
print("ok")
"""


def test_threads_opening_the_device_at_once_get_one_device(device, tmp_path):
    """Two threads opening the default device at once must not make two devices (tensors of
    the one would be refused by calls on the other). In a fresh process."""
    if device.type != "vulkan":
        pytest.skip("opens a vulkan device")
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYDIFF_DEVICE": "vulkan"}
    proc = subprocess.run(
        [sys.executable, "-c", OPEN_AT_ONCE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_threads_taking_grads_at_once_get_their_own_values(device):
    """Four threads each taking ``value_and_grad`` of (s x).sum()^2 in a loop: every value
    and gradient against the closed form. On CUDA (an H200) 1 in 30 came back wrong (values
    0, gradients scaled) while backward passes recorded uploads into their batches without
    the queue's lock; serialised, or one thread alone, none did."""
    vg = pydiff.value_and_grad(lambda s, x: (s * x).sum() ** 2)
    xs = np.array([1.0, 2.0, 3.0], np.float32)
    bad: list = []

    def work(i: int) -> None:
        try:
            for _ in range(10):
                s = float(i) + 0.5
                x = pydiff.tensor(xs, device=device)
                v, g = vg(pydiff.tensor(np.array(s, np.float32), device=device), x)
                v, g = float(v.numpy()), float(g.numpy())
                if not (np.isclose(v, 36 * s * s, rtol=1e-5) and np.isclose(g, 72 * s, rtol=1e-5)):
                    bad.append((s, v, g))
        except Exception as exc:  # noqa: BLE001 (reported below, with the thread's values)
            bad.append(repr(exc))

    for _ in range(8):
        _run_threads(work)
    assert not bad, bad[:5]
