"""Breaker tests of issue 16's deferred work, call plans, held objects and buffer pool (s33,
defer33). Every expected value comes from float64 NumPy or a closed form.

Bug found (fails until fixed):
- ``test_pool_buffer_freed_inside_another_threads_backward_is_not_handed_out``: a buffer
  made by one thread (its pool) and read by a kernel recorded in another thread's open
  backward batch is handed out again by the first thread's pool as soon as the last tensor
  on it is gone; the first thread's write then runs before the other thread's batch is
  submitted (Vulkan does not sweep other threads' batches), so the backward reads the new
  tensor's values: a silently wrong gradient.

The other tests are attacks that found nothing, kept as cheap regressions.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_switch, ops

SOURCE = """
[Differentiable] float s33_poly(float a, float b, float x) { return a * x * x + b * x; }
[Differentiable] float s33_root(float a, float x) { return a * sqrt(x); }
"""


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s33_defer33", SOURCE, device=device)


@pytest.fixture
def soon(monkeypatch):
    """Plans switch to generated kernels at their third call (1000 by default)."""
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER", 2)
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER_ON_GPU", 2)
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 4096)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()


# --- the bug ----------------------------------------------------------------------------


def test_pool_buffer_freed_inside_another_threads_backward_is_not_handed_out(device):
    n = 16
    handed: dict = {}
    freed, written = threading.Event(), threading.Event()

    class FromOtherThread(pydiff.Function):
        """d y / d x = the values of a tensor another thread made (3.0 each)."""

        @staticmethod
        def forward(ctx, x):
            return ops.mul(x, 1.0)

        @staticmethod
        def backward(ctx, g):
            t = handed.pop("t")
            out = ops.relu(t)  # a pydiff kernel recorded in this thread's backward batch
            del t  # the last reference: the buffer goes back to the other thread's pool
            freed.set()
            written.wait(30)
            return out

    result: dict = {}

    def trainer() -> None:
        try:
            x = pydiff.tensor(np.ones(n, np.float32), device=device, requires_grad=True)
            with pydiff.Tape() as tape:
                y = FromOtherThread.apply(x)
            tape.backward(y, grad=np.ones(n, np.float32))
            result["grad"] = x.grad.numpy()
        except BaseException as exc:  # reported by the main thread
            result["error"] = exc
            freed.set()

    t = pydiff.tensor(np.full(n, 3.0, np.float32), device=device)  # this thread's pool
    handed["t"] = t
    del t
    worker = threading.Thread(target=trainer)
    worker.start()
    try:
        assert freed.wait(30)
        gc.collect()
        # A new tensor of the same size, written from the host, while the other thread's
        # backward still holds its recorded (unsubmitted) kernel reading the freed buffer.
        other = pydiff.tensor(np.full(n, 100.0, np.float32), device=device)
    finally:
        written.set()
        worker.join(60)
    assert "error" not in result, result.get("error")
    np.testing.assert_array_equal(result["grad"], np.full(n, 3.0))
    np.testing.assert_array_equal(other.numpy(), np.full(n, 100.0))


# --- attacks that found nothing (regressions) -------------------------------------------


def _poly64(a: float, b: float, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = float(np.float32(a)), float(np.float32(b))
    x = x.astype(np.float64)
    return a * x * x + b * x, 2 * a * x + b


@pytest.mark.parametrize("n", [5, 16])
def test_every_call_across_the_switch_with_changing_numbers_and_data(device, mod, soon, n):
    """Forward and .bwds checked at every call before and after the switch to generated
    kernels, while the numbers change (-0.0, ints, a denormal, NaN then finite) and the
    tensor's data is replaced from the host or the tensor itself is replaced."""
    rng = np.random.default_rng(3)
    xs = rng.standard_normal(n).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device).with_grads(ones=True)
    numbers = [(1.5, 0.5), (1.5, -0.0), (2, 0), (-0.0, 0.0), (1e-40, 1), (3.0, 0.5)]
    numbers += [(2.0, float("nan")), (2.0, 0.25), (1.5, 0.5), (1.5, 0.5)]
    acc = np.zeros(n)
    for k, (a, b) in enumerate(numbers * 2):
        if k % 5 == 3:
            xs = rng.standard_normal(n).astype(np.float32)
            x.copy_from_numpy(xs)
        if k % 7 == 6:
            del x
            gc.collect()
            xs = rng.standard_normal(n).astype(np.float32)
            x = pydiff.tensor(xs, device=device, requires_grad=True)
            acc[:] = 0
        want, dwant = _poly64(a, b, xs)
        mod.s33_poly(a, b, x, _result=y)
        np.testing.assert_allclose(y.numpy(), want, rtol=2e-6, atol=1e-6)
        mod.s33_poly.bwds(a, b, x, _result=y)
        acc = acc + dwant
        np.testing.assert_allclose(x.grad.numpy(), acc, rtol=1e-5, atol=1e-5)
        if np.isnan(b):
            acc[:] = 0
            x.zero_grad()
    assert generated.stats().get("forward", 0) > 0 and generated.stats().get("backward", 0) > 0


def test_deferred_results_through_every_exit(device, mod, soon):
    """Values a generated call left in the deferred list, read through each way out."""
    torch = pytest.importorskip("torch")
    n = 16
    xs = np.linspace(-1, 1, n).astype(np.float32)
    want, _ = _poly64(2.0, -1.0, xs)
    x = pydiff.tensor(xs, device=device)
    reads = {
        "numpy": lambda t: t.numpy(),
        "to_torch": lambda t: pydiff.to_torch(t).numpy(),
        "torch.from_dlpack": lambda t: torch.from_dlpack(t).numpy(),
        "np.from_dlpack": lambda t: np.from_dlpack(t),
        "from_dlpack": lambda t: pydiff.from_dlpack(t).numpy(),
        "clone": lambda t: t.clone().numpy(),
        "copy_": lambda t: pydiff.zeros((n,), device=device).copy_(t).numpy(),
        "native": lambda t: t.native.to_numpy(),
        "iteration": lambda t: np.array([float(v) for v in t]),
    }
    for name, read in reads.items():
        for _ in range(4):  # past the switch: the last ones are generated and deferred
            y = mod.s33_poly(2.0, -1.0, x, _result="tensor")
        np.testing.assert_allclose(
            np.asarray(read(y), np.float64), want, rtol=2e-6, atol=1e-6, err_msg=name
        )


def test_padding_lanes_written_by_a_generated_forward_stay_out_of_reductions(device, mod):
    """A generated forward writes whole float4s: on a reused buffer the lanes past the
    tensor's end hold f(garbage) (NaN here); no consumer may read them."""
    n = 5
    old = pydiff.tensor(-np.ones(8, np.float32), device=device)  # the same 2 float4s
    del old
    gc.collect()
    x = pydiff.tensor(np.arange(1, n + 1, dtype=np.float32), device=device)
    r = np.sqrt(np.arange(1, n + 1, dtype=np.float64))
    y = generated.forward(mod.s33_root, [1.0, x], None)
    assert y is not None
    np.testing.assert_allclose(float(ops.sum(y)), r.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(y @ y), r @ r, rtol=1e-6)
    np.testing.assert_allclose(
        ops.linear(y.reshape(1, n), pydiff.ones((3, n), device=device)).numpy(),
        np.full((1, 3), r.sum()),
        rtol=1e-6,
    )
    labels = pydiff.tensor(np.array([2]), dtype="int", device=device)
    np.testing.assert_allclose(
        float(ops.cross_entropy(y.reshape(1, n), labels)),
        np.log(np.exp(r).sum()) - r[2],
        rtol=1e-5,
    )
