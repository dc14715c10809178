"""A large call without ``_result`` takes the generated kernel, as ``_result="tensor"`` does.

``y = m.f(a, b, x)`` is how users call a function; it went through SlangPy's generic kernel
(2^24 floats: 240 ms against 20 ms with ``_result="tensor"`` on lavapipe) although SlangPy
returns a new tensor of the call's shape there too. Values are checked against float64 NumPy,
the gradient on a tape against the closed form, and the result's kind against SlangPy's
path (``PYDIFF_GENERATED=0``).
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import generated

SOURCE = """
[Differentiable]
float poly(float a, float b, float x) { return a * x * x + b * x - 1.0; }
float constant(float a) { return a + 1.0; }
"""
N = 8192 + 4  # past generated.MIN_ELEMENTS (4096)


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s33_plain_call", SOURCE, device=device)


def _forward_count() -> int:
    return generated.stats().get("forward", 0)


def test_a_large_plain_call_takes_the_generated_kernel(mod, device):
    xs = np.linspace(-2.0, 3.0, N, dtype=np.float32)
    x = pydiff.tensor(xs, device=device)
    before = _forward_count()
    y = mod.poly(2.0, -0.5, x)
    assert _forward_count() == before + 1  # (SlangPy's path before: not counted)
    assert type(y) is pydiff.Tensor and y.shape == (N,) and y.dtype == "float"
    x64 = xs.astype(np.float64)
    np.testing.assert_allclose(y.numpy(), 2.0 * x64 * x64 - 0.5 * x64 - 1.0, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(y.numpy(), mod.poly(2.0, -0.5, x, _result="tensor").numpy())


def test_the_same_result_as_slangpys_path(mod, device, monkeypatch):
    xs = np.random.default_rng(2).standard_normal(N).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    a = pydiff.tensor(np.array([1.5], np.float32), device=device)  # broadcast over the call
    fast = mod.poly(a, 0.25, x)
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    slow = mod.poly(a, 0.25, x)
    assert type(fast) is type(slow) and fast.shape == slow.shape and fast.dtype == slow.dtype
    np.testing.assert_array_equal(fast.numpy(), slow.numpy())


def test_a_plain_call_on_a_tape_gives_the_closed_form_gradient(mod, device):
    xs = np.linspace(-1.0, 1.0, N, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)

    def generated_forwards() -> int:  # alone, or fused with the backward (generated_hold)
        counts = generated.stats()
        return counts.get("forward", 0) + counts.get("forward+backward fused", 0)

    before = generated_forwards()
    with pydiff.Tape() as tape:
        y = mod.poly(3.0, 2.0, x)
    tape.backward(y, grad=pydiff.tensor(np.ones(N, np.float32), device=device))
    assert generated_forwards() == before + 1
    expected = 6.0 * xs.astype(np.float64) + 2.0  # (float32 rounding of 6x near x = -1/3)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_calls_whose_default_result_is_not_a_new_tensor_keep_it(mod, device, monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)  # every covered call, as --force
    assert mod.constant(2.0) == pytest.approx(3.0)  # numbers only: a number back
    x0 = pydiff.tensor(np.float32(0.5), device=device)  # 0-d: a 0-d result
    y0 = mod.poly(1.0, 1.0, x0)
    assert np.shape(y0) == () and float(np.asarray(y0.numpy() if hasattr(y0, "numpy") else y0)) == (
        pytest.approx(-0.25)
    )
