"""The fused forward + backward on a tape (generated_hold, on by default) leaves nothing
behind: no command held in the queue, its tensors freed once the caller lets them go, and
a held forward never backed-through is recorded by the next use of the queue."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_hold

SOURCE = """
import slangpy;
[Differentiable] float s50_poly(float a, float b, float x) { return a * x * x + b * x + sin(x); }
"""

_n = iter(range(10**6))


@pytest.fixture
def m(device, monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(generated_hold, "HOLD_FORWARD", True)
    return pydiff.load_module_from_source(f"s50_fuse50_{next(_n)}", SOURCE, device=device)


def _closed(x, g):
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    return 1.5 * x64**2 - 0.5 * x64 + np.sin(x64), g64 * (3.0 * x64 - 0.5 + np.cos(x64))


def test_hold_forward_is_on_by_default():
    assert generated_hold.HOLD_FORWARD is True


def test_fused_step_leaves_nothing_held_and_its_tensors_freed(device, m):
    rng = np.random.default_rng(50)
    xs = rng.uniform(-2, 2, 3000).astype(np.float32)
    g = rng.uniform(-1, 1, 3000).astype(np.float32)
    generated.reset_stats()
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.s50_poly(1.5, -0.5, x)
    tape.backward(y, grad=g)
    assert generated.stats().get("forward+backward fused") == 1, generated.stats()
    assert device.queue.held is None
    want_y, want_dx = _closed(xs, g)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)
    refs = [weakref.ref(t) for t in (x, y, tape)]
    del x, y, tape
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_held_forward_without_backward_is_recorded_by_the_next_use(device, m):
    xs = np.linspace(-2, 2, 3000, dtype=np.float32)
    generated.reset_stats()
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape():
        y = m.s50_poly(1.5, -0.5, x)
    assert device.queue.held is not None  # held for a backward that never comes
    device.flush()  # any use of the queue records it, as issued
    assert device.queue.held is None
    assert generated.stats().get("forward") == 1, generated.stats()
    np.testing.assert_allclose(y.numpy(), _closed(xs, xs)[0], rtol=1e-5, atol=1e-5)
