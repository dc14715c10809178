"""Breaking ``tape.backward(y, grad=g)`` (session 50): tensor seeds copied on the device,
float32 NumPy seeds taken as they are, the fused forward + backward. Every value against
float64 NumPy closed forms of ``p(a, x) = a x^2 + sin x`` (dp/dx = 2 a x + cos x)."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

import pydiff
from pydiff import generated, tape as tape_mod

SOURCE = """
import slangpy;
[Differentiable] float b50_p(float a, float x) { return a * x * x + sin(x); }
[Differentiable] float b50_q(float x, float z) { return x * z + x * x; }
[Differentiable] half b50_h(half a, half x) { return a * x * x + sin(x); }
"""
_names = itertools.count()
N = 5000  # above generated.MIN_ELEMENTS (4096): generated kernels, fused where it can


@pytest.fixture
def m(device, monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 4096)
    return pydiff.load_module_from_source(f"s50_b50_{next(_names)}", SOURCE, device=device)


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-2, 2, n).astype(np.float32), rng.uniform(-1, 1, n).astype(np.float32)


def _p(x, a=1.5):
    x = np.asarray(x, np.float64)
    return a * x * x + np.sin(x)


def _dp(x, a=1.5):
    x = np.asarray(x, np.float64)
    return 2 * a * x + np.cos(x)


def _close(got, want, tol=1e-4):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


def _step(m, device, x, grad, n=None):
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b50_p(1.5, xt)
    tape.backward(y, grad=grad(y) if callable(grad) else grad)
    return xt, y


# --- bug found: a read-only float32 array (host_seed takes it as it is) ----------------------
@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("n", [10, N])
def test_read_only_float32_seed(device, m, monkeypatch, batch, n):
    """SlangPy's upload_buffer_data / copy_from_numpy refuse a read-only array (TypeError:
    incompatible function arguments): a float32 seed taken as it is reached them unchanged."""
    monkeypatch.setattr(tape_mod, "_BATCH", batch)
    x, g = _data(n, 1)
    g.flags.writeable = False
    xt, y = _step(m, device, x, g)
    _close(xt.grad.numpy(), g * _dp(x))
    _close(y.numpy(), _p(x))


def test_read_only_float32_seed_of_a_0d_output(device, m):
    xt = pydiff.tensor(np.float32(0.5), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b50_p(1.5, xt)
    seed = np.array(2.0, np.float32)
    seed.flags.writeable = False
    tape.backward(y, grad=seed)
    _close(xt.grad.numpy(), 2.0 * _dp(0.5))


@pytest.mark.parametrize("n", [10, N])
def test_read_only_array_into_a_tensor(device, n):
    """The same refusal in pydiff.tensor(a) and copy_from_numpy(a) (before session 50 too)."""
    a = np.linspace(-1, 1, n, dtype=np.float32)
    a.flags.writeable = False
    _close(pydiff.tensor(a, device=device).numpy(), a)
    t = pydiff.tensor(np.zeros(n, np.float32), device=device)
    t.copy_from_numpy(a)
    _close(t.numpy(), a)


# --- guards: cases that pass ------------------------------------------------------------------
@pytest.mark.parametrize(
    "alias", ["y", "y.detach()", "y[:]", "y.reshape(n)", "y.detach().reshape(n)"]
)
def test_seed_aliasing_the_output(device, m, alias):
    """g is y or a view of it: the seed is y's values (written by the held-back forward)."""
    x, _ = _data(N, 2)
    view = {
        "y": lambda y: y,
        "y.detach()": lambda y: y.detach(),
        "y[:]": lambda y: y[:],
        "y.reshape(n)": lambda y: y.reshape(N),
        "y.detach().reshape(n)": lambda y: y.detach().reshape(N),
    }[alias]
    xt, y = _step(m, device, x, view)
    _close(xt.grad.numpy(), _p(x) * _dp(x))
    _close(y.numpy(), _p(x))


@pytest.mark.parametrize("policy", ["accumulate", "reset"])
def test_leaf_grad_as_seed_of_the_next_step(device, m, policy):
    x, g = _data(N, 3)
    xt, _ = _step(m, device, x, pydiff.tensor(g, device=device))
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            y = m.b50_p(1.5, xt)
        tape.backward(y, grad=xt.grad.detach())
    first = g * _dp(x)
    _close(xt.grad.numpy(), first * _dp(x) + (first if policy == "accumulate" else 0))


@pytest.mark.parametrize("kind", ["y.grad", "y.grad_in", "y.grad_out"])
def test_retained_graph_seeded_with_the_outputs_own_gradient(device, m, kind):
    x, g = _data(N, 4)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b50_p(1.5, xt)
    tape.backward(y, grad=pydiff.tensor(g, device=device), retain_graph=True)
    tape.backward(y, grad=getattr(y, kind.split(".")[1]))
    _close(xt.grad.numpy(), 2 * g * _dp(x))


