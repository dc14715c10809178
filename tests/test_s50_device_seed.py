"""``tape.backward(y, grad=g)`` with ``g`` a pydiff tensor: copied into y's gradient on the
device (no read back to the host, and the fused forward + backward kept), or read on the host
where it cannot be (another layout, a view, a capture). Every gradient against float64
closed forms; the seed's values are those ``g`` held at the call, whatever is written to it
after."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_hold, ops

SOURCE = """
import slangpy;
[Differentiable] float ds_poly(float a, float x) { return a * x * x + sin(x); }
[Differentiable] float3 ds_shade(float3 n, float k) { return float3(k) * n * n; }
"""
_names = itertools.count()


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source(f"s50_seed{next(_names)}", SOURCE, device=device)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-2, 2, n).astype(np.float32), rng.uniform(-1, 1, n).astype(np.float32)


def _want(x, g, a=1.5):
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    return g64 * (2 * a * x64 + np.cos(x64))


def _tape(m, xt, g):
    with pydiff.Tape() as tape:
        y = m.ds_poly(1.5, xt)
    tape.backward(y, grad=g)
    return y


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("n", [1000, 2**16 + 3])
def test_tensor_seed_gives_the_gradient(device, m, monkeypatch, hold, n):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 4096)
    monkeypatch.setattr(generated_hold, "HOLD_FORWARD", hold)
    x, g = _data(n, 1)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    generated.reset_stats()
    _tape(m, xt, pydiff.tensor(g, device=device))
    np.testing.assert_allclose(xt.grad.numpy(), _want(x, g), rtol=1e-5, atol=1e-5)
    fused = generated.stats().get("forward+backward fused", 0)
    assert fused == (1 if hold and n > 4096 else 0), generated.stats()


def test_tensor_seed_values_are_those_at_the_call(device, m):
    """A write into g after tape.backward (host and device) does not reach the seed."""
    x, g = _data(2**15, 2)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gt = pydiff.tensor(g, device=device)
    _tape(m, xt, gt)
    gt.copy_from_numpy(np.full_like(g, 7.0))
    gt.fill(3.0)
    np.testing.assert_allclose(xt.grad.numpy(), _want(x, g), rtol=1e-5, atol=1e-5)


def test_seed_written_by_pending_work_before_the_call(device, m):
    """g made by an op just before (deferred on the device): the seed is its result."""
    x, g = _data(2**15, 3)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    g2 = ops.mul(pydiff.tensor(g, device=device), pydiff.tensor(g, device=device))
    _tape(m, xt, g2)
    np.testing.assert_allclose(
        xt.grad.numpy(), _want(x, g.astype(np.float64) ** 2), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("n", [1000, 2**16])
def test_output_as_its_own_seed(device, m, n):
    """grad=y: the seed is y's values (the forward's result, not a held-back buffer)."""
    x, _ = _data(n, 4)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.ds_poly(1.5, xt)
    tape.backward(y, grad=y)
    x64 = x.astype(np.float64)
    yv = 1.5 * x64**2 + np.sin(x64)
    np.testing.assert_allclose(xt.grad.numpy(), _want(x, yv), rtol=1e-4, atol=1e-4)


def test_strided_view_seed_read_on_the_host(device, m):
    x, _ = _data(2**14, 5)
    big = np.random.default_rng(6).uniform(-1, 1, 2**15).astype(np.float32)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    gview = pydiff.tensor(big, device=device)[1::2]
    _tape(m, xt, gview)
    np.testing.assert_allclose(xt.grad.numpy(), _want(x, big[1::2]), rtol=1e-5, atol=1e-5)


def test_seed_of_another_shape_or_dtype_still_refused(device, m):
    x, g = _data(64, 7)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.ds_poly(1.5, xt)
    with pytest.raises(ValueError, match="shape"):
        tape.backward(y, grad=pydiff.tensor(g[:32], device=device))
    tape.backward(y, grad=pydiff.tensor(g.astype(np.float64), device=device, dtype="double"))
    np.testing.assert_allclose(xt.grad.numpy(), _want(x, g), rtol=1e-5, atol=1e-5)


def test_float3_seed(device, m):
    rng = np.random.default_rng(8)
    nv, gv = rng.uniform(-1, 1, (3000, 3)), rng.uniform(-1, 1, (3000, 3))
    nt = pydiff.tensor(nv.astype(np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.ds_shade(nt, 2.0)
    gt = pydiff.tensor(gv.astype(np.float32), device=device, dtype="float3")
    tape.backward(y, grad=gt)
    want = gv * 4.0 * nv.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(nt.grad.numpy().reshape(-1, 3), want, rtol=1e-5, atol=1e-5)


def test_two_calls_on_the_tape(device, m):
    x, g = _data(2**13, 9)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.ds_poly(1.5, xt)
        z = ops.mul(y, y)
    tape.backward(z, grad=pydiff.tensor(g, device=device))
    x64 = x.astype(np.float64)
    yv = 1.5 * x64**2 + np.sin(x64)
    np.testing.assert_allclose(xt.grad.numpy(), _want(x, 2 * yv * g), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["accumulate", "reset"])
def test_a_leaf_gradient_as_the_seed(device, m, policy):
    """grad=x.grad of the leaf itself: the seed is what it held at the call (the backward
    then resets or adds into it)."""
    x, _ = _data(2**13, 10)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    xt.grad.fill(0.5)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            y = m.ds_poly(1.5, xt)
        tape.backward(y, grad=xt.grad)
    want = _want(x, np.full(x.shape, 0.5)) + (0.5 if policy == "accumulate" else 0.0)
    np.testing.assert_allclose(xt.grad.numpy(), want, rtol=1e-5, atol=1e-5)


def test_an_intermediate_gradient_as_the_seed(device, m):
    """docs/tape.md's chained tapes: ``first.backward(h, grad=h.grad)``."""
    x, _ = _data(2**12, 11)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    with pydiff.Tape() as first:
        h = m.ds_poly(1.5, xt)
    with pydiff.Tape(reads_other_tapes=True) as second:
        loss = ops.sum(ops.mul(h, h))
    xt.zero_grad()
    with pydiff.zero_policy("accumulate"):
        second.backward(loss)
        first.backward(h, grad=h.grad)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(
        xt.grad.numpy(), _want(x, 2 * (1.5 * x64**2 + np.sin(x64))), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("n", [1000, 2**16 + 3])
def test_float32_numpy_seed_taken_as_is_and_copied_at_the_call(device, m, n):
    """A float32 NumPy seed of a float output skips the float64 round trip: the same
    gradient, and writing into the array after the call changes nothing."""
    x, g = _data(n, 12)
    keep = g.copy()
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    _tape(m, xt, g)
    g[:] = 9.0
    np.testing.assert_allclose(xt.grad.numpy(), _want(x, keep), rtol=1e-5, atol=1e-5)


def test_float32_seed_with_nan_and_inf_taken_as_given(device, m):
    x = np.array([0.5, 1.0, -1.0, 2.0], np.float32)
    g = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    _tape(m, xt, g)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(xt.grad.numpy(), _want(x, g), rtol=1e-5)
