"""Call plans that dispatch generated kernels themselves (planned_kernels): a small layout
called ``PLANNED_AFTER`` times, and every large covered one, runs pydiff's generated kernel
without the full path and without a submission of its own. Values and gradients against
float64 closed forms, before and after the switch of path; the switch honoured when changed
in place; values read back in order after deferred calls; views and shared gradient buffers
fall back or group as the full path does; threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import slangpy as spy

import pydiff
from pydiff import generated, generated_switch
from pydiff.tensor import Tensor

SOURCE = """
[Differentiable] float s30_quad(float a, float x) { return a * x * x + x; }
[Differentiable] float s30_mul(float x, float y) { return x * y + sin(x); }
"""
N = 16


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s30_planned", SOURCE, device=device)


def _count(kind: str) -> int:
    return generated.stats().get(kind, 0)


def _planned(calls: int) -> int:
    """Generated calls among ``calls`` of one layout: the first makes the plan, whose first
    three runs stay on SlangPy's path."""
    return max(0, calls - 1 - 3)


def _quad64(a: float, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = x.astype(np.float64)
    return a * x * x + x, 2 * a * x + 1


def test_small_calls_switch_to_generated_kernels_with_the_same_values(device, mod, soon):
    xs = np.linspace(-2, 2, N).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((N,), device=device).with_grads(ones=True)
    want, dwant = _quad64(1.5, xs)
    for k in range(8):
        out = mod.s30_quad(1.5, x, _result=y)
        assert out is y
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-6)
        mod.s30_quad.bwds(1.5, x, _result=y)
        np.testing.assert_allclose(x.grad.numpy(), (k + 1) * dwant, rtol=1e-5, atol=1e-5)
    assert _count("forward") == _planned(8) and _count("backward") == _planned(8)
    fresh = [mod.s30_quad(1.5, x, _result="tensor") for _ in range(5)]
    for t in fresh:  # the "tensor" result: a new tensor each call
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-6, atol=1e-6)
    assert len({id(t.storage) for t in fresh}) == 5


def test_planned_generated_calls_join_the_deferred_list(device, mod, soon):
    x = pydiff.tensor(np.ones(N, np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((N,), device=device).with_grads(ones=True)
    for _ in range(4):
        mod.s30_quad(2.0, x, _result=y)
        mod.s30_quad.bwds(2.0, x, _result=y)
    device.queue.flush()
    before = device.queue.submissions
    for _ in range(20):
        mod.s30_quad(2.0, x, _result=y)
        mod.s30_quad.bwds(2.0, x, _result=y)
    assert device.queue.submissions - before <= 1  # (none of their own; DEFER_MAX may)
    np.testing.assert_allclose(y.numpy(), 3.0)  # the read submits them, in order
    np.testing.assert_allclose(x.grad.numpy(), 24 * 5.0)


def test_the_switch_changed_in_place_is_honoured(device, mod, soon, monkeypatch):
    monkeypatch.setenv("PYDIFF_GENERATED", "1")
    x = pydiff.tensor(np.ones(N, np.float32), device=device)
    y = pydiff.zeros((N,), device=device)
    for _ in range(6):
        mod.s30_quad(2.0, x, _result=y)
    assert _count("forward") == _planned(6)
    monkeypatch.setenv("PYDIFF_GENERATED", "0")  # (the environment keeps its size)
    for _ in range(3):
        mod.s30_quad(2.0, x, _result=y)
    assert _count("forward") == _planned(6)
    monkeypatch.setenv("PYDIFF_GENERATED", "of")
    with pytest.raises(pydiff.EnvironmentSettingError, match="PYDIFF_GENERATED"):
        mod.s30_quad(2.0, x, _result=y)


def test_a_result_not_float4_storage_falls_back_and_is_right(device, mod, soon):
    xs = np.linspace(-1, 1, N).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    for _ in range(6):
        mod.s30_quad(2.0, x, _result=pydiff.zeros((N,), device=device))
    assert _count("forward") == _planned(6)
    base = pydiff.zeros((N + 1,), device=device)
    native = base.native
    shifted = spy.Tensor(native.storage, native.dtype, (N,), (1,), 1)  # offset 1: not float4
    out = Tensor(shifted, device, storage=base.storage)
    assert out.layout == x.layout  # the plan's layout, other storage
    mod.s30_quad(2.0, x, _result=out)
    np.testing.assert_allclose(base.numpy()[1:], _quad64(2.0, xs)[0], rtol=1e-6, atol=1e-6)
    assert base.numpy()[0] == 0.0
    assert _count("forward") == _planned(6)  # SlangPy's path wrote it


def test_a_gradient_buffer_shared_by_two_parameters(device, mod, soon):
    xs = np.linspace(-1, 1, N).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((N,), device=device).with_grads(ones=True)
    x64 = xs.astype(np.float64)
    for k in range(6):  # d/dx (x * x + sin x) with both parameters x: 2x + cos x
        mod.s30_mul.bwds(x, x, _result=y)
        np.testing.assert_allclose(
            x.grad.numpy(), (k + 1) * (2 * x64 + np.cos(x64)), rtol=1e-5, atol=1e-5
        )
    assert _count("backward") == _planned(6)


def test_two_tensors_then_swapped_gradient_buffers(device, mod, soon):
    xs, ys = np.linspace(-1, 1, N), np.linspace(2, 3, N)
    x = pydiff.tensor(xs.astype(np.float32), device=device, requires_grad=True)
    w = pydiff.tensor(ys.astype(np.float32), device=device, requires_grad=True)
    up = pydiff.zeros((N,), device=device).with_grads(ones=True)
    for _ in range(5):
        mod.s30_mul.bwds(x, w, _result=up)
    x64, w64 = xs.astype(np.float32).astype(np.float64), ys.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), 5 * (w64 + np.cos(x64)), rtol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), 5 * x64, rtol=1e-5, atol=1e-6)
    shared = pydiff.zeros((N,), device=device)
    x2, w2 = x.detach().with_grads(shared, shared), w.detach().with_grads(shared, shared)
    assert _count("backward") == _planned(5)
    mod.s30_mul.bwds(x2, w2, _result=up)  # one buffer for both: another kernel of this plan
    assert _count("backward") == _planned(5) + 1
    np.testing.assert_allclose(shared.numpy(), w64 + np.cos(x64) + x64, rtol=1e-5)


