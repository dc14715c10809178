"""Threads sharing one device (issue 15, class 8): each thread's gradients are its own. The
scratch buffers a backward writes and reads back (broadcast gradients, fixed-point words)
are per thread, and command batches are per thread. References are float64 closed forms
per thread."""

import threading

import numpy as np
import pytest

import pydiff

SOURCE = """
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
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
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
