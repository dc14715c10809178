"""Session 47 (capfix): a capture made while another thread's garbage collection is under
way. ``gc.collect()`` does nothing then, and the reference cycles that collection is freeing
still hold the step's input: the replay's count of references to it fell once they were
freed, and a replay of an unchanged step was refused (test_threads_stress, 1 run in ~15).
Reference: the SGD update computed with float64 NumPy."""

from __future__ import annotations

import gc
import threading

import numpy as np

import pydiff
from pydiff import ops


class _BlocksItsFinalizer:
    """Garbage whose finalizer waits: the collection freeing it stays under way meanwhile."""

    def __init__(self, started: threading.Event, release: threading.Event, held):
        self.started, self.release, self.held = started, release, held
        self.cycle = self

    def __del__(self):
        self.started.set()
        self.release.wait(10)


def test_a_capture_during_another_threads_collection_replays(device):
    rng = np.random.default_rng(3)
    X = rng.standard_normal((6, 4)).astype(np.float32)
    W = (0.3 * rng.standard_normal((3, 4))).astype(np.float32)
    labels = rng.integers(0, 3, 6)
    xb = pydiff.tensor(X, device=device)
    lb = pydiff.tensor(labels.astype(np.int32), dtype="int", device=device)
    w = pydiff.tensor(W, device=device, requires_grad=True)
    opt = pydiff.optim.SGD([w], lr=0.5)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(ops.linear(xb, w), lb)
        tape.backward(loss)
        opt.step()
        return loss

    step()  # (SGD makes its state eagerly)
    started, release = threading.Event(), threading.Event()
    _BlocksItsFinalizer(started, release, [xb, xb, xb])  # a cycle holding the input, garbage
    collector = threading.Thread(target=gc.collect, daemon=True)
    gc.disable()  # (no automatic collection frees it first)
    try:
        collector.start()
        assert started.wait(10)  # the other thread's collection is under way
        threading.Timer(0.2, release.set).start()
        captured = pydiff.capture(step)
    finally:
        release.set()
        collector.join(10)
        gc.enable()
    gc.collect()
    for _ in range(3):
        captured.replay()  # refused before: "the tensor it read was dropped"
    Wf, Xf = W.astype(np.float64), X.astype(np.float64)
    for _ in range(5):  # softmax cross-entropy's gradient: (softmax - one-hot) / batch
        Z = Xf @ Wf.T
        S = np.exp(Z - Z.max(1, keepdims=True))
        S /= S.sum(1, keepdims=True)
        S[np.arange(6), labels] -= 1
        Wf = Wf - 0.5 * (S.T @ Xf) / 6
    np.testing.assert_allclose(w.numpy(), Wf, rtol=1e-4, atol=1e-5)
