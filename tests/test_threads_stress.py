"""Threads at once over everything that batches, defers or submits GPU work: tapes over ops,
``value_and_grad``, ``.bwds`` on a broadcast parameter (accumulated, zeroed, deterministic),
a custom Function whose backward calls module functions and waits for a thread taking
gradients of its own, AdamW and SGD steps, a captured step and its replays, and one thread
reading the others' finished tensors. Run with other threads' batches swept (CUDA's default,
forced here), swept with submissions that let other threads run (a driver that releases the
GIL, or a thread switch in the submission), and not swept (Vulkan's default). Every value is
checked against float64 NumPy closed forms. Each kind of work runs once on this thread
first, so that the threads' run is not the first use of the kernels (their builds, ~20 s of
CPU, serialised: on a loaded machine no thread finished anything for 30-48 s). A hung thread
fails the test: no work item finished for ``STALL_S`` seconds (not a fixed total: on a loaded
machine a passing run takes several times its 13-17 s alone), with every thread's stack."""

import queue
import sys
import threading
import time
import traceback

import numpy as np
import pytest

import pydiff
from pydiff import ops, optim

THREADS, ROUNDS = 8, 3
# Seconds without any work item finished (a worker's kind of work, or a read) that count as a
# hang; one item takes ~0.1 s of a quiet machine's time.
STALL_S = 60
SOURCE = """
import pydiff;
[Differentiable] float scaled(float a, float x) { return a * x * x; }
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float twice_mul(float x, float g) { return 2.0 * x * g; }
[Differentiable] float gather_first(FwdDiffTensor<1> w, float x) { return w.load({0}) * x; }
"""
VG = pydiff.value_and_grad(lambda s, x: (s * x).sum() ** 2)  # 36 s^2 and 72 s at x = 1, 2, 3


def _close(got, want, what):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4, err_msg=what
    )


