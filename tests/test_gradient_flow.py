"""Gradients that cannot flow are said, not silently zero (issue 15, class 10): a tensor that
wants a gradient bound to a ``no_diff`` parameter, and a recorded call of a function without
derivatives on the path of a tape's backward. References are closed forms in float64."""

import warnings

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] float keep(no_diff float k, float x) { return k * x; }
float plain_sq(float x) { return x * x; }
int sign_of(float x) { return x < 0.0 ? -1 : 1; }
[Differentiable] float times(float a, float b) { return a * b; }
[Differentiable] float twice(float x) { return 2.0 * x; }
"""


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("gradient_flow", SOURCE, device=device)


def _flow_warnings(record):
    return [w for w in record if issubclass(w.category, pydiff.GradientFlowWarning)]


def test_no_diff_parameter_with_requires_grad_warns_once_per_call_site(device, m):
    X, K = np.array([1.0, -2.0, 0.5]), np.array([3.0, 4.0, -1.5])
    x = pydiff.tensor(X, device=device, requires_grad=True)
    k = pydiff.tensor(K, device=device, requires_grad=True)
    k.grad.copy_from_numpy(np.full(3, 7.0))  # must stay as it is
    y = m.keep(k, x, _result="tensor")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):  # one call site, three calls: one warning
            m.keep.bwds(k, x, _result=y.with_grads(ones=True))
    flow = _flow_warnings(record)
    assert len(flow) == 1
    assert "'k'" in str(flow[0].message) and "no_diff" in str(flow[0].message)
    assert flow[0].filename == __file__
    np.testing.assert_allclose(x.grad.numpy(), 3 * K, rtol=1e-6)
    np.testing.assert_array_equal(k.grad.numpy(), np.full(3, 7.0))


def test_no_diff_parameter_each_call_site_is_named(device, m):
    x = pydiff.tensor([1.0], device=device, requires_grad=True)
    k = pydiff.tensor([2.0], device=device, requires_grad=True)
    y = m.keep(k, x, _result="tensor")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        m.keep.bwds(k, x, _result=y.with_grads(ones=True))
        m.keep.bwds(k, x, _result=y.with_grads(ones=True))
    lines = {w.lineno for w in _flow_warnings(record)}
    assert len(lines) == 2


def test_detached_or_gradient_free_inputs_do_not_warn(device, m):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    k = pydiff.tensor([3.0, 5.0], device=device, requires_grad=True)
    y = m.keep(k.detach(), x, _result="tensor")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        m.keep.bwds(k.detach(), x, _result=y.with_grads(ones=True))
        m.keep.bwds(2.0, x, _result=y.with_grads(ones=True))
    assert _flow_warnings(record) == []
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 7.0], rtol=1e-6)


def test_tape_through_a_non_differentiable_function_warns(device, m):
    X = np.array([0.5, -1.5, 2.0])
    x = pydiff.tensor(X, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.plain_sq(x, _result="tensor")  # no derivatives: a is a constant to the tape
        b = m.times(a, x, _result="tensor")  # d b / d x through its second argument: a = x^2
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tape.backward(b, grad=np.ones(3))
    flow = _flow_warnings(record)
    assert len(flow) == 1 and "plain_sq" in str(flow[0].message)
    np.testing.assert_allclose(b.numpy(), X**3, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), X**2, rtol=1e-6)


def test_tape_output_only_through_a_non_differentiable_function(device, m):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.plain_sq(x, _result="tensor")
        b = m.twice(a, _result="tensor")
    with pytest.warns(pydiff.GradientFlowWarning, match="plain_sq"):
        tape.backward(b, grad=np.ones(2))
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 0.0])


def test_integer_results_of_non_differentiable_functions_are_not_on_the_tape(device, m):
    x = pydiff.tensor([1.0, -2.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        s = m.sign_of(x, _result="tensor")
        b = m.twice(x, _result="tensor")
    assert len(tape) == 1 and not s.requires_grad
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tape.backward(b, grad=np.ones(2))
    assert _flow_warnings(record) == []
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0])


def test_detached_input_to_a_non_differentiable_function_is_not_recorded(device, m):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.plain_sq(x.detach(), _result="tensor")
    assert len(tape) == 0 and not a.requires_grad
