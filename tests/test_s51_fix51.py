"""Session 51 fixes (fix51): NumPy data held fixed in jvp/hvp/hessian as grad takes it;
hessian's errors name hessian; pydiff.tensor(t) of a tensor copied on the device; Device.cached
builds outside the device's lock. References: closed forms, float64 NumPy."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

W = np.array([1.0, 2.0, -0.5])
A = np.array([0.5, 3.0, 1.5])
U = np.array([1.0, -1.0, 2.0])


def test_jvp_numpy_data_held_fixed():
    """d/dw (w a^2) . u = u a^2 (closed form); before: 'mul: expected ... pydiff.Tensor'."""
    y, dy = pydiff.jvp(lambda w, a: ops.mul(w, ops.mul(a, a)), (W, A), (U, None))
    np.testing.assert_allclose(y.numpy(), W * A**2, rtol=1e-6)
    np.testing.assert_allclose(dy.numpy(), U * A**2, rtol=1e-6)


def test_hvp_numpy_data_held_fixed():
    """f = sum(w^2 a^2): H = diag(2 a^2), so H u = 2 a^2 u."""
    f = lambda w, a: ops.sum(ops.mul(ops.mul(w, w), ops.mul(a, a)))  # noqa: E731
    hv, none = pydiff.hvp(f, (W, A), (U, None))
    assert none is None
    np.testing.assert_allclose(hv, 2 * A**2 * U, rtol=1e-6)
    # as grad takes the same data: grad(f)(w, a) = 2 w a^2
    np.testing.assert_allclose(pydiff.grad(f)(W, A), 2 * W * A**2, rtol=1e-6)


def test_hessian_numpy_float_and_integer_data():
    """A float array differentiated, an integer array held fixed (as grad takes it: an int32
    tensor): f = sum(w^2 k^2 c) with k integer, c float data closed over -> diag(2 k^2 c)."""
    k = np.array([1, 2, 3])
    c = np.array([0.5, 1.0, 2.0])

    def f(w, k):
        kf = k.astype(np.float32)  # (before the fix: a NumPy array, refused by ops.mul)
        return ops.sum(ops.mul(ops.mul(w, w), ops.mul(ops.mul(kf, kf), pydiff.tensor(c))))

    H = pydiff.hessian(f, (W, k))
    np.testing.assert_allclose(H, np.diag(2 * k**2 * c), rtol=1e-6)


def test_jvp_float_data_overflow_named():
    with pytest.raises(ValueError, match="jvp: argument 1"):
        pydiff.jvp(lambda w, a: ops.mul(w, a), (W, np.array([1e300, 0, 0])), (U, None))


def test_hessian_nonscalar_names_hessian():
    with pytest.raises(ValueError, match=r"^hessian: fn must return a one-element"):
        pydiff.hessian(lambda w: ops.mul(w, w), (W,))
    with pytest.raises(ValueError, match=r"^hvp: fn must return a one-element"):
        pydiff.hvp(lambda w: ops.mul(w, w), (W,), (U,))


# --- Device.cached: make() outside the device's lock ---------------------------------------


def _fresh_device(device):
    import pydiff.device_state as device_state

    return device_state.Device(device.native, device.type)


def test_cached_lookup_not_stalled_by_a_build(device):
    """One thread's make() blocks; another thread's lookup of an entry already made returns
    (before: it waited on the device's lock, held around make())."""
    import threading

    dev = _fresh_device(device)
    assert dev.cached(("fix51", "made"), lambda: 41) == 41
    building, release, out = threading.Event(), threading.Event(), {}

    def slow():
        building.set()
        release.wait(30)
        return "slow"

    builder = threading.Thread(
        target=lambda: out.setdefault("slow", dev.cached(("fix51", "slow"), slow)), daemon=True
    )
    builder.start()
    assert building.wait(10)
    reader = threading.Thread(
        target=lambda: out.setdefault("made", dev.cached(("fix51", "made"), lambda: -1)),
        daemon=True,
    )
    reader.start()
    reader.join(5)
    stalled = reader.is_alive()
    release.set()
    builder.join(10)
    reader.join(10)
    assert not stalled, "a lookup of a made entry waited for another key's make()"
    assert out == {"made": 41, "slow": "slow"}


def test_cached_same_key_raced_is_built_once(device):
    import threading

    dev = _fresh_device(device)
    calls, gate, results = [], threading.Barrier(6), []

    def make():
        calls.append(1)
        import time

        time.sleep(0.2)  # the others arrive meanwhile
        return object()

    def work():
        gate.wait(10)
        results.append(dev.cached(("fix51", "raced"), make))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(calls) == 1 and len(results) == 6
    assert all(r is results[0] for r in results)


def test_cached_nested_and_failing_make(device):
    """A make() may use (and make) other entries; a failing make() leaves the key unmade,
    built by the next call."""
    dev = _fresh_device(device)
    outer = dev.cached(("fix51", "outer"), lambda: dev.cached(("fix51", "inner"), lambda: 2) + 1)
    assert outer == 3 and dev.cached(("fix51", "inner"), lambda: -1) == 2

    def boom():
        raise RuntimeError("make failed")

    with pytest.raises(RuntimeError, match="make failed"):
        dev.cached(("fix51", "fails"), boom)
    assert dev.cached(("fix51", "fails"), lambda: 7) == 7


# --- pydiff.tensor(t): a copy on the device, in order ---------------------------------------

_SRC = """
import slangpy;
[Differentiable] float f51(float a, float x) { return a * exp(0.5 * x) - x; }
"""
_k = iter(range(10**6))


@pytest.fixture
def held_m(device, monkeypatch):
    from pydiff import generated, generated_hold

    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(generated_hold, "HOLD_FORWARD", True)
    return pydiff.load_module_from_source(f"s51_fix51_{next(_k)}", _SRC, device=device)


def _closed(a, x, g):
    x64 = x.astype(np.float64)
    return a * np.exp(0.5 * x64) - x64, g * (0.5 * a * np.exp(0.5 * x64) - 1.0)


@pytest.mark.parametrize("n", [3000, 40000])
def test_tensor_of_an_unrelated_tensor_keeps_the_forward_held(device, held_m, n):
    """The seed made by pydiff.tensor(gt) after the held call: fused (before: gt read on the
    host, which recorded the forward: two kernels), and the gradient right."""
    from pydiff import generated

    rng = np.random.default_rng(n)
    xs = rng.uniform(-2, 2, n).astype(np.float32)
    g = rng.uniform(-1, 1, n).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    generated.reset_stats()
    with pydiff.Tape() as tape:
        y = held_m.f51(0.75, x)
    assert device.queue.held is not None
    seed = pydiff.tensor(gt)
    assert device.queue.held is not None
    tape.backward(y, grad=seed)
    assert generated.stats().get("forward+backward fused") == 1, generated.stats()
    want_y, want_dx = _closed(0.75, xs, g)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(seed.numpy(), g)


def test_tensor_of_the_held_result_records_the_forward_first(device, held_m):
    rng = np.random.default_rng(7)
    xs = rng.uniform(-2, 2, 3000).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape():
        y = held_m.f51(0.75, x)
        assert device.queue.held is not None
        c = pydiff.tensor(y.detach())  # the held forward writes y: it runs before the copy
        d = pydiff.tensor(y.detach()[1000:2000])  # a view (offset: by the host)
    assert device.queue.held is None
    want, _ = _closed(0.75, xs, xs)
    np.testing.assert_allclose(c.numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d.numpy(), want[1000:2000], rtol=1e-5, atol=1e-5)
    assert not c.requires_grad


@pytest.mark.parametrize(
    "dtype, values",
    [
        ("float", np.linspace(-3, 3, 12, dtype=np.float32)),
        ("half", np.linspace(-3, 3, 12).astype(np.float16)),
        ("int", np.arange(-6, 6, dtype=np.int32)),
        ("float3", np.linspace(-3, 3, 12, dtype=np.float32).reshape(4, 3)),
        ("bool", np.arange(12) % 3 == 0),
    ],
)
def test_tensor_of_a_tensor_after_pending_writes(device, dtype, values):
    """The copy comes after the writes issued before it (a small in-order host write, an op),
    and a later write to t leaves the copy as it was."""
    t = pydiff.tensor(values, dtype=dtype, device=device)
    first = pydiff.tensor(t)
    t.copy_from_numpy(values[::-1].copy())  # pending in the deferred list
    second = pydiff.tensor(t, requires_grad=dtype in ("float", "half", "float3"))
    t.copy_from_numpy(values)
    np.testing.assert_array_equal(first.numpy(), values)
    np.testing.assert_array_equal(second.numpy(), values[::-1])
    assert (second.dtype, second.shape) == (t.dtype, t.shape)
    if dtype == "float":
        s = ops.mul(t, t)  # an op's result, copied before anything reads it on the host
        np.testing.assert_allclose(pydiff.tensor(s).numpy(), values.astype(np.float64) ** 2)
        z = pydiff.tensor(np.float32(2.5), device=device)  # 0-d
        assert pydiff.tensor(z).shape == () and pydiff.tensor(z).item() == 2.5
        # another dtype: converted by the host, as before
        np.testing.assert_array_equal(pydiff.tensor(t, dtype="double").numpy(), values)


def test_tensor_of_a_tensor_inside_a_batch(device):
    """In a batch (a backward's scope) the copy is recorded into the batch's commands, after
    the op that wrote t there."""
    v = np.linspace(-2, 2, 50, dtype=np.float32)
    x = pydiff.tensor(v, device=device)
    token = device.queue.begin_batch()
    try:
        s = ops.mul(x, x)
        c = pydiff.tensor(s)
        ops.mul(s, s).numpy()  # (more work in the batch after the copy)
    finally:
        device.queue.end_batch(token)
    np.testing.assert_allclose(c.numpy(), v.astype(np.float64) ** 2, rtol=1e-6)