def test_threads_each_with_their_own_tensors(device, mod, soon):
    errors: list = []

    def work(seed: int) -> None:
        try:
            xs = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
            x = pydiff.tensor(xs, device=device, requires_grad=True)
            y = pydiff.zeros((N,), device=device).with_grads(ones=True)
            for _ in range(30):
                mod.s30_quad(0.5, x, _result=y)
                mod.s30_quad.bwds(0.5, x, _result=y)
            want, dwant = _quad64(0.5, xs)
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(x.grad.numpy(), 30 * dwant, rtol=1e-4, atol=1e-4)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_fresh_result_keeps_its_backward_layout_when_the_forward_switches(device, mod, soon):
    """SlangPy's results and pydiff's carry different reflection objects of ``float``: the
    layout keys scalar types by name, so the ``.bwds`` of a fresh result keeps its plan (and
    its count) when the forward call starts making its results itself (breaker G3)."""
    xs = np.linspace(-1, 1, N).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    first = None
    for k in range(12):
        y = mod.s30_quad(0.5, x, _result="tensor")
        before = _count("backward")
        mod.s30_quad.bwds(0.5, x, _result=y.with_grads(ones=True))
        if first is None and _count("backward") > before:
            first = k + 1
    assert first == 5  # the plan's fourth run (the first call made it)
    np.testing.assert_allclose(x.grad.numpy(), 12 * _quad64(0.5, xs)[1], rtol=1e-5, atol=1e-5)
    made = mod.s30_quad(0.5, pydiff.zeros((N,), device=device), _result="tensor")
    assert made.layout == pydiff.zeros((N,), device=device).layout


def test_small_plans_keep_slangpys_call_on_a_gpu_unless_asked():
    # measured on an H200 (CUDA, 2026-11-27): the planned dispatch cost 17.4 us against
    # SlangPy's 12.2 (forward) and 25.0 against 14.0 (.bwds) at 16 elements
    class Adapter:
        def __init__(self, name):
            self.adapter_name = name

    lavapipe = Adapter("llvmpipe (LLVM 15.0.6, 256 bits)")
    assert generated.planned_after(lavapipe) == generated_switch.PLANNED_AFTER
    if "PYDIFF_GENERATED_PLANNED_AFTER" not in __import__("os").environ:
        assert generated.planned_after(Adapter("NVIDIA H200")) == generated_switch.NEVER
