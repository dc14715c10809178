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


# --------------------------------------------------------------------------------------
# struct arguments: every nested field that gets no gradient is named (issue 15, class 10)

NESTED = """
struct P { float a; float b; }
struct Q { P inner; float c; }
struct DP : IDifferentiable { float a; no_diff float b; }
struct DQ : IDifferentiable { DP inner; P plain; float c; }
struct D3 : IDifferentiable { DQ mid; float e; }
[Differentiable] float qs(Q q, float x) { return q.inner.a * x * q.c + q.inner.b; }
[Differentiable] float dqs(DQ q, float x)
{ return q.inner.a * x * q.c + q.inner.b * x + q.plain.a * q.plain.b; }
[Differentiable] float d3(D3 s, float x) { return s.mid.inner.a * s.e * x + s.mid.plain.b; }
"""

X = np.float32([0.5, 1.0, 2.0])


@pytest.fixture(scope="module")
def nested(device):
    return pydiff.load_module_from_source("gradient_flow_nested", NESTED, device=device)


def _leaf(device, values=X):
    return pydiff.tensor(np.float32(values), device=device, requires_grad=True)


def _named(record):
    return " ".join(str(w.message) for w in _flow_warnings(record))


def _seed(device):
    return pydiff.zeros((3,), device=device).with_grads(ones=True)


def test_non_differentiable_struct_names_every_nested_field(device, nested):
    a, b, c, x = (_leaf(device) for _ in range(4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nested.qs.bwds({"inner": {"a": a, "b": b}, "c": c}, x, _result=_seed(device))
    text = _named(record)
    for where in ("'q.inner.a'", "'q.inner.b'", "'q.c'"):
        assert where in text, text
    np.testing.assert_allclose(x.grad.numpy(), X * X, rtol=1e-6)  # d/dx (a x c) = a c


def test_differentiable_struct_names_only_fields_without_gradient(device, nested):
    a, b, c, x = (_leaf(device, v) for v in ([0.5, 1.0, 2.0], [0.3, -1.0, 2.0], X, X))
    pa, pb = _leaf(device), _leaf(device)
    q = {"inner": {"a": a, "b": b}, "plain": {"a": pa, "b": pb}, "c": c}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nested.dqs.bwds(q, x, _result=_seed(device))
    text = _named(record)
    for where in ("'q.inner.b'", "'q.plain.a'", "'q.plain.b'"):
        assert where in text, text
    for where in ("'q.inner.a'", "'q.c'", "'x'"):
        assert where not in text, text
    # the fields that do get gradients are right: d/da = x c, d/dc = a x
    x64, a64, c64 = X.astype(np.float64), np.float64([0.5, 1.0, 2.0]), X.astype(np.float64)
    np.testing.assert_allclose(a.grad.numpy(), x64 * c64, rtol=1e-6)
    np.testing.assert_allclose(c.grad.numpy(), a64 * x64, rtol=1e-6)


def test_three_levels_deep(device, nested):
    a, pb, e, x = (_leaf(device) for _ in range(4))
    s = {
        "mid": {
            "inner": {"a": a, "b": pydiff.tensor(X, device=device)},
            "plain": {"a": pydiff.tensor(X, device=device), "b": pb},
            "c": pydiff.tensor(X, device=device),
        },
        "e": e,
    }
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nested.d3.bwds(s, x, _result=_seed(device))
    text = _named(record)
    assert "'s.mid.plain.b'" in text and "'s.mid.inner.a'" not in text, text
    np.testing.assert_allclose(a.grad.numpy(), X.astype(np.float64) ** 2, rtol=1e-6)  # e x


def test_nested_fields_without_requires_grad_do_not_warn(device, nested):
    plain = [pydiff.tensor(X, device=device) for _ in range(3)]
    x = _leaf(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydiff.GradientFlowWarning)
        q = {"inner": {"a": plain[0], "b": plain[1].detach()}, "c": plain[2]}
        nested.qs.bwds(q, x, _result=_seed(device))
