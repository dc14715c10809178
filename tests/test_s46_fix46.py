"""Session 46 (fix46): eviction of kernels keeps the plans of the others; races of grid
calls reading neighbours of a tensor they write; captured inputs re-bound while a retained
tape keeps the old ones; forward-mode tangents of Python-number primals. References: float64
NumPy, closed forms and central differences, never pydiff's own output."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pydiff
from pydiff import kernels as kernels_module
from pydiff import ops


def _matmul_checked(device, m, k, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = ops.matmul(pydiff.tensor(a, device=device), pydiff.tensor(b, device=device)).numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def _plans_of(device, n):
    """The product plans of (40, 12, n) products (their kernel's N define is n)."""
    return {
        key: plan
        for key, plan in device.kernels.plans.items()
        if plan and key[:5] == ("product", "mm_nn", 40, n, 12)
    }


def test_eviction_drops_only_the_evicted_kernels_plans(device, monkeypatch):
    monkeypatch.setattr(kernels_module, "KERNELS_MAX", 3)
    kernels = device.kernels
    kernels.plans.clear()
    built: list = []
    real = kernels._build  # noqa: SLF001 (counting the cache's own builds)

    def build(file, entry, defines):
        built.append(defines.get("N"))
        return real(file, entry, defines)

    monkeypatch.setattr(kernels, "_build", build)
    _matmul_checked(device, 40, 12, 4, 0)
    first = _plans_of(device, 4)
    assert first
    for seed, n in enumerate((8, 12)):  # two more kernels: the cache is full, none evicted
        _matmul_checked(device, 40, 12, n, 1 + seed)
    _matmul_checked(device, 40, 12, 4, 3)  # the first one used again: the most recent
    kept = _plans_of(device, 4)
    assert kept == first and all(kept[k] is first[k] for k in kept)
    before = len(built)
    _matmul_checked(device, 40, 12, 16, 4)  # a new kernel evicts N=8's (the oldest), only it
    assert len(built) == before + 1
    survivors = _plans_of(device, 4)
    assert survivors and all(survivors[k] is first[k] for k in survivors)  # (not planned again)
    assert _plans_of(device, 12) and not _plans_of(device, 8)
    held = {plan[0] for plan in kernels.plans.values() if plan}
    assert held <= set(kernels._kernels)  # noqa: SLF001 (no plan outlives its kernel)
    _matmul_checked(device, 40, 12, 8, 5)  # planned and built again, still right
    assert built[-1] == 8 and _plans_of(device, 8)
    _matmul_checked(device, 40, 12, 4, 6)
    assert kernels.sizes()["kernels"] <= 3


# ---------------------------------------------------------------- captured inputs re-bound


def _sgd_reference(w0, b0, xs, ys, lr):
    """float64 SGD steps of mean cross-entropy(x @ w.T + b, y) over the batches (closed-form
    gradient: (softmax - one-hot) / B)."""
    w, b = w0.astype(np.float64), b0.astype(np.float64)
    for x, y in zip(xs, ys):
        z = x.astype(np.float64) @ w.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        dz = p / len(y)
        w, b = w - lr * dz.T @ x.astype(np.float64), b - lr * dz.sum(axis=0)
    return w, b


@pytest.mark.parametrize("retain", [True, False])
def test_replay_refuses_a_rebound_input_while_the_retained_tape_keeps_the_old(device, retain):
    """``tape.backward(loss, retain_graph=True)`` (the default) inside a captured step keeps
    the tape, and so the old input tensor, alive through the loss the step returns: the
    replay's check of dropped inputs used to pass, and the replay trained on the captured
    batch without a word. Refused now; copying into the captured tensor stays right."""
    rng = np.random.default_rng(7)
    layer = pydiff.nn.Linear(8, 4, seed=3, device=device)
    w0, b0 = layer.weight.numpy(), layer.bias.numpy()
    opt = pydiff.optim.SGD([layer.weight, layer.bias], lr=0.5)
    state: dict = {}
    xs: list = []
    ys: list = []

    def new_batch():
        x = rng.standard_normal((16, 8)).astype(np.float32)
        y = rng.integers(0, 4, 16).astype(np.int32)
        state["x"], state["y"] = pydiff.tensor(x, device=device), pydiff.tensor(y, device=device)
        return x, y

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layer(state["x"]), state["y"])
        tape.backward(loss, retain_graph=retain)
        opt.step()
        return loss

    def check():
        w, b = _sgd_reference(w0, b0, xs, ys, 0.5)
        np.testing.assert_allclose(layer.weight.numpy(), w, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(layer.bias.numpy(), b, rtol=1e-4, atol=1e-5)

    for k in range(2):  # eager, then the capture (each on its batch)
        x, y = new_batch()
        xs.append(x), ys.append(y)
        step() if k == 0 else (captured := pydiff.capture(step))
    check()
    x, y = new_batch()  # the names re-bound: a replay would read the captured batch
    gc.collect()
    with pytest.raises(pydiff.CaptureError, match="dropped|re-bound"):
        captured.replay()
    check()  # refused before anything ran
    captured = pydiff.capture(step)  # capturing again works
    xs.append(x), ys.append(y)
    check()
    x = rng.standard_normal((16, 8)).astype(np.float32)  # the supported way: copied in
    y = rng.integers(0, 4, 16).astype(np.int32)
    state["x"].copy_from_numpy(x)
    state["y"].copy_from_numpy(y)
    captured.replay()
    xs.append(x), ys.append(y)
    check()


# ---------------------------------------------------------------- forward mode: number primals

FWD_SRC = """
import slangpy;
[Differentiable] float f(float a, float x) { return a * x * x + sin(a * x); }
"""


def _f(a, x):
    return a * x * x + np.sin(a * x)


@pytest.fixture
def fwd_module(device):
    return pydiff.load_module_from_source("s46_fwd", FWD_SRC, device=device)


def test_number_primal_takes_one_direction_whatever_the_tangents_type(device, fwd_module):
    """The directional derivative of f(a, x) along a number a is (df/da) * da with one da:
    the tangent lives in a's space, shape (). A (5,) tangent (one direction per call
    element) is the derivative of another function (a copied per element): NumPy arrays
    were refused, pydiff tensors of that shape broadcast; both refused now, naming 'a'."""
    xs = np.linspace(-1.5, 2.0, 5).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    a0, da, eps = 1.3, 0.7, 1e-6
    x64 = xs.astype(np.float64)
    want = da * (_f(a0 + eps, x64) - _f(a0 - eps, x64)) / (2 * eps)  # central differences
    for tangent in (da, np.float32(da), pydiff.tensor(np.float32(da), device=device)):
        y, dy = fwd_module.f.fwds((a0, tangent), x)
        np.testing.assert_allclose(y.numpy(), _f(a0, x64), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dy.numpy(), want, rtol=1e-4, atol=1e-5)
    for tangent in (np.full(5, da, np.float32), pydiff.tensor(np.full(5, da, np.float32))):
        with pytest.raises(ValueError, match=r"parameter 'a'.*tangent has shape \(5,\).*\(\)"):
            fwd_module.f.fwds((a0, tangent), x)
    # one direction per element: a tensor as the value, its tangent of its shape
    dirs = np.linspace(0.5, -0.5, 5)
    a = pydiff.tensor(np.full(5, a0, np.float32), device=device)
    _, dy = fwd_module.f.fwds((a, pydiff.tensor(dirs.astype(np.float32), device=device)), x)
    want = dirs * (_f(a0 + eps, x64) - _f(a0 - eps, x64)) / (2 * eps)
    np.testing.assert_allclose(dy.numpy(), want, rtol=1e-4, atol=1e-5)