@pytest.mark.parametrize("kind", ["fill", "setitem", "iadd", "copy_", "copy_from_numpy"])
def test_seed_written_right_after_the_call(device, m, kind):
    x, g = _data(N, 5)
    gt = pydiff.tensor(g, device=device)
    xt, _ = _step(m, device, x, gt)
    if kind == "fill":
        gt.fill(7.0)
    elif kind == "setitem":
        gt[10:20] = 5.0
    elif kind == "iadd":
        gt += 1.0
    elif kind == "copy_":
        gt.copy_(pydiff.tensor(np.full(N, 3, np.float32), device=device))
    else:
        gt.copy_from_numpy(np.full(N, 9, np.float32))
    _close(xt.grad.numpy(), g * _dp(x))


def test_seed_made_by_a_later_generated_call(device, m):
    """g = the result of a generated call made after y's (that forward now the held one)."""
    x, g = _data(N, 6)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    src = pydiff.tensor(g, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b50_p(1.5, xt)
        gt = m.b50_p(0.0, src)  # sin(g)
    tape.backward(y, grad=gt)
    _close(xt.grad.numpy(), np.sin(g.astype(np.float64)) * _dp(x))


@pytest.mark.parametrize("kind", ["mutated", "strided", "negative", "big-endian", "nan"])
def test_float32_numpy_seeds(device, m, kind):
    x, g = _data(N, 7)
    if kind == "strided":
        seed = np.zeros(2 * N, np.float32)
        seed[::2] = g
        seed = seed[::2]
    elif kind == "negative":
        seed = g[::-1].copy()[::-1]
    elif kind == "big-endian":
        seed = g.astype(">f4")
    elif kind == "nan":
        g[3], g[4] = np.nan, -np.inf
        seed = g.copy()
    else:
        seed = g.copy()
    xt, _ = _step(m, device, x, seed)
    if kind == "mutated":
        seed[:] = 100.0
    got, want = xt.grad.numpy(), g * _dp(x)
    if kind == "nan":
        assert np.isnan(got[3]) and np.isinf(got[4]) and np.sign(got[4]) == np.sign(want[4])
        got, want = np.delete(got, [3, 4]), np.delete(want, [3, 4])
    _close(got, want)


@pytest.mark.parametrize("seed_kind", ["np32", "tensor-float", "tensor-half"])
def test_half_output_seeds(device, m, seed_kind):
    x, g = _data(N, 8)
    x, g = x.astype(np.float16), g.astype(np.float16)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b50_h(1.5, xt)
    seed = {
        "np32": g.astype(np.float32),
        "tensor-float": pydiff.tensor(g.astype(np.float32), device=device),
        "tensor-half": pydiff.tensor(g, device=device),
    }[seed_kind]
    tape.backward(y, grad=seed)
    _close(xt.grad.numpy(), g.astype(np.float64) * (3 * x.astype(np.float64) + np.cos(x)), 2e-2)


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("kind", ["np.float32", "0-d f32", "(1,) f32", "tensor 0-d", "tensor (1,)"])
def test_one_element_output_seeds(device, m, shape, kind):
    xt = pydiff.tensor(np.full(shape, 0.7, np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b50_p(1.5, xt)
    seed = {
        "np.float32": np.float32(2.5),
        "0-d f32": np.array(2.5, np.float32),
        "(1,) f32": np.array([2.5], np.float32),
        "tensor 0-d": pydiff.tensor(np.array(2.5, np.float32), device=device),
        "tensor (1,)": pydiff.tensor(np.array([2.5], np.float32), device=device),
    }[kind]
    tape.backward(y, grad=seed)
    _close(xt.grad.numpy().ravel(), [2.5 * _dp(np.float32(0.7))])


def test_fused_with_x_used_twice_and_a_broadcast_parameter(device, m):
    x, g = _data(N, 9)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    generated.reset_stats()
    with pydiff.Tape() as tape:
        y = m.b50_q(xt, xt)  # 2 x^2
    tape.backward(y, grad=gt)
    assert generated.stats().get("forward+backward fused", 0) == 1, generated.stats()
    _close(y.numpy(), 2 * x.astype(np.float64) ** 2)
    _close(xt.grad.numpy(), 4 * g * x.astype(np.float64))
    a = pydiff.tensor(np.array(1.5, np.float32), device=device, requires_grad=True)
    xt2 = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b50_p(a, xt2)
    tape.backward(y, grad=gt)
    _close(y.numpy(), _p(x))
    _close(xt2.grad.numpy(), g * _dp(x))
    _close(a.grad.numpy(), np.sum(g.astype(np.float64) * x.astype(np.float64) ** 2), 1e-3)


def test_fused_with_deterministic_toggled_in_between(device, m):
    x, g = _data(N, 10)
    gt = pydiff.tensor(g, device=device)
    a = pydiff.tensor(np.array([1.5], np.float32), device=device, requires_grad=True)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b50_p(a, xt)
    with pydiff.deterministic(True):
        tape.backward(y, grad=gt)
    _close(y.numpy(), _p(x))
    _close(xt.grad.numpy(), g * _dp(x))
    _close(a.grad.numpy(), [np.sum(g.astype(np.float64) * x.astype(np.float64) ** 2)], 1e-3)


def test_threads_each_with_their_own_tape_step(device, m):
    errors = []

    def work(k):
        try:
            for i in range(3):
                x, g = _data(N, 100 + 10 * k + i)
                gt = pydiff.tensor(g, device=device)
                xt, y = _step(m, device, x, gt)
                gt.fill(9.0)
                _close(xt.grad.numpy(), g * _dp(x))
                _close(y.numpy(), _p(x))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e)[:300])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_iteration_rows_as_seeds(device, m):
    x = np.resize(_data(N, 11)[0], 3 * 4096).astype(np.float32).reshape(3, 4096)
    g = _data(3 * 4096, 12)[1].reshape(3, 4096)
    for i, row in enumerate(pydiff.tensor(g, device=device)):
        xt, _ = _step(m, device, x[i], row)
        _close(xt.grad.numpy(), g[i] * _dp(x[i]))


# --- bug found: a seed the captured step itself computes -------------------------------------
@pytest.mark.parametrize("seed_of", ["a kernel's result", "y itself"])
def test_capture_refuses_a_seed_the_step_wrote(device, m, seed_of):
    """Inside pydiff.capture a tensor seed is read on the host and recorded as an upload of
    those values; one the step computes (grad=m.f(w), grad=y) changes at each replay, which
    still seeded the capture's values: after w changed, a wrong gradient without a word."""
    x, g = _data(N, 13)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    w = pydiff.tensor(g, device=device)

    def step():
        xt.zero_grad()
        with pydiff.Tape() as tape:
            y = m.b50_p(1.5, xt)
        tape.backward(y, grad=m.b50_p(0.0, w) if seed_of != "y itself" else y)  # sin(w) / y

    step()
    _close(xt.grad.numpy(), (np.sin(g) if seed_of != "y itself" else _p(x)) * _dp(x))
    with pytest.raises(pydiff.CaptureError, match="grad is a tensor the captured step wrote"):
        pydiff.capture(step)


def test_capture_with_a_seed_from_outside_replays_right(device, m):
    """The seed made outside the step (its values checked before each replay) still works."""
    x, g = _data(N, 14)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)

    def step():
        xt.zero_grad()
        with pydiff.Tape() as tape:
            y = m.b50_p(1.5, xt)
        tape.backward(y, grad=gt)

    step()
    captured = pydiff.capture(step)
    x2 = _data(N, 15)[0]
    xt.copy_from_numpy(x2)
    captured.replay()
    _close(xt.grad.numpy(), g * _dp(x2))


