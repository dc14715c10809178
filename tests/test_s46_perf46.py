"""With ``PYDIFF_WAIT_SPIN=1`` (``command_queue.WAIT_SPIN``), ``Device.wait()`` polls the
queue's last submission (yielding the CPU between polls) for up to ``WAIT_SPIN_S`` before it
blocks in SlangPy's ``wait_for_idle`` (twenty-sixth session, helper ``perf46``: a blocked wait
is woken late on a 2-vCPU VM); off by default. Each test checks the wait against SlangPy's own
submission query and the values against float64 NumPy; the poll is bounded, and with the
switch off the wait blocks at once.
"""

import time

import numpy as np
import pytest

import pydiff
from pydiff import command_queue, ops


class _Native:
    """Stands for a queue's SlangPy device: counts ``is_submit_finished`` calls, and may answer
    False whatever the device says (a submission that never reports finished)."""

    def __init__(self, native, never: bool = False):
        self._native = native
        self.never = never
        self.polls = 0

    def __getattr__(self, name):
        return getattr(self._native, name)

    def is_submit_finished(self, submission):
        self.polls += 1
        return False if self.never else self._native.is_submit_finished(submission)


def _values(device, n=1 << 20, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    ta, tb = pydiff.tensor(a, device=device), pydiff.tensor(b, device=device)
    return a, b, ops.add(ops.mul(ta, tb), ta)


@pytest.mark.parametrize("spin", [True, False])
def test_wait_leaves_the_last_submission_finished(device, monkeypatch, spin):
    monkeypatch.setattr(command_queue, "WAIT_SPIN", spin)
    a, b, out = _values(device)
    queue = device.queue
    before = queue.submissions
    device.wait()
    assert queue.submissions > before  # (the op's deferred kernel was submitted by the wait)
    assert isinstance(queue.last_submission, int)
    assert device.native.is_submit_finished(queue.last_submission)  # SlangPy's own answer
    ref = a.astype(np.float64) * b + a
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-6)


def test_wait_polls_a_bounded_time_then_blocks(device, monkeypatch):
    queue = device.queue
    fake = _Native(queue.native, never=True)
    monkeypatch.setattr(queue, "native", fake)
    monkeypatch.setattr(command_queue, "WAIT_SPIN", True)
    monkeypatch.setattr(command_queue, "WAIT_SPIN_S", 0.01)
    a, b, out = _values(device, seed=1)
    t0 = time.perf_counter()
    device.wait()
    took = time.perf_counter() - t0
    assert fake.polls >= 1
    assert took < 5.0  # (the poll gives up after WAIT_SPIN_S; the block then returns)
    assert device.native.is_submit_finished(queue.last_submission)
    np.testing.assert_allclose(out.numpy(), a.astype(np.float64) * b + a, rtol=1e-6, atol=1e-6)


def test_wait_spin_off_blocks_at_once(device, monkeypatch):
    queue = device.queue
    fake = _Native(queue.native)
    monkeypatch.setattr(queue, "native", fake)
    monkeypatch.setattr(command_queue, "WAIT_SPIN", False)
    a, b, out = _values(device, seed=2)
    device.wait()
    assert fake.polls == 0
    assert device.native.is_submit_finished(queue.last_submission)
    np.testing.assert_allclose(out.numpy(), a.astype(np.float64) * b + a, rtol=1e-6, atol=1e-6)


def test_wait_on_a_queue_that_never_submitted(device, monkeypatch):
    # (no submission id yet: no poll, the block alone; nothing pending is fine)
    queue = device.queue
    fake = _Native(queue.native)
    monkeypatch.setattr(queue, "native", fake)
    monkeypatch.setattr(command_queue, "WAIT_SPIN", True)
    monkeypatch.setattr(queue, "last_submission", None)
    device.flush()
    monkeypatch.setattr(queue, "last_submission", None)
    device.wait()
    assert fake.polls == 0


def test_mlp_step_gradients_unchanged_by_the_wait(device, monkeypatch):
    # The same two steps with the poll on and off: parameters bit-identical, and the first
    # step's weight gradients against float64 NumPy.
    from pydiff import nn, optim

    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = rng.integers(0, 3, 32).astype(np.int32)
    results = []
    for spin in (True, False):
        monkeypatch.setattr(command_queue, "WAIT_SPIN", spin)
        xb, yb = pydiff.tensor(x, device=device), pydiff.tensor(y, device=device)
        layer = nn.Linear(8, 3, seed=0, device=device)
        opt = optim.AdamW(layer.parameters(), lr=1e-2)
        grads = None
        for _ in range(2):
            opt.zero_grad()
            with pydiff.Tape() as tape:
                loss = ops.cross_entropy(layer(xb), yb)
            tape.backward(loss)
            if grads is None:
                grads = layer.weight.grad.numpy().copy()
                w0 = layer.weight.numpy().astype(np.float64)
                b0 = layer.bias.numpy().astype(np.float64)
            opt.step()
            device.wait()
        results.append((layer.weight.numpy(), layer.bias.numpy()))
        # float64 reference of the first step's dW: softmax(xW^T + b) - onehot, over the batch
        z = x.astype(np.float64) @ w0.T + b0
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(32), y] -= 1.0
        np.testing.assert_allclose(grads, (p / 32).T @ x, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def _child(code: str, value: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYDIFF_WAIT_SPIN": value, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )


def test_wait_spin_switch_read_at_import():
    code = "from pydiff import command_queue as q; print(q.WAIT_SPIN)"
    assert _child(code, "").stdout.strip() == "False"  # (the default)
    assert _child(code, "0").stdout.strip() == "False"
    assert _child(code, "on").stdout.strip() == "True"
    bad = _child(code, "sometimes")
    assert bad.returncode != 0 and "PYDIFF_WAIT_SPIN" in bad.stderr
