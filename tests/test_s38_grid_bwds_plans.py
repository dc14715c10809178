""".bwds over a grid takes call plans (pydiff.grid_plan): a repeated small grid ``.bwds``
skips the full path's checks (227 -> 35 us a call for a 4x4 stencil on lavapipe, raw SlangPy
52 us) and is deferred like other SlangPy calls. Gradients stay right against NumPy's
float64 adjoints at every call as inputs and upstreams change, and whatever a plan cannot
decide (aliasing, stale inputs, policies, deterministic mode, out-of-range numbers, large
grids) takes the full path with its checks."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated, written_mask
from pydiff.errors import StaleGradientError, StaleInputError
from pydiff.grid_plan import GridBackwardPlan
from test_s37_grid_plans import SOURCE as GRID_SOURCE  # (poly and blur over grids)

pytestmark = pytest.mark.usefixtures("auto_sizes")  # plans of small calls, in every mode

SOURCE = (
    GRID_SOURCE
    + """
[Differentiable]
void mix(int idx, IDiffTensor<float, 1> a, IDiffTensor<float, 1> b, ITensor<float, 1> w,
         IWDiffTensor<float, 1> y)
{ y[idx] = w[idx] * a[idx] * b[idx]; }
"""
)


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s38_grid_bwds_plans", SOURCE, device=device)


def _planned(fn) -> bool:
    return any(type(p) is GridBackwardPlan for p in fn.bwds_plans.values())


def _blur_adjoint(g: np.ndarray) -> np.ndarray:
    """d/d img of sum(g * blur(img)), blur(img)[r] = 0.75 img[r] + 0.25 img[min(r+1, h-1)]."""
    out = 0.75 * g
    h = g.shape[0]
    for r in range(h):
        out[min(r + 1, h - 1)] += 0.25 * g[r]
    return out


def _blur_of(img: np.ndarray) -> np.ndarray:
    img = img.astype(np.float64)
    return 0.75 * img + 0.25 * np.concatenate([img[1:], img[-1:]], axis=0)


def test_repeated_grid_bwds_planned_and_accumulating(device, mod):
    rng = np.random.default_rng(38)
    ims = rng.standard_normal((4, 6)).astype(np.float32)
    img = pydiff.tensor(ims, device=device, requires_grad=True)
    out = pydiff.zeros((4, 6), device=device).with_grads()
    xs = rng.standard_normal(9).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((9,), device=device).with_grads()
    want_img = np.zeros((4, 6))
    want_x = np.zeros(9)
    for i in range(300):  # past DEFER_MAX: submissions in between
        g = rng.standard_normal((4, 6)).astype(np.float32)
        out.grad_in.copy_from_numpy(g)
        mod.blur.bwds(spy.grid((4, 6)), img, out)
        want_img += _blur_adjoint(g.astype(np.float64))
        gy = rng.standard_normal(9).astype(np.float32)
        y.grad_in.copy_from_numpy(gy)
        a = float(i % 5) - 2.0
        mod.poly.bwds(spy.grid((9,)), a, x, y)
        want_x += 2 * a * xs.astype(np.float64) * gy
        if i % 60 == 0:
            np.testing.assert_allclose(img.grad.numpy(), want_img, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(x.grad.numpy(), want_x, rtol=1e-4, atol=1e-4)
    assert _planned(mod.blur) and _planned(mod.poly)
    np.testing.assert_allclose(img.grad.numpy(), want_img, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), want_x, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out.grad_in.numpy(), g)  # the upstream is read, not changed


def test_read_without_gradient_and_plain_tensor(device, mod):
    rng = np.random.default_rng(1)
    av, bv, wv = (rng.standard_normal(7).astype(np.float32) for _ in range(3))
    a = pydiff.tensor(av, device=device, requires_grad=True)
    b = pydiff.tensor(bv, device=device)  # no gradient wanted: a throwaway buffer
    w = pydiff.tensor(wv, device=device)
    y = pydiff.zeros((7,), device=device).with_grads(ones=True)
    for _ in range(4):
        mod.mix.bwds(spy.grid((7,)), a, b, w, y)
    assert _planned(mod.mix)
    want = 4 * wv.astype(np.float64) * bv
    np.testing.assert_allclose(a.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    assert b.grad is None


def test_stale_input_refused_after_planning(device, mod):
    xs = np.linspace(-1, 1, 11).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((11,), device=device).with_grads(ones=True)
    mod.poly(spy.grid((11,)), 2.0, x, y)
    for _ in range(3):
        mod.poly.bwds(spy.grid((11,)), 2.0, x, y)
    assert _planned(mod.poly)
    np.testing.assert_allclose(x.grad.numpy(), 3 * 4.0 * xs.astype(np.float64), rtol=1e-6)
    x.copy_from_numpy(xs * 2)  # written since the call that made y
    with pytest.raises(StaleInputError):
        mod.poly.bwds(spy.grid((11,)), 2.0, x, y)


def test_shared_upstream_and_aliasing_take_the_full_path(device, mod):
    xs = np.linspace(0.5, 1.5, 5).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((5,), device=device).with_grads(ones=True)
    mod.poly.bwds(spy.grid((5,)), 1.0, x, y)
    mod.poly.bwds(spy.grid((5,)), 1.0, x, y)
    assert _planned(mod.poly)
    g = x.grad
    shared = pydiff.zeros((5,), device=device).with_grads(grad_in=g, grad_out=g)
    with pytest.raises(ValueError, match="gradient buffer"):
        mod.poly.bwds(spy.grid((5,)), 1.0, x, shared)
    # the read tensor written by the same call: as a fresh module (no plan) does
    fresh = pydiff.load_module_from_source("s38_grid_bwds_fresh", SOURCE, device=device)
    outcomes = []
    for m in (mod, fresh):
        z = pydiff.tensor(xs, device=device, requires_grad=True)
        try:
            m.poly.bwds(spy.grid((5,)), 1.0, z, z)
            outcomes.append(("ran", z.grad.numpy().tolist()))
        except Exception as exc:  # noqa: BLE001 - the outcome is compared, not chosen
            outcomes.append((type(exc).__name__, None))
    assert outcomes[0] == outcomes[1]


def test_policies_and_deterministic_mode(device, mod):
    xs = np.linspace(-1, 1, 6).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((6,), device=device).with_grads(ones=True)
    for _ in range(2):
        mod.poly.bwds(spy.grid((6,)), 3.0, x, y)
    assert _planned(mod.poly)
    x.zero_grad()
    mod.poly.bwds(spy.grid((6,)), 3.0, x, y)  # planned: marks the gradient as a result
    with pydiff.zero_policy("strict"):
        with pytest.raises(StaleGradientError):
            mod.poly.bwds(spy.grid((6,)), 3.0, x, y)
    one = 6.0 * xs.astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), one, rtol=1e-6)
    x.zero_policy = "reset"  # each backward starts from zero
    for _ in range(3):
        mod.poly.bwds(spy.grid((6,)), 3.0, x, y)
    np.testing.assert_allclose(x.grad.numpy(), one, rtol=1e-6)
    x.zero_policy = None
    with pydiff.deterministic(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its IDiffTensor gradients use float atomics)
        x.zero_grad()
        mod.poly.bwds(spy.grid((6,)), 3.0, x, y)
        mod.poly.bwds(spy.grid((6,)), 3.0, x, y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * one, rtol=1e-6)


def test_numbers_out_of_range_refused_after_planning(device, mod):
    x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((4,), device=device).with_grads(ones=True)
    for _ in range(2):
        mod.poly.bwds(spy.grid((4,)), 1.0, x, y)
    assert _planned(mod.poly)
    for bad in (1e39, -1e39):  # (NaN passes, as on the full path)
        with pytest.raises(ValueError, match="parameter 'a'"):
            mod.poly.bwds(spy.grid((4,)), bad, x, y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * 2.0 * np.ones(4), rtol=1e-6)


def test_large_grids_make_no_plan(device, mod):
    n = generated.MIN_ELEMENTS
    x = pydiff.tensor(np.ones(n, np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device).with_grads(ones=True)
    mod.poly.bwds(spy.grid((n,)), 1.0, x, y)
    mod.poly.bwds(spy.grid((n,)), 1.0, x, y)
    assert not _planned(mod.poly)
    np.testing.assert_allclose(x.grad.numpy(), 4.0 * np.ones(n), rtol=1e-6)


def test_threads_each_on_their_tensors(device, mod):
    rng = np.random.default_rng(5)
    data = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(4)]
    ups = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(4)]
    errors = []

    def work(k: int) -> None:
        try:
            img = pydiff.tensor(data[k], device=device, requires_grad=True)
            out = pydiff.zeros((4, 6), device=device).with_grads()
            out.grad_in.copy_from_numpy(ups[k])
            for _ in range(40):
                mod.blur.bwds(spy.grid((4, 6)), img, out)
            want = 40 * _blur_adjoint(ups[k].astype(np.float64))
            np.testing.assert_allclose(img.grad.numpy(), want, rtol=1e-4, atol=1e-4)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_grid_calls_on_a_tape_take_plans_and_stay_right(device, mod, monkeypatch):
    full_paths = []
    real = written_mask.stored_once
    monkeypatch.setattr(written_mask, "stored_once", lambda *a: full_paths.append(1) or real(*a))
    rng = np.random.default_rng(7)
    ims = rng.standard_normal((4, 6)).astype(np.float32)
    img = pydiff.tensor(ims, device=device, requires_grad=True)
    want = np.zeros((4, 6))
    for i in range(60):
        g = rng.standard_normal((4, 6)).astype(np.float32)
        out = pydiff.zeros((4, 6), device=device)
        with pydiff.Tape() as tape:
            mod.blur(spy.grid((4, 6)), img, out)
        tape.backward(out, grad=g)
        want += _blur_adjoint(g.astype(np.float64))
        if i % 20 == 0:
            np.testing.assert_allclose(out.numpy(), _blur_of(ims), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(img.grad.numpy(), want, rtol=1e-4, atol=1e-4)
    assert _planned(mod.blur)
    assert len(full_paths) == 1  # the tape's later backwards took the grid plan
    assert any(getattr(p, "on_tape", False) for p in mod.blur.plans.values())


def test_grid_plan_in_a_tape_backward_keeps_the_policies(device, mod):
    xs = np.linspace(-1, 1, 8).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    one = 2 * 1.5 * xs.astype(np.float64)

    def step() -> None:
        y = pydiff.zeros((8,), device=device)
        with pydiff.Tape() as tape:
            mod.poly(spy.grid((8,)), 1.5, x, y)
        tape.backward(y, grad=np.ones(8, np.float32))

    for _ in range(3):
        step()
    assert _planned(mod.poly)
    np.testing.assert_allclose(x.grad.numpy(), 3 * one, rtol=1e-5)
    with pydiff.zero_policy("reset"):
        step()
        step()
    np.testing.assert_allclose(x.grad.numpy(), one, rtol=1e-5)
    with pydiff.zero_policy("strict"):
        with pytest.raises(StaleGradientError):
            step()
    np.testing.assert_allclose(x.grad.numpy(), one, rtol=1e-5)  # refused: nothing changed


def test_small_host_writes_keep_order_without_submitting(device, mod):
    """A small copy_from_numpy is recorded after the pending calls (which read the values
    before it), not submitted after them; the values each call read stay right."""
    x = pydiff.tensor(np.zeros(9, np.float32), device=device)
    ys = [pydiff.zeros((9,), device=device) for _ in range(40)]
    rng = np.random.default_rng(3)
    sent = []
    mod.poly(spy.grid((9,)), 1.0, x, ys[0])  # (a plan from here on)
    device.wait()
    before = device.queue.submissions
    for y in ys:
        xs = rng.standard_normal(9).astype(np.float32)
        x.copy_from_numpy(xs)
        mod.poly(spy.grid((9,)), 2.0, x, y)
        sent.append(xs)
    assert device.queue.submissions - before <= 1  # (none per write: DEFER_MAX is far)
    for y, xs in zip(ys, sent):
        np.testing.assert_allclose(y.numpy(), 2.0 * xs.astype(np.float64) ** 2 + 1, rtol=1e-6)
