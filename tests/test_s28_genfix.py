"""The generated kernels' threshold and switch on every call, not only the first or the large
ones: a repeated forward call off a tape whose first tensor is a broadcast one-element tensor
stays on the generated path (its cached call plan once decided by that tensor's size), and a
mistyped ``PYDIFF_GENERATED`` raises in calls of any size, on the full path and on a plan's."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import generated

SOURCE = "[Differentiable] float s28_quad(float a, float x) { return a * x * x + x; }"
N = 256  # over the threshold the tests set (64), small enough to keep them fast


@pytest.fixture
def quad(device):
    return pydiff.load_module_from_source("s28_genfix", SOURCE, device=device).s28_quad


@pytest.fixture
def threshold(monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 64)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()


def _generated(kind: str) -> int:
    return generated.stats().get(kind, 0)


@pytest.mark.parametrize("coefficient", ["number", "(1,)", "()"])
def test_repeated_forward_with_a_broadcast_first_stays_generated(
    device, quad, threshold, coefficient
):
    x64 = np.linspace(-1.0, 1.0, N)
    x = pydiff.tensor(x64.astype(np.float32), device=device)
    a = {"number": 2.0, "(1,)": [2.0], "()": np.float32(2.0)}[coefficient]
    if coefficient != "number":
        a = pydiff.tensor(np.asarray(a, np.float32), device=device)
    given = pydiff.zeros((N,), device=device)
    for k in range(3):
        y = quad(a, x, _result="tensor")
        quad(a, x, _result=given)
        assert _generated("forward") == 2 * (k + 1), f"call {k + 1} left the generated path"
        want = 2.0 * x64.astype(np.float32).astype(np.float64) ** 2 + x64.astype(np.float32)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(given.numpy(), y.numpy())
    assert not any(k.startswith("declined") for k in generated.stats())


def test_small_repeated_calls_stay_on_slangpys_path(device, quad, threshold):
    x = pydiff.tensor(np.ones(16, np.float32), device=device)  # under the threshold
    for _ in range(3):
        quad(pydiff.tensor([2.0], device=device), x, _result="tensor")
    assert generated.stats() == {}  # never consulted the generator


@pytest.mark.parametrize("value", ["of", "2", "enable"])
def test_a_mistyped_switch_raises_in_small_calls(device, quad, threshold, monkeypatch, value):
    x16 = np.linspace(0.0, 1.0, 16, dtype=np.float32)
    x = pydiff.tensor(x16, device=device, requires_grad=True)
    up = pydiff.tensor(np.ones(16, np.float32), device=device)
    calls = {
        "forward": lambda: quad(2.0, x, _result="tensor"),
        "forward, numpy result": lambda: quad(2.0, x),
        ".bwds": lambda: quad.bwds(2.0, x, _result=up.with_grads(ones=True)),
        ".fwds": lambda: quad.fwds(2.0, x.detach().with_tangent(np.ones(16))),
    }
    for call in calls.values():  # twice each: the second one runs a cached call plan
        call()
        call()
    monkeypatch.setenv("PYDIFF_GENERATED", value)
    for name, call in calls.items():
        with pytest.raises(pydiff.EnvironmentSettingError, match=f"PYDIFF_GENERATED='{value}'"):
            call()
        with pytest.raises(pydiff.EnvironmentSettingError, match="PYDIFF_GENERATED"):
            call()  # (not remembered as taken: every call says so)
    monkeypatch.setenv("PYDIFF_GENERATED", " Off ")
    for call in calls.values():
        call()
    assert generated.stats() == {}


def test_the_switch_is_read_at_each_call(device, quad, threshold, monkeypatch):
    x = pydiff.tensor(np.ones(N, np.float32), device=device)
    monkeypatch.setenv("PYDIFF_GENERATED", "no")
    quad(2.0, x, _result="tensor")
    assert generated.stats()["declined: PYDIFF_GENERATED=0"] == 1
    monkeypatch.setenv("PYDIFF_GENERATED", "YES")
    quad(2.0, x, _result="tensor")
    assert _generated("forward") == 1
