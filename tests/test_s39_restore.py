"""A ``.bwds`` whose store counts (pydiff.written_mask) refuse the call leaves no trace: the
counts are read after the backward kernel ran, so pydiff keeps copies of the gradient buffers
that kernel adds into (on the device, before the kernel and any zeroing policy) and puts them
back before raising. Every gradient buffer (the inputs', the upstream's, an in-place
tensor's) must hold bitwise what it held before, under each zeroing policy and inside a tape's
backward, and the buffers' bookkeeping (versions, STRICT's marks) must be as before."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated
from pydiff.backward_scope import shared_pass

SOURCE = """import slangpy;
// Threads 2k and 2k+1 both store y[k]: a race in the forward.
[Differentiable]
void halve(int idx, IDiffTensor<float, 1> x, IDiffTensor<float, 1> w, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx / 2] = w[idx] * v * v; }
// The last thread stores one past the end.
[Differentiable]
void past(int idx, IDiffTensor<float, 1> x, IDiffTensor<float, 1> w, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx + 1] = w[idx] * v * v; }
// Every thread stores its own element: no refusal (the same kernel shape, counted).
[Differentiable]
void shift(int idx, IDiffTensor<float, 1> x, IDiffTensor<float, 1> w, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[(idx + 1) % int(y.shape[0])] = w[idx] * v * v; }
// In place: threads 2k and 2k+1 both scale y[k].
[Differentiable]
void scale_halve(int idx, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> y)
{ int k = idx / 2; float v = x[idx]; float before = y[k]; y[k] = before * v; }
"""
_names = itertools.count()
SMALL, LARGE = 16, 8192  # (LARGE: past MIN_ELEMENTS, the generated grid kernel)


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source(f"s39_restore_{next(_names)}", SOURCE, device=device)


def _filled(device, values: np.ndarray) -> pydiff.Tensor:
    """A tensor whose gradient buffer holds known, nonzero values (not a backward's result)."""
    t = pydiff.tensor(np.linspace(0.5, 1.5, values.size).astype(np.float32), device=device)
    t = t.with_grads(zero=True)
    t.grad.copy_from_numpy(values)
    return t


def _known(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-3.0, 3.0, n).astype(np.float32)


def _state(*tensors: pydiff.Tensor) -> list:
    """The gradient buffers' values and bookkeeping."""
    out = []
    for t in tensors:
        for g in {id(t.grad_in): t.grad_in, id(t.grad_out): t.grad_out}.values():
            s = g.storage
            out.append((g.numpy().tobytes(), s.version, s.last_writer, s.holds_result_of))
    return out


def _call(mod, name: str, n: int, device, seed: int = 0):
    x = _filled(device, _known(n, seed))
    w = _filled(device, _known(n, seed + 1))
    m = n // 2 if name == "halve" else n
    y = pydiff.zeros((m,), device=device).with_grads(zero=True)
    y.grad.copy_from_numpy(_known(m, seed + 2))
    return x, w, y


MESSAGES = {"halve": r"element \(\d+,\) was stored 2 times", "past": "outside the tensor"}


@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("name", ["halve", "past"])
@pytest.mark.parametrize("policy", ["accumulate", "reset", "strict"])
def test_a_refused_call_leaves_the_gradients_as_they_were(device, mod, name, policy, n):
    x, w, y = _call(mod, name, n, device)
    before = _state(x, w, y)
    generated.reset_stats()
    with pydiff.zero_policy(policy):
        with pytest.raises(ValueError, match=MESSAGES[name]) as info:
            getattr(mod, name).bwds(spy.grid((n,)), x, w, y)
    assert _state(x, w, y) == before
    assert "left as they were" in str(info.value)
    assert "added already" not in str(info.value)
    if n == LARGE and generated.enabled():
        assert generated.stats().get("backward: grid", 0) == 1  # (the generated kernel's path)


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_the_buffers_are_right_after_a_refusal(device, mod, n):
    """A refused call, then one that passes: its gradients added to the values from before
    (against NumPy's float64 closed form: d(w v^2)/dv = 2 w v, d/dw = v^2)."""
    x, w, y = _call(mod, "halve", n, device, seed=5)
    gx0, gw0 = x.grad.numpy().astype(np.float64), w.grad.numpy().astype(np.float64)
    with pytest.raises(ValueError, match="stored 2 times"):
        mod.halve.bwds(spy.grid((n,)), x, w, y)
    y2 = pydiff.zeros((n,), device=device).with_grads(zero=True)
    up = _known(n, 9)
    y2.grad.copy_from_numpy(up)
    mod.shift.bwds(spy.grid((n,)), x, w, y2)
    xs, ws = x.numpy().astype(np.float64), w.numpy().astype(np.float64)
    u = np.roll(up.astype(np.float64), -1)  # thread i stored y[(i + 1) % n]
    np.testing.assert_allclose(x.grad.numpy(), gx0 + 2 * ws * xs * u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), gw0 + xs * xs * u, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("policy", ["accumulate", "reset"])
def test_a_refused_call_on_a_tape_leaves_the_gradients_as_they_were(device, mod, policy, n):
    """The tape's backward batches the kernels: the copies and their restore go in order."""
    x, w, _ = _call(mod, "halve", n, device, seed=3)
    before = _state(x, w)
    with pydiff.Tape() as tape:
        y = pydiff.zeros((n // 2,), device=device)
        mod.halve(spy.grid((n,)), x, w, y)
    with pydiff.zero_policy(policy):
        with pytest.raises(ValueError, match="stored 2 times"):
            tape.backward(y, grad=_known(n // 2, 4))
    assert _state(x, w) == before


@pytest.mark.parametrize("separate", [False, True])
def test_a_refused_in_place_call_leaves_the_gradients_as_they_were(device, mod, separate):
    """In place: one buffer (upstream in, gradient out: the upstream must stay) or separate
    grad_in and grad_out (the kernel adds into grad_out: put back)."""
    n = SMALL
    x = _filled(device, _known(n, 7))
    y = pydiff.tensor(np.linspace(1.0, 2.0, n // 2).astype(np.float32), device=device)
    if separate:
        gi = pydiff.tensor(_known(n // 2, 8), device=device)
        go = pydiff.tensor(_known(n // 2, 9), device=device)
        y = y.with_grads(grad_in=gi, grad_out=go)
    else:
        y = y.with_grads(zero=True)
        y.grad.copy_from_numpy(_known(n // 2, 8))
    before = _state(x, y)
    values = y.numpy().copy()
    with pytest.raises(ValueError, match="stored 2 times"):
        mod.scale_halve.bwds(spy.grid((n,)), x, y)
    assert _state(x, y) == before
    np.testing.assert_array_equal(y.numpy(), values)


INOUT = """import slangpy;
[Differentiable]
void io(inout float a, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> y)
{ a = a * x[0]; y[0] = y[0] * a; }
"""


@pytest.mark.parametrize("policy", ["accumulate", "reset"])
def test_a_call_refused_before_its_kernel_leaves_the_gradients_as_they_were(device, policy):
    """The in-place tensor needs its stores counted through a wrapper that functions with
    inout parameters cannot have: refused after RESET zeroed x's gradient for the kernel."""
    mod = pydiff.load_module_from_source(f"s39_restore_io_{next(_names)}", INOUT, device=device)
    a = pydiff.tensor(np.ones(4, np.float32), device=device).with_grads(zero=True)
    x = _filled(device, np.array([7.0], np.float32))
    y = pydiff.tensor(np.ones(1, np.float32), device=device).with_grads(zero=True)
    y.grad.copy_from_numpy(np.array([5.0], np.float32))
    before = _state(a, x, y)
    with pydiff.zero_policy(policy):
        with pytest.raises(ValueError, match="inout parameters cannot have yet"):
            mod.io.bwds(a, x, y)
    assert _state(a, x, y) == before


def test_a_refused_call_leaves_the_policy_to_apply_again(device, mod):
    """Backwards of one pass (shared_pass: a torch backward reaching several calls) apply
    RESET once per buffer: the refused call's zeroing is undone, so the next call of the
    pass zeroes again (its gradient only, not added to the values from before)."""
    n = SMALL
    x, w, y = _call(mod, "halve", n, device, seed=11)
    seen: set[int] = set()
    with pydiff.zero_policy("reset"), shared_pass(seen):
        with pytest.raises(ValueError, match="stored 2 times"):
            mod.halve.bwds(spy.grid((n,)), x, w, y)
        assert id(x.grad.storage) not in seen
        y2 = pydiff.zeros((n,), device=device).with_grads(zero=True)
        up = _known(n, 12)
        y2.grad.copy_from_numpy(up)
        mod.shift.bwds(spy.grid((n,)), x, w, y2)
    xs, ws = x.numpy().astype(np.float64), w.numpy().astype(np.float64)
    u = np.roll(up.astype(np.float64), -1)
    np.testing.assert_allclose(x.grad.numpy(), 2 * ws * xs * u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), xs * xs * u, rtol=1e-5, atol=1e-5)


CHAIN = """import slangpy;
[Differentiable]
void halve(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx / 2] = v * v; }
[Differentiable]
void pair(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = v * v; }
[Differentiable]
void mix(int idx, IDiffTensor<float, 1> x, IDiffTensor<float, 1> y, IWDiffTensor<float, 1> z)
{ z[idx] = 3.0 * x[idx] + y[idx / 2]; }
"""


@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("policy", ["accumulate", "reset"])
def test_a_tape_refused_part_way_leaves_the_gradients_as_they_were(device, policy, n):
    """mix (recorded last) runs first in the backward and adds 3 into x.grad, then halve's
    counts refuse: the whole backward is undone (x's gradient, the intermediate y's, the
    seed in z's); then a backward over a right recording adds the closed form."""
    mod = pydiff.load_module_from_source(f"s39_restore_chain_{next(_names)}", CHAIN, device=device)
    x = _filled(device, _known(n, 21))
    before = _state(x)
    with pydiff.Tape() as tape:
        y = pydiff.zeros((n // 2,), device=device)
        mod.halve(spy.grid((n,)), x, y)
        z = pydiff.zeros((n,), device=device)
        mod.mix(spy.grid((n,)), x, y, z)
    with pydiff.zero_policy(policy):
        with pytest.raises(ValueError, match="left as they were"):
            tape.backward(z, grad=np.ones(n))
    assert _state(x) == before
    np.testing.assert_array_equal(y.grad.numpy(), np.zeros(n // 2))  # (never written before)
    np.testing.assert_array_equal(z.grad.numpy(), np.zeros(n))
    with pydiff.Tape() as tape:
        y = pydiff.zeros((n,), device=device)
        mod.pair(spy.grid((n,)), x, y)
        z = pydiff.zeros((n,), device=device)
        mod.mix(spy.grid((n,)), x, y, z)
    with pydiff.zero_policy(policy):
        tape.backward(z, grad=np.ones(n))
    xs = x.numpy().astype(np.float64)
    up = np.zeros(n)
    np.add.at(up, np.arange(n) // 2, 1.0)  # mix reads y[idx / 2]: dL/dy
    want = 3.0 + 2 * xs * up
    if policy == "accumulate":
        want = want + _known(n, 21).astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_tape_without_counted_calls_keeps_nothing(device, monkeypatch):
    """Calls that store once per thread at their grid element are not counted: their tape's
    backward copies no gradient buffer (the cost stays with counted calls), once the
    function's backward ran (the first may refuse part-way: Slang may refuse to build it,
    test_s40_guards.py)."""
    from pydiff import grad_restore

    def refuse(self, grad):
        raise AssertionError("a gradient buffer was kept")

    mod = pydiff.load_module_from_source(f"s39_restore_chain_{next(_names)}", CHAIN, device=device)
    n = SMALL
    x = _filled(device, np.zeros(n, np.float32))
    with pydiff.Tape() as tape:  # (the function's first backward: kept)
        y = pydiff.zeros((n,), device=device)
        mod.pair(spy.grid((n,)), x, y)
    tape.backward(y, grad=np.ones(n))
    x.grad.zero_()
    monkeypatch.setattr(grad_restore.GradSnapshot, "keep", refuse)
    with pydiff.Tape() as tape:
        y = pydiff.zeros((n,), device=device)
        mod.pair(spy.grid((n,)), x, y)
    tape.backward(y, grad=np.ones(n))
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.numpy(), rtol=1e-6)


def test_a_tape_with_ops_refused_part_way_leaves_the_gradients_as_they_were(device):
    """Ops (pydiff Functions) recorded after the refused call add into x's gradient first
    (through their grad targets): put back with the rest."""
    mod = pydiff.load_module_from_source(f"s39_restore_chain_{next(_names)}", CHAIN, device=device)
    n = SMALL
    x = _filled(device, _known(n, 31))
    before = _state(x)
    with pydiff.Tape() as tape:
        y = pydiff.zeros((n // 2,), device=device)
        mod.halve(spy.grid((n,)), x, y)
        loss = y.sum() + (x * x).sum()
    with pytest.raises(ValueError, match="left as they were"):
        tape.backward(loss)
    assert _state(x) == before
