"""Session 51 (break51c): fix51's pydiff.tensor(t) device copy, Device.cached's build lock and
jvp/hvp/hessian's NumPy data, pushed on. References: closed forms, float64 NumPy, the values
written (never pydiff's own output)."""

from __future__ import annotations

import os
import select
import threading
import time

import numpy as np
import pytest

import pydiff
from pydiff import ops


def _fresh_device(device):
    import pydiff.device_state as device_state

    return device_state.Device(device.native, device.type)


# --- Device.cached ---------------------------------------------------------------------------


def test_cached_make_asking_its_own_key_raises(device):
    """make() that asks cached for its own key: before, the re-entrant build lock let it
    recurse (make() called ~500 times, each a compile in real use) into a RecursionError;
    now one call and a RuntimeError naming the key. Other keys inside make() still work."""
    dev = _fresh_device(device)
    calls = []

    def make():
        calls.append(1)
        return dev.cached(("break51c", "self"), make) + 1

    with pytest.raises(RuntimeError, match=r"Device.cached: make\(\) for key .*'self'.* same key"):
        dev.cached(("break51c", "self"), make)
    assert len(calls) == 1
    # the key stays unmade and buildable; nested other keys still fine; other threads too
    assert dev.cached(("break51c", "self"), lambda: 5) == 5
    assert dev.cached(("break51c", "a"), lambda: dev.cached(("break51c", "b"), lambda: 1) + 1) == 2
    out: list = []
    t = threading.Thread(target=lambda: out.append(dev.cached(("break51c", "c"), lambda: 3)))
    t.start()
    t.join(20)
    assert out == [3]


def test_fork_while_another_thread_builds(device):
    """A child forked while a thread of the parent is inside make() (holding the build lock):
    the child's inherited device refuses, a new one works (cached and a device copy)."""
    x = pydiff.tensor(np.ones(4, np.float32), device=device)
    dev = x.device
    entered, release = threading.Event(), threading.Event()

    def slow():
        entered.set()
        release.wait(60)
        return 1

    th = threading.Thread(target=lambda: dev.cached(("break51c", "slow"), slow), daemon=True)
    th.start()
    assert entered.wait(20)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        try:
            try:
                dev.cached(("break51c", "child"), lambda: 2)
                msg = "inherited worked"
            except pydiff.DeviceUnavailableError:
                msg = "inherited refused"
            y = pydiff.tensor(np.arange(4, dtype=np.float32))
            v = y.device.cached(("break51c", "c2"), lambda: 5)
            msg += f";{v};{pydiff.tensor(ops.mul(y, y)).numpy().tolist()}"
        except BaseException as e:
            msg = f"child error {type(e).__name__}: {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    out, t0 = b"", time.time()
    try:
        while time.time() - t0 < 120:
            if select.select([r], [], [], 1)[0]:
                chunk = os.read(r, 4096)
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(r)
        if os.waitpid(pid, os.WNOHANG)[0] == 0:
            time.sleep(2)
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
        release.set()
        th.join(20)
    assert out.decode() == "inherited refused;5;[0.0, 1.0, 4.0, 9.0]", out


# --- pydiff.tensor(t) ------------------------------------------------------------------------