@pytest.mark.parametrize("seed_kind", ["tensor", "float32"])
def test_fused_step_refused_by_strict_leaves_y_written_and_retries(device, m, seed_kind):
    """STRICT refuses a stale x.grad after the held forward was claimed: y still holds
    p(x), x.grad is unchanged, and after zero_grad the same backward gives the gradient."""
    x, g = _data(N, 16)
    xt, _ = _step(m, device, x, pydiff.tensor(g, device=device))
    before = xt.grad.numpy().copy()
    with pydiff.zero_policy("strict"):
        with pydiff.Tape() as tape:
            y = m.b50_p(1.5, xt)
        seed = pydiff.tensor(2 * g, device=device) if seed_kind == "tensor" else 2 * g
        with pytest.raises(pydiff.StaleGradientError):
            tape.backward(y, grad=seed)
        _close(y.numpy(), _p(x))
        np.testing.assert_array_equal(xt.grad.numpy(), before)
        xt.zero_grad()
        tape.backward(y, grad=seed)
    _close(xt.grad.numpy(), 2 * g * _dp(x))


def test_chained_tapes_and_offset_view_seeds(device, m):
    x, g = _data(N, 17)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as first:
        h = m.b50_p(1.5, xt)
    with pydiff.Tape(reads_other_tapes=True) as second:
        y = m.b50_q(h, xt)  # h x + h^2
    big = pydiff.tensor(np.concatenate([np.full(N, 99, np.float32), g]), device=device)
    second.backward(y, grad=big[N:])  # a view at an offset: read on the host
    first.backward(h, grad=h.grad)
    big.fill(5.0)
    hv, xv = _p(x), x.astype(np.float64)
    _close(xt.grad.numpy(), g * hv + g * (xv + 2 * hv) * _dp(x))


@pytest.mark.parametrize("wants_grad", [False, True])
def test_fused_step_seeded_with_one_of_its_own_inputs(device, m, wants_grad):
    """y = q(x, z) = x z + x^2 seeded with z itself (read by the fused kernel, copied into
    y's gradient): dx = z (z + 2x), dz = z x."""
    x, g = _data(N, 18)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    zt = pydiff.tensor(g, device=device, requires_grad=wants_grad)
    generated.reset_stats()
    with pydiff.Tape() as tape:
        y = m.b50_q(xt, zt)
    tape.backward(y, grad=zt)
    assert generated.stats().get("forward+backward fused", 0) == 1, generated.stats()
    x64, z64 = x.astype(np.float64), g.astype(np.float64)
    _close(y.numpy(), x64 * z64 + x64**2)
    _close(xt.grad.numpy(), z64 * (z64 + 2 * x64))
    if wants_grad:
        _close(zt.grad.numpy(), z64 * x64)
