"""Threads sharing one device (issue 15, class 8): each thread's gradients are its own. The
scratch buffers a backward writes and reads back (broadcast gradients, fixed-point words)
are per thread, and command batches are per thread. References are float64 closed forms
per thread."""

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
