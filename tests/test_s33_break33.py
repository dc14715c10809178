"""Breaker break33: today's large-buffer pool and plain calls (no ``_result``) on the generated
kernels, attacked as a user would meet them.

Failing (bugs, left for a fix):

- a large call of an overloaded function takes the generated kernel, which calls the float
  overload whatever the Python value: ``m.h(2, x)`` returns ``2 * x`` for 8,196 elements
  while the same call of 16 elements raises SlangPy's TypeError (and the docs say SlangPy
  picks the overload from the value as given: the int one, ``100 + x``); ``.bwds`` likewise
  adds the float overload's gradient;
- the large pool's trim keeps the free buffers of the *oldest* sizes and releases the ones
  just used: a large size used every step is made anew every step while sizes never used
  again hold their memory until ``empty_cache()`` (its docstring: "a large size that comes
  back finds one; sizes no longer used give their memory back");
- ``large_bytes`` keeps the bytes of released buffers for good when ``POOL_MAX_FLOAT4S``
  changes while the pool holds buffers (sizes are classed by the bound at release time).

Passing (regressions worth keeping): zeros, ``zeros_like`` and new gradient buffers on a
reused large buffer that held NaN; sums over a tensor whose reused buffer's padding holds NaN;
the kinds of small plain calls before and after their plan switches to generated kernels;
``empty_cache()`` after large work in another thread leaves no large buffer tracked.
Values are checked against float64 NumPy / closed forms.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import pydiff
from pydiff import buffer_pool, ops

OVERLOADED = """
float h(int a, float x) { return 100.0 + x; }
float h(float a, float x) { return a * x; }
[Differentiable] float d(int a, float x) { return x * x; }
[Differentiable] float d(float a, float x) { return a * x; }
"""
LARGE_CALL = 8192 + 4  # past generated.MIN_ELEMENTS (4096)


@pytest.fixture
def overloaded(device):
    return pydiff.load_module_from_source("s33_break33_overloads", OVERLOADED, device=device)


def test_a_large_call_of_an_overloaded_function_keeps_slangpys_choice(overloaded, device):
    """generated_coverage.uncovered never asks whether the name is overloaded (call_plan's
    _plannable does): the generated kernel calls h(float, float) for the int 2."""
    small = pydiff.tensor(np.linspace(0, 1, 16, dtype=np.float32), device=device)
    with pytest.raises(TypeError):  # SlangPy's path: the overloads are not resolved
        overloaded.h(2, small)
    xs = np.linspace(0, 1, LARGE_CALL, dtype=np.float32)
    x = pydiff.tensor(xs, device=device)
    try:
        got = overloaded.h(2, x).numpy()
    except TypeError:
        return  # as the 16-element call: right
    # otherwise the overload an int picks (docs: SlangPy picks it from the value as given)
    np.testing.assert_allclose(got, 100.0 + xs.astype(np.float64), rtol=1e-6)


def test_a_large_bwds_of_an_overloaded_function_keeps_slangpys_choice(overloaded, device):
    xs = np.linspace(0, 1, LARGE_CALL, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    upstream = pydiff.zeros((LARGE_CALL,), device=device).with_grads(ones=True)
    try:
        overloaded.d.bwds(2, x, _result=upstream)
    except TypeError:
        return  # as SlangPy's path (16 elements) does
    # d(int a, float x) = x * x: the gradient 2x (the float overload's would be a = 2)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * xs.astype(np.float64), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# the large pool's trim


class _CountingDevice:
    """The SlangPy device, counting the buffers created through it."""

    def __init__(self, native):
        self._native, self.created = native, 0

    def create_buffer(self, **kwargs):
        self.created += 1
        return self._native.create_buffer(**kwargs)

    def __getattr__(self, name):
        return getattr(self._native, name)


@pytest.fixture
def small_classes(monkeypatch):
    """Above 64 float4s a buffer counts as large; 400 float4s of free large buffers kept."""
    monkeypatch.setattr(buffer_pool, "POOL_MAX_FLOAT4S", 64)
    monkeypatch.setattr(buffer_pool, "POOL_MAX_BYTES", 16 * 256)
    monkeypatch.setattr(buffer_pool, "LARGE_POOL_MAX_BYTES", 16 * 1000)
    monkeypatch.setattr(buffer_pool, "LARGE_POOL_MAX_PER_SIZE", 4)
    monkeypatch.setattr(buffer_pool, "LARGE_POOL_MAX_FREE_BYTES", 16 * 400)


def test_a_large_size_used_every_step_keeps_its_buffer_over_sizes_gone(device, small_classes):
    """Two sizes used once (390 of the 400 free float4s), then a step that uses size 100 and
    one new size (a last batch of another length, a shape seen once). _trim_free_large keeps
    free buffers in the dict's insertion order (buffer_pool.py:127-154): the stale sizes
    stay, size 100 is released at every step and made again."""
    counting = _CountingDevice(device.native)
    pool = buffer_pool.BufferPool(counting, device.queue)
    stale = [pool.float4_buffer(n) for n in (190, 200)]
    del stale
    hot = pool.float4_buffer(100)
    del hot
    made = counting.created
    for step in range(4):
        hot = pool.float4_buffer(100)  # the size every step uses
        del hot
        once = pool.float4_buffer(101 + step)  # a size never seen again
        del once
    remade = counting.created - made - 4  # (the 4 sizes seen once are new, rightly)
    assert remade == 0, f"size 100 was made again at {remade} of 4 steps"
    assert 190 not in pool._buffers and 200 not in pool._buffers  # sizes gone, memory back


def test_large_bytes_return_to_zero_after_the_small_class_bound_changes(device, monkeypatch):
    """docs/ops-and-optimizers.md names POOL_MAX_FLOAT4S as the small class's bound (and the
    brief for this pool's tests lowers it on a live device). prune and _trim_free_large
    classify each size by the bound *now* (buffer_pool.py:133, 160, 166), not by the class it
    was counted in when kept: a buffer kept as large and released as small leaves its bytes
    in large_bytes for good (phantom bytes eat the large budget; bytes - large_bytes, the
    small class's, goes negative)."""
    pool = buffer_pool.BufferPool(device.native, device.queue)
    kept = pool.float4_buffer(buffer_pool.POOL_MAX_FLOAT4S + 4096)  # large when kept
    assert pool.large_bytes == kept.size
    del kept
    monkeypatch.setattr(buffer_pool, "POOL_MAX_FLOAT4S", 1 << 20)  # raised at run time
    pool.prune()
    assert pool.sizes() == {"buffers": 0, "bytes": 0}
    assert pool.large_bytes == 0  # got: the released buffer's 4,259,840 bytes


# --------------------------------------------------------------------------------------------
# passing regressions

F4 = (1 << 18) + 7  # float4s: just past POOL_MAX_FLOAT4S, a large buffer


def _poison(device, k: int = 3) -> None:
    """Leave ``k`` free large buffers of F4 float4s in the pool, full of NaN."""
    held = [pydiff.tensor(np.full(4 * F4, np.nan, np.float32), device=device) for _ in range(k)]
    device.flush()
    del held


def test_zeros_and_new_gradients_on_a_reused_large_buffer_are_zero(device):
    n = 4 * F4 - 3  # same float4 count: the NaN buffers are reused
    _poison(device)
    z = pydiff.zeros((n,), device=device)
    assert not np.any(z.numpy())
    _poison(device)
    like = pydiff.zeros_like(z)
    assert not np.any(like.numpy())
    _poison(device)
    x = pydiff.empty((n,), device=device, requires_grad=True)
    assert not np.any(x.grad.numpy())
    assert device.pool.large_bytes > 0  # (the pool kept them: the reuse was exercised)


def test_sums_ignore_the_padding_of_a_reused_large_buffer(device):
    n = 4 * F4 - 3  # the last float4's 3 padding lanes hold NaN from the poisoned buffer
    xs = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    _poison(device)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        loss = ops.sum(ops.relu(x))
    _poison(device)
    tape.backward(loss)
    np.testing.assert_allclose(
        float(loss.numpy()), np.maximum(xs.astype(np.float64), 0).sum(), rtol=1e-4
    )
    np.testing.assert_array_equal(x.grad.numpy(), (xs > 0).astype(np.float32))


SMALL = """
[Differentiable] float s33_poly(float a, float b, float x) { return a * x * x + b * x - 1.0; }
"""


def test_small_plain_calls_keep_their_result_kind_once_planned(device, soon):
    mod = pydiff.load_module_from_source("s33_break33_small", SMALL, device=device)
    xs = np.linspace(-2, 2, 16, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    zero_d = pydiff.tensor(np.float32(1.5), device=device)
    one = pydiff.tensor(np.array([1.5], np.float32), device=device)
    want = 2.0 * xs.astype(np.float64) ** 2 - xs - 1.0
    for _ in range(7):  # before and after the switch
        y = mod.s33_poly(2.0, -1.0, x)
        assert type(y) is pydiff.Tensor and y.shape == (16,) and not y.requires_grad
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-6)
        assert mod.s33_poly(1.0, 2.0, 3.0) == pytest.approx(14.0)  # numbers: a number
        for args, shape in (((zero_d, zero_d, zero_d), ()), ((zero_d, 1.0, 2.0), ())):
            r = mod.s33_poly(*args)
            assert type(r) is pydiff.Tensor and r.shape == shape
        r = mod.s33_poly(one, one, one)
        assert type(r) is pydiff.Tensor and r.shape == (1,)
        np.testing.assert_allclose(r.numpy(), [1.5**3 + 1.5**2 - 1.0], rtol=1e-6)


def test_empty_cache_after_large_work_in_another_thread_tracks_no_large_buffer(device):
    mod = pydiff.load_module_from_source("s33_break33_thread", SMALL, device=device)
    n = (1 << 20) + 12
    xs = np.linspace(-1, 1, n, dtype=np.float32)

    errors: list = []

    def work():
        try:
            run()
        except Exception as exc:  # (a thread's exception would not fail the test)
            errors.append(exc)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        a = pydiff.tensor(np.array([1.5], np.float32), device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            loss = ops.sum(mod.s33_poly(a, 0.5, x))
        tape.backward(loss)
        x64 = xs.astype(np.float64)
        np.testing.assert_allclose(a.grad.numpy(), [np.sum(x64**2)], rtol=1e-4)

    gc.collect()
    device.empty_cache()
    in_use = device.pool.large_bytes  # (what earlier tests of the session keep)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    device.empty_cache()
    assert device.pool.large_bytes <= in_use
