"""The fused forward + backward generated kernel (pydiff.generated_fused): its result and
gradients against float64 NumPy closed forms, the same bits as the forward kernel then the
backward kernel, one dispatch. (The kernel only: not yet reached from a tape.)"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import generated_hold
from pydiff import generated, generated_fused

SOURCE = """
import slangpy;
[Differentiable] float fz_poly(float a, float b, float x) { return a * x * x + b * x + sin(x); }
"""


@pytest.fixture(autouse=True)
def _hold_forward_on(monkeypatch):
    """The fused path (generated_hold.HOLD_FORWARD, on by default): on for these tests."""
    monkeypatch.setattr(generated_hold, "HOLD_FORWARD", True)


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("fuse49_cases", SOURCE, device=device)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-2, 2, n).astype(np.float32), rng.uniform(-1, 1, n).astype(np.float32)


def _count_dispatches(device, monkeypatch):
    calls = []
    real = device.kernels.dispatch_split

    def split(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(device.kernels, "dispatch_split", split)
    return calls


@pytest.mark.parametrize("n", [1, 1000, 2**20 + 3])
def test_fused_values_and_gradients(device, m, n):
    x, g = _data(n)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    y = generated_fused.forward_backward(m.fz_poly, [1.5, -0.5, xt], gt, {2: xt.grad_out})
    assert y is not None
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    np.testing.assert_allclose(
        y.numpy(), 1.5 * x64**2 - 0.5 * x64 + np.sin(x64), rtol=1e-5, atol=1e-5
    )
    want = g64 * (3.0 * x64 - 0.5 + np.cos(x64))
    np.testing.assert_allclose(xt.grad.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 1000, 2**20 + 3])
def test_broadcast_scalar_parameter(device, m, n):
    x, g = _data(n, 1)
    at = pydiff.tensor(np.array([0.75], np.float32), device=device, requires_grad=True)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    grads = {0: at.grad_out, 2: xt.grad_out}
    y = generated_fused.forward_backward(m.fz_poly, [at, 2.0, xt], gt, grads)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    np.testing.assert_allclose(
        y.numpy(), 0.75 * x64**2 + 2 * x64 + np.sin(x64), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        xt.grad.numpy(), g64 * (1.5 * x64 + 2 + np.cos(x64)), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(at.grad.numpy().ravel(), [np.sum(g64 * x64**2)], rtol=1e-4)


@pytest.mark.parametrize("n", [1000, 2**20 + 3])
def test_same_bits_as_forward_then_backward(device, m, n):
    x, g = _data(n, 2)
    at = pydiff.tensor(np.array([0.75], np.float32), device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    runs = []
    for fused in (True, False):
        at.grad_out.copy_from_numpy(np.zeros((1,), np.float32))
        xt = pydiff.tensor(x, device=device, requires_grad=True)
        args, grads = [at, 2.0, xt], {0: at.grad_out, 2: xt.grad_out}
        if fused:
            y = generated_fused.forward_backward(m.fz_poly, args, gt, grads)
        else:
            y = generated.forward(m.fz_poly, args, None)
            assert generated.backward(m.fz_poly, args, gt, grads)
        runs.append((y.numpy(), xt.grad.numpy(), at.grad.numpy()))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_one_dispatch_and_counted(device, m, monkeypatch):
    x, g = _data(5000, 3)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    generated_fused.forward_backward(m.fz_poly, [1.0, 1.0, xt], gt, {2: xt.grad_out})  # built
    generated.reset_stats()
    calls = _count_dispatches(device, monkeypatch)
    generated_fused.forward_backward(m.fz_poly, [1.0, 1.0, xt], gt, {2: xt.grad_out})
    assert len(calls) == 1
    assert generated.stats().get("forward+backward fused") == 1


def test_declined_case_does_nothing(device, m):
    x, g = _data(100)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    # a gradient wanted for a number: generated.backward declines, so does the fused kernel
    assert generated_fused.forward_backward(m.fz_poly, [1.0, 1.0, xt], gt, {0: xt.grad_out}) is None
    np.testing.assert_array_equal(xt.grad.numpy(), np.zeros(100, np.float32))


# ---- on a tape: y = m.f(...) then tape.backward(y) fuses the two kernels


def _tape_run(device, fn, x, g, a=None, between=None, grad_kw=True, retain=False):
    """y and the gradients of ``y = fn(a or 1.5, -0.5, x)`` on a tape then ``tape.backward``
    (``between(y)`` after the call); and the kernels dispatched (names of the entry)."""
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    first = a if a is not None else 1.5
    with pydiff.Tape() as tape:
        y = fn(first, -0.5, xt)
    if between is not None:
        between(y)
    tape.backward(y, grad=g if grad_kw else None)
    if retain:
        tape.backward(y, grad=g)
    return y.numpy(), xt.grad.numpy()


@pytest.fixture
def fresh(device):
    """A module of its own per test: no call plan made by an earlier test's calls."""
    fresh.n = getattr(fresh, "n", 0) + 1
    return pydiff.load_module_from_source(f"fuse49_tape{fresh.n}", SOURCE, device=device)


def _closed(x, g, a=1.5):
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    return a * x64**2 - 0.5 * x64 + np.sin(x64), g64 * (2 * a * x64 - 0.5 + np.cos(x64))


