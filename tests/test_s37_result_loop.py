"""A loop making a new small result per call (``y = f(x)``, how users write it): its results
pinned by the deferred list until it is submitted must not make the pool create a buffer per
call (buffer_pool._per_size), and the generated kernel's bound object, rebound to each new
buffer (kernels: the held object's changed buffers), must leave every result right against
NumPy's float64 values, across submissions and with inputs changing too."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_switch
from pydiff.command_queue import DEFER_MAX

SOURCE = "[Differentiable] float s37_poly(float a, float b, float x) { return a * x * x + b; }"
N = 16


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s37_loop", SOURCE, device=device)


@pytest.fixture
def soon(monkeypatch):
    """Plans switch to generated kernels at their second call (on every backend)."""
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER", 1)
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER_ON_GPU", 1)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()


def _want(a: float, b: float, xs: np.ndarray) -> np.ndarray:
    x = xs.astype(np.float64)
    return a * x * x + b


@pytest.mark.parametrize("planned", ["generated", "slangpy"])
def test_new_results_in_a_loop_reuse_pooled_buffers(device, mod, monkeypatch, planned):
    if planned == "generated":
        monkeypatch.setattr(generated_switch, "PLANNED_AFTER", 1)
        monkeypatch.setattr(generated_switch, "PLANNED_AFTER_ON_GPU", 1)
    else:
        monkeypatch.setenv("PYDIFF_GENERATED", "0")
    xs = np.linspace(-1, 1, N).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    for _ in range(DEFER_MAX + 40):  # the pool fills once
        mod.s37_poly(2.0, 0.5, x)
    device.queue.flush()
    made = []
    allocated = device.queue.allocated
    monkeypatch.setattr(device.queue, "allocated", lambda n: (made.append(n), allocated(n)))
    for _ in range(3 * DEFER_MAX):
        y = mod.s37_poly(2.0, 0.5, x)
    monkeypatch.undo()
    assert len(made) <= 4, f"{len(made)} buffers created in {3 * DEFER_MAX} calls"
    np.testing.assert_allclose(y.numpy(), _want(2.0, 0.5, xs), rtol=1e-6, atol=1e-6)


def test_results_kept_and_dropped_are_each_right(device, mod, soon):
    rng = np.random.default_rng(37)
    inputs = [rng.standard_normal(N).astype(np.float32) for _ in range(7)]
    xs = [pydiff.tensor(a, device=device) for a in inputs]
    kept = []
    # more calls than the deferred list holds: several submissions, the object rebound to a
    # new result (and to another input) at every call, numbers changing too
    for i in range(2 * DEFER_MAX + 37):
        a, b = float(i % 5) - 2.0, 0.25 * (i % 3)
        y = mod.s37_poly(a, b, xs[i % 7])
        if i % 9 == 0:
            kept.append((y, a, b, i % 7))
    assert generated.stats().get("forward", 0) > 0
    for y, a, b, k in kept:
        np.testing.assert_allclose(y.numpy(), _want(a, b, inputs[k]), rtol=1e-6, atol=1e-6)


def test_gradients_of_new_results_in_a_loop(device, mod, soon):
    xs = np.linspace(-2, 2, N).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    calls = DEFER_MAX + 11
    for i in range(calls):
        y = mod.s37_poly(1.5, -0.5, x).with_grads(ones=True)
        mod.s37_poly.bwds(1.5, -0.5, x, _result=y)
    want = calls * 2 * 1.5 * xs.astype(np.float64)  # d/dx of a x^2 + b, added per call
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-4)
