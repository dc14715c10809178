"""Small repeated calls on SlangPy's kernels join the device's deferred list (``append_to``)
instead of each submitting: a call plan's forward call with a tensor given as ``_result`` (or
of a void function writing its tensors) and a plan's ``.bwds``. The generated kernels are kept
out (``PLANNED_AFTER`` past any test's count, as on a GPU), so these calls take SlangPy's
kernels. Values and gradients against float64 NumPy closed forms; order across submissions
(every 256 commands), host writes, raw SlangPy handles and threads.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pydiff
from pydiff import generated_switch

SOURCE = """
[Differentiable] float s35_poly(float a, float x) { return a * x * x + x; }
[Differentiable] float s35_scale(float a, float x) { return a * x; }
[Differentiable] void s35_out(float a, float x, out float y) { y = a * x + 1.0; }
"""


@pytest.fixture
def mod(device, monkeypatch):
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER", 1 << 40)
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER_ON_GPU", 1 << 40)
    return pydiff.load_module_from_source("s35_deferred", SOURCE, device=device)


def _x(device, n=16, grads=False):
    values = np.linspace(-2.0, 3.0, n).astype(np.float32)
    x = pydiff.tensor(values, device=device)
    return (x.with_grads() if grads else x), values.astype(np.float64)


def test_planned_call_is_deferred_not_submitted(mod, device):
    x, xv = _x(device)
    y = pydiff.zeros((16,), device=device)
    mod.s35_poly(2.0, x, _result=y)  # the full path (makes the plan)
    device.queue.flush()
    mod.s35_poly(3.0, x, _result=y)  # the plan's
    assert device.queue.deferred  # pending, not yet submitted
    np.testing.assert_allclose(y.numpy(), 3.0 * xv * xv + xv, rtol=1e-6, atol=1e-5)
    assert not device.queue.deferred  # the read submitted it


def test_planned_bwds_is_deferred_and_accumulates(mod, device):
    x, xv = _x(device, grads=True)
    y = pydiff.zeros((16,), device=device).with_grads(ones=True)
    mod.s35_poly(2.0, x, _result=y)
    calls = 300  # past DEFER_MAX: more than one submission
    for _ in range(calls):
        mod.s35_poly.bwds(2.0, x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), calls * (4.0 * xv + 1.0), rtol=1e-5, atol=1e-4)


def test_chain_in_order_across_submissions(mod, device):
    x, xv = _x(device)
    y = pydiff.zeros((16,), device=device)
    z = pydiff.zeros((16,), device=device)
    ref = xv.copy()
    cur = x
    for i in range(600):  # y <- poly(a, cur); z <- scale(b, y); cur alternates
        a = 0.5 + (i % 3) * 0.25
        mod.s35_poly(a, cur, _result=y)
        mod.s35_scale(0.1, y, _result=z)
        ref_y = a * ref * ref + ref
        ref = 0.1 * ref_y
        cur = z if i % 2 == 0 else x
        if i % 2 == 1:
            ref = xv.copy()
    np.testing.assert_allclose(z.numpy(), 0.1 * ref_y, rtol=1e-5, atol=1e-4)


def test_host_write_after_a_deferred_call(mod, device):
    x, xv = _x(device)
    y = pydiff.zeros((16,), device=device)
    mod.s35_poly(2.0, x, _result=y)
    mod.s35_poly(2.0, x, _result=y)  # deferred: must not land after the host write below
    y.copy_from_numpy(np.full(16, 7.0, np.float32))
    np.testing.assert_array_equal(y.numpy(), np.full(16, 7.0, np.float32))
    x.copy_from_numpy(np.full(16, 2.0, np.float32))  # read by the next (deferred) call
    mod.s35_poly(1.0, x, _result=y)
    np.testing.assert_allclose(y.numpy(), np.full(16, 6.0), rtol=1e-6, atol=1e-5)


def test_void_function_writing_a_tensor(mod, device):
    x, xv = _x(device)
    y = pydiff.zeros((16,), device=device)
    for a in (1.0, 2.0, 3.0):
        mod.s35_out(a, x, y)
    np.testing.assert_allclose(y.numpy(), 3.0 * xv + 1.0, rtol=1e-6, atol=1e-5)


def test_raw_handle_after_a_deferred_call(mod, device):
    x, xv = _x(device)
    y = pydiff.zeros((16,), device=device)
    mod.s35_poly(2.0, x, _result=y)
    mod.s35_poly(4.0, x, _result=y)
    np.testing.assert_allclose(y.native.to_numpy(), 4.0 * xv * xv + xv, rtol=1e-6, atol=1e-5)


def test_threads_each_with_their_own_tensors(mod, device):
    errors: list = []

    def work(k: int) -> None:
        try:
            x, xv = _x(device, grads=True)
            y = pydiff.zeros((16,), device=device).with_grads(ones=True)
            for _ in range(200):
                mod.s35_poly(float(k), x, _result=y)
                mod.s35_poly.bwds(float(k), x, _result=y)
            np.testing.assert_allclose(y.numpy(), k * xv * xv + xv, rtol=1e-6, atol=1e-5)
            np.testing.assert_allclose(
                x.grad.numpy(), 200 * (2 * k * xv + 1.0), rtol=1e-5, atol=1e-4
            )
        except Exception as exc:  # (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def test_switch_set_while_unset_stops_small_generated_calls_at_once(device, monkeypatch):
    """The switch cached while unset (generated_switch.enabled_planned) is read again as soon
    as it is set; a value it does not take is refused there too."""
    from pydiff import generated

    monkeypatch.setattr(generated_switch, "PLANNED_AFTER", 2)
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER_ON_GPU", 2)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    m = pydiff.load_module_from_source("s35_switch", SOURCE, device=device)
    x, xv = _x(device)
    y = pydiff.zeros((16,), device=device)
    generated.reset_stats()
    for _ in range(6):
        m.s35_poly(2.0, x, _result=y)
    taken = generated.stats().get("forward", 0)
    assert taken >= 3  # the plan's small calls took the generated kernel
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    for _ in range(3):
        m.s35_poly(3.0, x, _result=y)
    assert generated.stats().get("forward", 0) == taken
    np.testing.assert_allclose(y.numpy(), 3.0 * xv * xv + xv, rtol=1e-6, atol=1e-5)
    monkeypatch.setenv("PYDIFF_GENERATED", "of")
    with pytest.raises(pydiff.EnvironmentSettingError, match="PYDIFF_GENERATED"):
        m.s35_poly(2.0, x, _result=y)


@pytest.mark.parametrize("given", ["missing", "tensor"])
def test_new_results_each_keep_their_values(mod, device, given):
    """A planned call making its float result (pooled, then deferred): results held at once
    never share a buffer, and results dropped at once are not handed out again while their
    commands are pending."""
    x, xv = _x(device)
    kw = {} if given == "missing" else {"_result": "tensor"}
    held = [mod.s35_poly(float(a), x, **kw) for a in range(6)]
    assert device.queue.deferred
    for _ in range(300):  # dropped at once: their buffers go back to the pool
        mod.s35_poly(9.0, x, **kw)
    last = mod.s35_poly(0.5, x, **kw)
    for a, y in enumerate(held):
        assert type(y) is pydiff.Tensor and y.shape == (16,) and y.dtype == "float"
        np.testing.assert_allclose(y.numpy(), a * xv * xv + xv, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(last.numpy(), 0.5 * xv * xv + xv, rtol=1e-6, atol=1e-5)


def test_new_result_then_bwds(mod, device):
    x, xv = _x(device, grads=True)
    for _ in range(3):
        y = mod.s35_poly(2.0, x).with_grads(ones=True)
        mod.s35_poly.bwds(2.0, x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 3 * (4.0 * xv + 1.0), rtol=1e-5, atol=1e-4)