@pytest.mark.parametrize("n", [1000, 2**20 + 3])
def test_tape_fused(device, fresh, monkeypatch, n):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    x, g = _data(n, 4)
    generated.reset_stats()
    calls = _count_dispatches(device, monkeypatch)
    y, gx = _tape_run(device, fresh.fz_poly, x, g)
    stats = generated.stats()
    assert stats.get("forward+backward fused") == 1, stats
    assert "forward" not in stats and "backward" not in stats, stats
    assert len(calls) == 1  # the fused kernel (zeroing and the seed: no kernels of theirs)
    want_y, want_g = _closed(x, g)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, want_g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2**20 + 3])
def test_tape_fused_seed_and_sizes(device, fresh, monkeypatch, n):
    """Size 1 with the seed of ones (grad omitted); 2^20+3 with a given grad."""
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    x, g = _data(n, 5)
    if n == 1:
        g = np.ones(1, np.float32)
    generated.reset_stats()
    y, gx = _tape_run(device, fresh.fz_poly, x, g, grad_kw=n != 1)
    assert generated.stats().get("forward+backward fused") == 1, generated.stats()
    want_y, want_g = _closed(x, g)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, want_g, rtol=1e-5, atol=1e-5)


def _both(device, monkeypatch, make_module, run):
    """``run(module)`` fused-allowed and with HOLD_FORWARD off (each on a fresh module): its
    outputs (arrays) bitwise equal; the stats of the first."""
    from pydiff import generated_hold

    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    outs, stats = [], []
    for hold in (True, False):
        monkeypatch.setattr(generated_hold, "HOLD_FORWARD", hold)
        generated.reset_stats()
        outs.append([np.asarray(o) for o in run(make_module())])
        stats.append(generated.stats())
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert "forward+backward fused" not in stats[1]
    return stats[0], outs[0]


def _modules(device):
    return lambda: pydiff.load_module_from_source(
        f"fuse49_both{next(_modules.n)}", SOURCE, device=device
    )


_modules.n = iter(range(10**6))


def test_tape_broadcast_parameter_same_bits(device, monkeypatch):
    x, g = _data(2**20 + 3, 6)

    def run(m):
        a = pydiff.tensor(np.array([0.75], np.float32), device=device, requires_grad=True)
        xt = pydiff.tensor(x, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = m.fz_poly(a, -0.5, xt)
        tape.backward(y, grad=g)
        return y.numpy(), xt.grad.numpy(), a.grad.numpy()

    stats, (y, gx, ga) = _both(device, monkeypatch, _modules(device), run)
    assert stats.get("forward+backward fused") == 1, stats
    want_y, want_g = _closed(x, g, 0.75)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, want_g, rtol=1e-5, atol=1e-5)
    want_a = np.sum(g.astype(np.float64) * x.astype(np.float64) ** 2)
    np.testing.assert_allclose(ga.ravel(), [want_a], rtol=1e-4)


def _between_case(device, x, g, between=None, retain=False, policy=None, det=False):
    def run(m):
        xt = pydiff.tensor(x, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = m.fz_poly(1.5, -0.5, xt)
        seen = between(m, y) if between is not None else np.zeros(1, np.float32)
        if policy is not None:
            with pydiff.zero_policy(policy):
                tape.backward(y, grad=g)
        elif det:
            with pydiff.deterministic():
                tape.backward(y, grad=g)
        else:
            tape.backward(y, grad=g)
        if retain:
            tape.backward(y, grad=g)
        return y.numpy(), xt.grad.numpy(), seen

    return run


@pytest.mark.parametrize(
    "case",
    ["read", "other_op", "retain", "reset", "strict", "deterministic", "plain"],
)
def test_tape_do_not_fuse_cases_same_results(device, monkeypatch, case):
    x, g = _data(5000, 7)
    between = None
    if case == "read":
        between = lambda m, y: y.numpy().copy()  # noqa: E731
    elif case == "other_op":
        between = lambda m, y: m.fz_poly(1.0, 0.0, y).numpy()  # noqa: E731
    run = _between_case(
        device,
        x,
        g,
        between,
        retain=case == "retain",
        policy={"reset": "reset", "strict": "strict"}.get(case),
        det=case == "deterministic",
    )
    stats, (y, gx, _) = _both(device, monkeypatch, _modules(device), run)
    fused = stats.get("forward+backward fused", 0)
    if case in ("read", "other_op", "deterministic"):
        assert fused == 0, stats  # (deterministic: the forward was not on one, held anyway)
    if case in ("plain", "retain", "reset", "strict"):
        assert fused == 1, stats  # (retain: the first backward fused, the second not)
    want_y, want_g = _closed(x, g)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    scale = 2 if case == "retain" else 1
    np.testing.assert_allclose(gx, scale * want_g, rtol=1e-5, atol=1e-5)


def test_tape_loop_planned_calls_fused_same_bits(device, monkeypatch):
    """A loop's later steps take the call plan's launch: held and fused there too."""
    x, g = _data(3000, 8)

    def run(m):
        xt = pydiff.tensor(x, device=device, requires_grad=True)
        ys = []
        for _ in range(4):
            with pydiff.Tape() as tape:
                y = m.fz_poly(1.5, -0.5, xt)
            tape.backward(y, grad=g, retain_graph=False)
            ys.append(y.numpy())
        return [*ys, xt.grad.numpy()]

    stats, outs = _both(device, monkeypatch, _modules(device), run)
    assert stats.get("forward+backward fused") == 4, stats
    want_y, want_g = _closed(x, g)
    np.testing.assert_allclose(outs[-2], want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[-1], 4 * want_g, rtol=1e-5, atol=1e-4)
