"""Call plans (pydiff.call_plan): a repeated call of one argument layout skips the checks
that depend only on the layout, and still gives the full path's values, gradients and
errors, per call, for everything that depends on values and storages."""

import numpy as np
import pytest

import pydiff
from pydiff import plan_layout

SOURCE = """
[Differentiable] float poly(float a, float x) { return a * x * x; }
"""


@pytest.fixture
def m(device):
    # A module of its own per test: plans live on its functions.
    return pydiff.load_module_from_source("call_plan_poly", SOURCE, device=device)


def _x(device, values, **kw):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, **kw)


def test_repeated_calls_take_the_plan_with_each_calls_values(device, m):
    xs = np.linspace(-2, 2, 16).astype(np.float32)
    x = _x(device, xs, requires_grad=True)
    y = pydiff.zeros((16,), device=device).with_grads(ones=True)
    total = np.zeros(16)
    for k, a in enumerate([2.0, -1.5, 0.25, 3.0]):
        m.poly(a, x, _result=y)
        np.testing.assert_allclose(y.numpy(), a * xs.astype(np.float64) ** 2, rtol=1e-6)
        m.poly.bwds(a, x, _result=y)
        total += 2 * a * xs
        np.testing.assert_allclose(x.grad.numpy(), total, rtol=1e-5, atol=1e-6)
        if k == 0:
            assert len(m.poly.plans) == 1 and len(m.poly.bwds_plans) == 1
    assert len(m.poly.plans) == 1 and len(m.poly.bwds_plans) == 1


def test_a_number_out_of_range_is_refused_on_the_planned_path(device, m):
    x = _x(device, [1.0, 2.0])
    y = pydiff.zeros((2,), device=device)
    m.poly(2.0, x, _result=y)
    m.poly(2.0, x, _result=y)
    assert m.poly.plans
    with pytest.raises(ValueError, match="'a'"):
        m.poly(1e39, x, _result=y)  # float32 holds at most ~3.4e38


def test_a_plan_converts_numbers_by_their_type_in_the_layout(device, m):
    # The plan splits numbers by the layout's types once: a float for a float parameter is
    # passed as it is (range checked), an int goes through convert on every call.
    xs = np.array([1.0, -3.0], np.float32)
    x = _x(device, xs, requires_grad=True)
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    for a in [2, 3, 2.5, -1.0, 4]:
        m.poly(a, x, _result=y)
        np.testing.assert_allclose(y.numpy(), float(a) * xs**2, rtol=1e-6)
    assert len(m.poly.plans) == 2  # int and float: one layout each
    for a in [2, 3, 1.5]:
        m.poly.bwds(a, x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * (2 + 3 + 1.5) * xs, rtol=1e-5)
    with pytest.raises(ValueError, match="'a'"):
        m.poly(10**39, x, _result=y)  # an int layout's plan checks the range too
    with pytest.raises(TypeError, match="bool"):
        m.poly(True, x, _result=y)  # a layout of its own, refused by the full path


def test_new_result_tensors_through_the_plan(device, m):
    x = _x(device, [1.0, -3.0])
    outs = [m.poly(2.0, x, _result="tensor") for _ in range(3)]
    assert len({id(o.storage) for o in outs}) == 3
    for o in outs:
        np.testing.assert_allclose(o.numpy(), [2.0, 18.0])


def test_an_aliased_call_of_a_planned_layout_takes_the_full_path(device, m):
    # Same layout as the planned calls, but _result is the input: the full path keeps the
    # values read, so .bwds differentiates at them, not at the values written.
    xs = np.array([1.0, 2.0, -1.0], np.float32)
    x = _x(device, xs, requires_grad=True)
    y = pydiff.zeros((3,), device=device).with_grads()
    m.poly(2.0, x, _result=y)
    m.poly(2.0, y, _result=x)  # (x's layout: gradients; y's too)
    assert len(m.poly.plans) == 1
    m.poly(2.0, x, _result=x)
    np.testing.assert_allclose(x.numpy(), 2 * (2 * (2 * xs**2) ** 2) ** 2, rtol=1e-5)
    assert x.storage.before is not None  # the values read were kept (not the plan's path)


def test_backward_plan_refuses_an_upstream_sharing_an_input_gradient(device, m):
    x = _x(device, [1.0, 2.0], requires_grad=True)
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    m.poly.bwds(2.0, x, _result=y)
    m.poly.bwds(2.0, x, _result=y)
    assert m.poly.bwds_plans
    shared = x.detach().with_grads(grad_in=y.grad, grad_out=y.grad)
    with pytest.raises(ValueError, match="gradient buffer"):
        m.poly.bwds(2.0, shared, _result=y)


def test_backward_plan_applies_a_tensors_own_zero_policy(device, m):
    x = _x(device, [1.0, 2.0], requires_grad=True)
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    m.poly.bwds(3.0, x, _result=y)
    m.poly.bwds(3.0, x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), [12.0, 24.0])
    x.zero_policy = "reset"
    m.poly.bwds(3.0, x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 12.0])


def test_result_given_positionally_after_a_plan(device, m):
    x = _x(device, [1.0, 2.0], requires_grad=True)
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    m.poly.bwds(2.0, x, _result=y)
    m.poly.bwds(2.0, x, _result=y)
    m.poly.bwds(2.0, x, y)  # SlangPy's form: the result after the parameters
    np.testing.assert_allclose(x.grad.numpy(), 3 * np.array([4.0, 8.0]))
    with pytest.raises(TypeError):
        m.poly(2.0, x, y)  # one argument too many for the forward call


def test_calls_on_a_tape_are_recorded_after_a_plan(device, m):
    xs = np.array([0.5, -1.0], np.float32)
    x = _x(device, xs, requires_grad=True)
    m.poly(2.0, x, _result="tensor")
    m.poly(2.0, x, _result="tensor")
    with pydiff.Tape() as tape:
        y = m.poly(2.0, x, _result="tensor")
    tape.backward(y, grad=np.ones(2, np.float32))
    np.testing.assert_allclose(x.grad.numpy(), 4 * xs)


def test_plans_per_function_are_bounded(device, m):
    for n in range(1, plan_layout.PLANS_MAX + 6):
        m.poly(1.0, _x(device, np.ones(n)), _result="tensor")
        m.poly(1.0, _x(device, np.ones(n)), _result="tensor")
    assert len(m.poly.plans) <= plan_layout.PLANS_MAX


def test_layout_key_covers_what_the_checks_read(device):
    x = _x(device, [1.0, 2.0])
    xg = _x(device, [1.0, 2.0], requires_grad=True)
    key = plan_layout.layout_key
    assert key((2.0, x), {}) != key((2.0, xg), {})  # gradient buffers
    assert key((2.0, x), {}) != key((2, x), {})  # a number's type
    assert key((2.0, x), {}) != key((2.0, x.reshape((2, 1))), {})  # shapes
    assert key((2.0, x, xg), {}) != key((2.0, x), {"_result": xg})  # positional result
    assert key((np.float32(2.0), x), {}) is None  # converted per call: no plan
    assert key((2.0, x), {"_result": "numpy"}) is None
    assert key((2.0,), {"x": x}) is None