def _stacks() -> str:
    """Every live thread's stack, by name: where a hung test stuck."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def _join(threads, progress):
    """Wait for ``threads`` to end, or until ``progress`` has not grown for ``STALL_S``."""
    seen, since = len(progress), time.monotonic()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.5)
            if len(progress) != seen:
                seen, since = len(progress), time.monotonic()
        if time.monotonic() - since > STALL_S:
            return


def _value_and_grad(device, s):
    x = pydiff.tensor(np.array([1.0, 2.0, 3.0], np.float32), device=device)
    v, g = VG(pydiff.tensor(np.array(s, np.float32), device=device), x)
    _close([v.numpy(), g.numpy()], [36 * s * s, 72 * s], "value_and_grad")


class _SlowSubmissions:
    """The native device, its submissions letting other threads run first."""

    def __init__(self, native):
        self._native = native

    def __getattr__(self, name):
        return getattr(self._native, name)

    def submit_command_buffer(self, buffer):
        time.sleep(2e-4)
        return self._native.submit_command_buffer(buffer)

    def submit_command_buffers(self, buffers):
        time.sleep(2e-4)
        return self._native.submit_command_buffers(buffers)


def _work(device, m, publish):
    """One thread's kinds of work, each checking its own values."""
    f32 = lambda a: np.asarray(a, np.float32).astype(np.float64)  # noqa: E731

    class Square(pydiff.Function):  # backward: module calls, after a thread of its own
        flush_before_backward = False  # (its batch stays open while it waits)

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return m.sq(x, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            failed: list = []

            def helper():
                try:
                    _value_and_grad(device, 1.5)
                except BaseException as exc:  # noqa: BLE001 - raised in the backward
                    failed.append(exc)

            thread = threading.Thread(target=helper)
            thread.start()
            thread.join(60)
            assert not thread.is_alive(), "the backward's helper thread hung"
            if failed:
                raise failed[0]
            return m.twice_mul(ctx.saved_tensors[0], g, _result="tensor")

    def tape_ops(k, rng):
        X, W = rng.standard_normal((6, 4)), rng.standard_normal((3, 4))
        x = pydiff.tensor(X, device=device, requires_grad=True)
        w = pydiff.tensor(W, device=device, requires_grad=True)
        with pydiff.deterministic(bool(k % 2)), pydiff.Tape() as tape:
            y = ops.linear(x, w)
            loss = ops.sum(ops.mul(y, y))
        tape.backward(loss)
        Y = f32(X) @ f32(W).T
        publish(w.grad, 2 * Y.T @ f32(X))
        _close(loss.numpy(), np.sum(Y * Y), "tape loss")
        _close(x.grad.numpy(), 2 * Y @ f32(W), "tape x.grad")

    def bwds(k, rng):
        X = np.linspace(-1.0, 1.0, 129) * (k + 1)
        a = pydiff.tensor([k + 1.0], device=device, requires_grad=True)
        x = pydiff.tensor(X, device=device)
        y = pydiff.zeros((129,), device=device).with_grads(ones=True)
        want = np.sum(f32(X) ** 2)
        with pydiff.deterministic(bool(rng.integers(2))):
            for total in (1, 2):  # accumulates
                m.scaled.bwds(a, x, _result=y)
                _close(a.grad.numpy(), [total * want], "bwds broadcast")
            a.zero_grad()
            m.scaled.bwds(a, x, _result=y)
            publish(a.grad, [want])
            w = pydiff.tensor([0.0], device=device, requires_grad=True)
            m.gather_first.bwds(
                w, x, _result=pydiff.empty((129,), device=device).with_grads(ones=True)
            )
        _close(w.grad.numpy(), [f32(X).sum()], "fixed-point gather")

    def custom(k, rng):
        X = rng.standard_normal(17)
        x = pydiff.tensor(X, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = Square.apply(x)
            loss = ops.sum(ops.mul(y, y))
        tape.backward(loss)
        _close(x.grad.numpy(), 4 * f32(X) ** 3, "custom Function")

    def optimizer(k, rng):
        P, T = f32(rng.standard_normal(37)), f32(rng.standard_normal(37))
        p = pydiff.tensor(P, device=device, requires_grad=True)
        t = pydiff.tensor(T, device=device)
        adamw = bool(k % 2)
        opt = optim.AdamW([p], lr=0.05, weight_decay=0.01) if adamw else optim.SGD([p], 0.1, 0.9)
        m1, m2 = np.zeros(37), np.zeros(37)
        for step in range(1, 4):
            opt.zero_grad()
            with pydiff.Tape() as tape:
                d = ops.sub(p, t)
                loss = ops.sum(ops.mul(d, d))
            tape.backward(loss)
            opt.step()
            G = 2 * (P - T)
            if adamw:  # torch.optim.AdamW's rule
                P = P * (1 - 0.05 * 0.01)
                m1, m2 = 0.9 * m1 + 0.1 * G, 0.999 * m2 + 0.001 * G * G
                P = P - 0.05 / (1 - 0.9**step) * m1 / (np.sqrt(m2 / (1 - 0.999**step)) + 1e-8)
            else:  # SGD with momentum 0.9
                m1 = G if step == 1 else 0.9 * m1 + G
                P = P - 0.1 * m1
        publish(p, P)

    def captured(k, rng):
        X, W = rng.standard_normal((8, 4)), 0.1 * rng.standard_normal((3, 4))
        labels = rng.integers(0, 3, 8)
        xb = pydiff.tensor(X, device=device)
        lb = pydiff.tensor(labels.astype(np.int32), dtype="int", device=device)
        w = pydiff.tensor(W, device=device, requires_grad=True)
        opt = optim.SGD([w], lr=0.5)

        def step():
            opt.zero_grad()
            with pydiff.Tape() as tape:
                loss = ops.cross_entropy(ops.linear(xb, w), lb)
            tape.backward(loss)
            opt.step()
            return loss

        step()
        cap = pydiff.capture(step)
        for _ in range(3):
            cap.replay()
        W, X = f32(W), f32(X)
        for _ in range(5):  # softmax cross-entropy's gradient: (softmax - one-hot) / batch
            Z = X @ W.T
            S = np.exp(Z - Z.max(1, keepdims=True))
            S /= S.sum(1, keepdims=True)
            loss = -np.mean(np.log(S[np.arange(8), labels]))
            S[np.arange(8), labels] -= 1
            W = W - 0.5 * (S.T @ X) / 8
        publish(w, W)
        _close(cap.result.numpy(), loss, "captured loss")

    kinds = [tape_ops, bwds, custom, optimizer, captured]
    kinds.append(lambda k, rng: _value_and_grad(device, k + 0.5))
    if device.type != "vulkan":  # captures record pydiff's kernels of a Vulkan device
        kinds.remove(captured)
    return kinds


@pytest.mark.parametrize(
    "sweep,slow", [(True, False), (True, True), (False, False)], ids=["swept", "swept-slow", "off"]
)
def test_threads_at_once_over_every_kind_of_work(device, monkeypatch, sweep, slow):
    monkeypatch.setattr(device.queue, "sweep_batches", sweep)
    if slow:
        monkeypatch.setattr(device.queue, "native", _SlowSubmissions(device.queue.native))
    m = pydiff.load_module_from_source("threads_stress", SOURCE, device=device)
    finished: queue.Queue = queue.Queue()
    kinds = _work(device, m, lambda t, want: finished.put((t, want)))
    for k in (0, 1):  # every kernel built (both branches of each kind) before the threads
        rng = np.random.default_rng(k)
        for kind in _work(device, m, lambda t, want: _close(t.numpy(), want, "warm-up")):
            kind(k, rng)
    errors, done, reads = [], threading.Event(), []

    progress: list = []  # work items finished, by any thread (a hang: none for STALL_S)

    def worker(k):
        rng = np.random.default_rng(k)
        try:
            for _ in range(ROUNDS):
                for i in rng.permutation(len(kinds)):
                    kinds[i](k, rng)
                    progress.append(k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((k, exc))

    def reader():  # another thread's finished tensors, read here first
        while not (done.is_set() and finished.empty()):
            try:
                t, want = finished.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                _close(t.numpy(), want, "read by another thread")
                reads.append(1)
                progress.append("reader")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(("reader", exc))

    threads = [
        threading.Thread(target=worker, args=(k,), name=f"worker-{k}", daemon=True)
        for k in range(THREADS)
    ]
    looking = threading.Thread(target=reader, name="reader", daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: races show up in a few rounds
    try:
        looking.start()
        for t in threads:
            t.start()
        _join(threads, progress)
        done.set()
        _join([looking], progress)
        hung = [t.name for t in [*threads, looking] if t.is_alive()]
        stacks = _stacks() if hung else ""  # taken while they are still stuck
    finally:
        sys.setswitchinterval(interval)
    assert not hung, f"no work item finished for {STALL_S} s, threads hung: {hung}\n{stacks}"
    assert not errors, errors[:3]
    assert len(reads) == THREADS * ROUNDS * (len(kinds) - 2)  # all but custom, value_and_grad
    assert not device.queue.open_batches