def test_tensor_copy_of_tape_values_is_detached(device):
    """torch.tensor(t) semantics: the copy has no gradient path; the tape's gradient through
    t itself is unchanged. f = sum(x^2 * c), c = copy of x^2 (held fixed): df/dx = 2 x c = 2 x^3."""
    v = np.linspace(-2, 2, 50, dtype=np.float32)
    x = pydiff.tensor(v, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        y = ops.mul(x, x)
        c = pydiff.tensor(y.detach())
        z = ops.sum(ops.mul(y, c))
    tape.backward(z)
    v64 = v.astype(np.float64)
    assert not c.requires_grad
    np.testing.assert_allclose(c.numpy(), v64**2, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 2 * v64**3, rtol=1e-5, atol=1e-5)
    g = pydiff.tensor(x.grad)  # a leaf's gradient, copied
    x.grad.copy_from_numpy(np.zeros(50, np.float32))  # written after: the copy keeps its values
    np.testing.assert_allclose(g.numpy(), 2 * v64**3, rtol=1e-5, atol=1e-5)
    r = pydiff.tensor(y, requires_grad=True)  # a new leaf: sum(r^2)' = 2 r
    with pydiff.Tape() as t2:
        s = ops.sum(ops.mul(r, r))
    t2.backward(s)
    np.testing.assert_allclose(r.grad.numpy(), 2 * v64**2, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype, values",
    [
        ("double", np.linspace(-1, 1, 7) / 3),
        ("int64", np.arange(-3, 4, dtype=np.int64) * 10**12),
        ("uint8", np.array([0, 1, 127, 128, 254, 255, 7], np.uint8)),
        ("int16", np.arange(-3, 4, dtype=np.int16)),
        ("half", np.linspace(-3, 3, 7).astype(np.float16)),
        ("uint", np.arange(7, dtype=np.uint32) + 4_000_000_000),
    ],
)
def test_tensor_copy_dtypes_odd_sizes(device, dtype, values):
    """Every dtype, odd byte counts (7 bytes of uint8, 14 of half): the copy's bytes exact,
    and independent of later writes to t."""
    t = pydiff.tensor(values, dtype=dtype, device=device)
    c = pydiff.tensor(t)
    t.copy_from_numpy(values[::-1].copy())
    assert (c.dtype, c.shape) == (t.dtype, t.shape)
    np.testing.assert_array_equal(c.numpy(), values)


def test_tensor_copy_source_dropped_and_cache_emptied(device):
    v = np.linspace(-2, 2, 3000, dtype=np.float32)
    a = ops.mul(pydiff.tensor(v, device=device), pydiff.tensor(v, device=device))
    c = pydiff.tensor(a)
    del a
    pydiff.empty_cache()
    for _ in range(5):  # reuse of the freed buffers
        ops.mul(pydiff.tensor(3 * v, device=device), pydiff.tensor(v, device=device))
    np.testing.assert_allclose(c.numpy(), v.astype(np.float64) ** 2, rtol=1e-6)


# --- jvp / hvp / hessian with NumPy data -----------------------------------------------------

W = np.array([1.0, 2.0, -0.5])
U = np.array([1.0, -1.0, 2.0])


@pytest.mark.parametrize(
    "a",
    [np.array(2.0), np.array([1, 2, 3], np.float16), np.array([2**40, 1, 2]), [1.0, 2.0, 3.0]],
)
def test_numpy_data_kinds(a):
    """f = sum(w^2 a): jvp 2 w a u, hvp 2 a u, hessian d2f/dw2 = diag(2 a) (a 0-d array,
    half values, int64 beyond int32 passed on to the op as floats, a list)."""
    a64 = np.broadcast_to(np.asarray(a, np.float64), (3,))
    f = lambda w, a: ops.sum(ops.mul(ops.mul(w, w), a))  # noqa: E731
    _, dy = pydiff.jvp(lambda w, a: ops.mul(ops.mul(w, w), a), (W, a), (U, None))
    np.testing.assert_allclose(dy.numpy(), 2 * W * U * a64, rtol=1e-6)
    np.testing.assert_allclose(pydiff.hvp(f, (W, a), (U, None))[0], 2 * a64 * U, rtol=1e-6)
    H = np.asarray(pydiff.hessian(f, (W, a)))  # float data is differentiated too: [w, a]
    np.testing.assert_allclose(H[:3, :3], np.diag(2 * a64), rtol=1e-6)
    if H.shape[0] > 3:  # d2f/dw da = 2 w (per element, or summed for a 0-d a), d2f/da2 = 0
        cross = np.diag(2 * W) if np.ndim(a) else 2 * W[:, None]
        np.testing.assert_allclose(H[:3, 3:], cross, rtol=1e-6)
        np.testing.assert_allclose(H[3:, 3:], 0, atol=1e-6)
    else:
        assert H.shape == (3, 3)


@pytest.mark.parametrize(
    "a, match",
    [
        (np.array([True, False, True]), "booleans"),
        (np.array([1.0, None, 2.0], dtype=object), "dtype object"),
    ],
)
def test_numpy_data_refused_clearly(a, match):
    with pytest.raises(TypeError, match=match):
        pydiff.jvp(lambda w, a: ops.mul(w, a), (W, a), (U, None))
    with pytest.raises(TypeError, match=match):
        pydiff.hvp(lambda w, a: ops.sum(ops.mul(w, a)), (W, a), (U, None))


@pytest.mark.parametrize("what", ["jvp", "hvp", "hessian"])
def test_empty_float_primal_named(what):
    """A zero-size float array differentiated: refused naming the transform and the primal
    (before: 'pydiff.tensor: data has shape (0,)', naming neither)."""
    e = np.zeros(0)
    f = lambda w, a: ops.sum(ops.mul(w, w))  # noqa: E731
    with pytest.raises(ValueError, match=rf"^{what}: primal 1 has shape \(0,\), with no elements"):
        if what == "jvp":
            pydiff.jvp(lambda w, a: ops.mul(w, w), (W, e), (U, e))
        elif what == "hvp":
            pydiff.hvp(f, (W, e), (U, e))
        else:
            pydiff.hessian(f, (W, e))
