"""Session 51 (break51b): empty_cache around held forwards, captures and other threads' calls;
tensors made while a forward is held; kernels built by racing threads and a build that fails.
Every value against float64 NumPy closed forms or PyTorch float64."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_hold, ops
from pydiff.errors import PydiffError

SOURCE = """
import slangpy;
[Differentiable] float b51_f(float a, float x) { return a * x * x + sin(x); }
"""

_n = iter(range(10**6))
N = 3000
JOIN_S = 120  # (a hang becomes a failure)


@pytest.fixture
def m(device, monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(generated_hold, "HOLD_FORWARD", True)
    return pydiff.load_module_from_source(f"s51_break51b_{next(_n)}", SOURCE, device=device)


def _data(seed: int, n: int = N):
    rng = np.random.default_rng(seed)
    return rng.uniform(-2, 2, n).astype(np.float32), rng.uniform(-1, 1, n).astype(np.float32)


def _closed(a, xs, g):
    x, g = xs.astype(np.float64), np.asarray(g, np.float64)
    return a * x**2 + np.sin(x), g * (2 * a * x + np.cos(x))


def _run_threads(targets):
    errors: list = []

    def wrap(t):
        try:
            t()
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


# -- empty_cache around a held forward ---------------------------------------------------------


def test_empty_cache_between_held_forward_and_backward(device, m):
    xs, g = _data(1)
    want_y, want_dx = _closed(0.5, xs, g)
    for clear in (False, False, True, False, True):  # (planned first: a plan's launch holds it)
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = m.b51_f(0.5, x)
        assert device.queue.held is not None
        if clear:
            pydiff.empty_cache(device)
            assert device.queue.held is None and not m.b51_f.plans
        tape.backward(y, grad=g)
        np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)


# -- tensors made while a forward is held ---------------------------------------------------------


def _seeds(device, x, g):
    torch = pytest.importorskip("torch")
    other = pydiff.tensor(g, device=device)
    return {
        "torch float64": lambda: pydiff.tensor(torch.tensor(g.astype(np.float64)), device=device),
        "pydiff tensor": lambda: pydiff.tensor(other, device=device),
        "float64 view": lambda: pydiff.tensor(
            np.repeat(g.astype(np.float64), 2)[::2], device=device
        ),
        "requires_grad": lambda: pydiff.tensor(g, device=device, requires_grad=True),
        "dtype=float from float16": lambda: pydiff.tensor(g.astype(np.float16), dtype="float"),
        "the held call's input": lambda: pydiff.tensor(x, device=device),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "torch float64",
        "pydiff tensor",
        "float64 view",
        "requires_grad",
        "dtype=float from float16",
        "the held call's input",
    ],
)
def test_seed_made_every_way_while_the_forward_is_held(device, m, kind):
    xs, g = _data(2)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b51_f(-0.75, x)
    make = _seeds(device, x, g)[kind]
    generated.reset_stats()
    seed = make()
    tape.backward(y, grad=seed)
    if kind not in ("pydiff tensor", "the held call's input"):  # (host data: still held)
        assert generated.stats().get("forward+backward fused") == 1, generated.stats()
    want_seed = seed.numpy().astype(np.float64)  # (the seed's own values)
    if kind == "the held call's input":
        np.testing.assert_array_equal(want_seed, xs)
    elif kind == "dtype=float from float16":
        np.testing.assert_array_equal(want_seed, g.astype(np.float16).astype(np.float64))
    else:
        np.testing.assert_array_equal(want_seed, g)
    want_y, want_dx = _closed(-0.75, xs, want_seed)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)


def test_seed_written_after_it_is_made_and_before_backward(device, m):
    xs, g = _data(3)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b51_f(1.25, x)
    seed = pydiff.tensor(np.zeros_like(g), device=device)
    seed.copy_from_numpy(g)  # (the later write is the one the backward reads)
    tape.backward(y, grad=seed)
    seed.copy_from_numpy(np.full_like(g, 7.0))  # (after: must not reach x.grad)
    want_y, want_dx = _closed(1.25, xs, g)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)


def test_tensor_made_in_another_thread_while_a_forward_is_held(device, m):
    xs, g = _data(4)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.b51_f(0.3, x)
    made: list = []
    assert not _run_threads([lambda: made.append(pydiff.tensor(g, device=device))])
    tape.backward(y, grad=made[0])
    want_y, want_dx = _closed(0.3, xs, g)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)


# -- threads: cold builds racing, empty_cache meanwhile, a build that fails ----------------------


def test_threads_racing_cold_matmul_builds_build_each_kernel_once(device, monkeypatch):
    from pydiff.kernels import KernelCache

    built: list = []
    build = KernelCache._build

    def counted(self, file, entry, defines):
        built.append((file, entry, tuple(sorted(defines.items()))))
        return build(self, file, entry, defines)

    monkeypatch.setattr(KernelCache, "_build", counted)
    w = 4 * (160 + next(_n) % 40)  # (widths no other test multiplies: new kernels)
    rng = np.random.default_rng(w)
    a_host = rng.uniform(-1, 1, (32, w)).astype(np.float32)
    b_host = rng.uniform(-1, 1, (w, w + 8)).astype(np.float32)
    want = a_host.astype(np.float64) @ b_host.astype(np.float64)
    a = pydiff.tensor(a_host, device=device)
    b = pydiff.tensor(b_host, device=device)
    start = threading.Barrier(4)
    results: list = []

    def one():
        start.wait(JOIN_S)
        results.append(ops.matmul(a, b).numpy())

    assert not _run_threads([one] * 4)
    assert len(results) == 4
    for r in results:
        np.testing.assert_allclose(r, want, rtol=1e-4, atol=1e-4)
    assert built and len(built) == len(set(built)), built


def test_failing_build_releases_the_waiting_thread_and_the_lock(device, monkeypatch):
    from pydiff.kernels import KernelCache

    build = KernelCache._build
    entered = threading.Event()
    waited: list = []

    def failing(self, file, entry, defines):
        if defines.get("B51_FAIL"):
            entered.set()
            threading.Event().wait(0.5)  # (the other thread's cold build waits meanwhile)
            raise PydiffError(f"pydiff kernel {file}:{entry} failed to build: b51 test")
        waited.append(entry)
        return build(self, file, entry, defines)

    monkeypatch.setattr(KernelCache, "_build", failing)
    kernels = device.kernels
    errors: list = []
    got: list = []
    w = 4 * (210 + next(_n) % 40)  # (a width no other test multiplies: a cold build)
    rng = np.random.default_rng(w)
    a_host = rng.uniform(-1, 1, (16, w)).astype(np.float32)
    b_host = rng.uniform(-1, 1, (w, 12)).astype(np.float32)
    a = pydiff.tensor(a_host, device=device)
    b = pydiff.tensor(b_host, device=device)

    def bad():
        for _ in range(2):  # (a failed build is not remembered: it fails again, as clearly)
            try:
                kernels.get("ops/matmul.slang", "mm_nn", B51_FAIL=1)
            except PydiffError as exc:
                errors.append(exc)

    def waiter():
        assert entered.wait(JOIN_S)
        got.append(ops.matmul(a, b).numpy())

    assert not _run_threads([bad, waiter])
    assert len(errors) == 2 and all("b51 test" in str(e) for e in errors)
    assert waited, "the product built no kernel"
    want = a_host.astype(np.float64) @ b_host.astype(np.float64)
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    assert kernels._building.acquire(timeout=1)  # (released)
    kernels._building.release()


def test_empty_cache_while_other_threads_call_and_differentiate(device, m):
    xs, g = _data(5, 2048)
    want_y, want_dx = _closed(0.9, xs, g)
    rng = np.random.default_rng(5)
    a_host = rng.uniform(-1, 1, (16, 24)).astype(np.float32)
    b_host = rng.uniform(-1, 1, (24, 12)).astype(np.float32)
    want_mm = a_host.astype(np.float64) @ b_host.astype(np.float64)
    stop = threading.Event()
    counts = [0, 0]

    def calls():
        while not stop.is_set():
            x = pydiff.tensor(xs, device=device, requires_grad=True)
            y = m.b51_f(0.9, x, _result="tensor")
            m.b51_f.bwds(0.9, x, _result=y.with_grads(pydiff.tensor(g, device=device)))
            np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)
            counts[0] += 1

    def products():
        a = pydiff.tensor(a_host, device=device)
        b = pydiff.tensor(b_host, device=device)
        while not stop.is_set():
            np.testing.assert_allclose(ops.matmul(a, b).numpy(), want_mm, rtol=1e-4, atol=1e-4)
            counts[1] += 1

    def clearing():
        try:
            for _ in range(12):
                pydiff.empty_cache(device)
                threading.Event().wait(0.1)
        finally:
            stop.set()

    errors = _run_threads([calls, products, clearing])
    assert not errors, errors
    assert all(counts), counts


def test_training_with_empty_cache_between_forward_backward_and_step(device, m):
    torch = pytest.importorskip("torch")
    from pydiff import nn, optim

    rng = np.random.default_rng(8)
    lin = nn.Linear(8, 4, seed=0, device=device)
    a = pydiff.tensor(np.array([0.3], np.float32), device=device, requires_grad=True)
    params = [*lin.parameters(), a]
    opt = optim.AdamW(params, lr=0.05)
    tp = [torch.tensor(p.numpy().astype(np.float64), requires_grad=True) for p in params]
    topt = torch.optim.AdamW(tp, lr=0.05)
    for _ in range(4):
        xb = rng.standard_normal((16, 8)).astype(np.float32)
        yb = rng.integers(0, 4, 16)
        opt.zero_grad()
        with pydiff.Tape() as tape:
            z = m.b51_f(a, lin(pydiff.tensor(xb, device=device)))
            loss = ops.cross_entropy(z, pydiff.tensor(yb, dtype="int", device=device))
        pydiff.empty_cache(device)
        tape.backward(loss)
        pydiff.empty_cache(device)
        opt.step()
        pydiff.empty_cache(device)
        topt.zero_grad()
        h = torch.tensor(xb, dtype=torch.float64) @ tp[0].T + tp[1]
        want = torch.nn.functional.cross_entropy(tp[2] * h**2 + torch.sin(h), torch.tensor(yb))
        want.backward()
        topt.step()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
        for p, t in zip(params, tp):
            np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_capture_replayed_while_another_thread_empties_the_cache(device, m):
    n = 64
    rng = np.random.default_rng(9)
    x = pydiff.tensor(np.zeros(n, np.float32), device=device, requires_grad=True)
    y = pydiff.empty((n,), device=device)
    g = pydiff.tensor(np.zeros(n, np.float32), device=device)

    def step():
        x.zero_grad()
        m.b51_f(0.5, x, _result=y)
        m.b51_f.bwds(0.5, x, _result=y.with_grads(g))
        return y

    captured = pydiff.capture(step)
    stop = threading.Event()
    replays = [0]

    def replaying():
        try:
            while not stop.is_set() or not replays[0]:
                xs, gs = _data(int(rng.integers(1 << 30)), n)
                x.copy_from_numpy(xs)
                g.copy_from_numpy(gs)
                captured.replay()
                want_y, want_dx = _closed(0.5, xs, gs)
                np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)
                replays[0] += 1
        finally:
            stop.set()

    def clearing():
        for _ in range(20):
            if stop.is_set():
                break
            pydiff.empty_cache(device)
            stop.wait(0.02)
        stop.set()

    assert not _run_threads([replaying, clearing])
    assert replays[0]
