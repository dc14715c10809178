"""Calls and .bwds: element types, broadcasting, inout, the kernel-cache order, results."""

import numpy as np
import pytest

import pydiff


def _t(device, data, **kw):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, **kw)


def test_scalar_function_and_gradient(device, load):
    m = load("calls", device)
    xs = np.linspace(-3, 3, 13).astype(np.float32)
    x = _t(device, xs, requires_grad=True)
    y = m.square(x, _result="tensor")
    np.testing.assert_allclose(y.numpy(), xs**2, rtol=1e-6)
    m.square.bwds(x, _result=y.with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), 2 * xs, rtol=1e-6)


@pytest.mark.parametrize("upstream", [1.0, 2.5])
def test_plain_number_as_upstream_gradient_is_not_zero(device, load, upstream):
    m = load("calls", device)
    x = _t(device, [1.0, -2.0, 3.0], requires_grad=True)
    m.square.bwds(x, _result=upstream)
    np.testing.assert_allclose(x.grad.numpy(), upstream * 2 * np.array([1, -2, 3]))


def test_vector_float2_with_broadcast_scalar(device, load):
    m = load("calls", device)
    vs = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    v = pydiff.tensor(vs, dtype="float2", device=device, requires_grad=True)
    s = _t(device, [2.0], requires_grad=True)
    assert v.shape == (3,) and v.dtype == "float2"
    y = m.scale2(s, v, _result="tensor")
    np.testing.assert_allclose(y.numpy(), 2 * vs)
    up = np.array([[1, 0], [0, 1], [1, 1]], np.float32)
    y = y.with_grads()
    y.grad.copy_from_numpy(up)
    m.scale2.bwds(s, v, _result=y)
    np.testing.assert_allclose(v.grad.numpy(), 2 * up)
    np.testing.assert_allclose(s.grad.numpy(), [np.sum(up * vs)])


def test_vector_float3_cross_product(device, load):
    m = load("calls", device)
    rng = np.random.default_rng(1)
    A, B, U = (rng.standard_normal((5, 3)).astype(np.float32) for _ in range(3))
    a = pydiff.tensor(A, dtype="float3", device=device, requires_grad=True)
    b = pydiff.tensor(B, dtype="float3", device=device, requires_grad=True)
    y = m.cross_scale(a, b, _result="tensor")
    np.testing.assert_allclose(y.numpy(), np.cross(A, B), rtol=1e-5, atol=1e-6)
    y = y.with_grads()
    y.grad.copy_from_numpy(U)
    m.cross_scale.bwds(a, b, _result=y)
    # d<u, a x b>/da = b x u ; /db = u x a
    np.testing.assert_allclose(a.grad.numpy(), np.cross(B, U), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), np.cross(U, A), rtol=1e-5, atol=1e-5)


def test_vector_float4_dot(device, load):
    m = load("calls", device)
    A = np.arange(8, dtype=np.float32).reshape(2, 4)
    B = np.ones((2, 4), np.float32) * 0.5
    a = pydiff.tensor(A, dtype="float4", device=device, requires_grad=True)
    b = pydiff.tensor(B, dtype="float4", device=device)
    m.dot4.bwds(a, b, _result=1.0)
    np.testing.assert_allclose(a.grad.numpy(), B)


def test_half_precision(device, load):
    m = load("calls", device)
    xs = np.array([0.5, 1.0, 1.5, -2.0], np.float16)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    assert x.dtype == "half" and x.grad.dtype == "half"
    y = m.half_cube(x, _result="tensor")
    np.testing.assert_allclose(y.numpy(), xs.astype(np.float32) ** 3, rtol=2e-3)
    m.half_cube.bwds(x, _result=y.with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), 3 * xs.astype(np.float32) ** 2, rtol=2e-3)


def test_inout_scalar_gradients_are_not_zero(device, load):
    """SlangPy 0.43 returns zeros here; pydiff must return dv = s*u, ds = v*u."""
    m = load("calls", device)
    s = _t(device, [1, 2, 3, 4], requires_grad=True)
    v = _t(device, [5, 6, 7, 8], requires_grad=True)
    m.scale_inout(s, v)
    np.testing.assert_allclose(v.numpy(), [5, 12, 21, 32])
    v.copy_from_numpy(np.array([5, 6, 7, 8], np.float32))  # primal before the call
    v.grad.copy_from_numpy(np.array([1, 0.5, 2, 3], np.float32))  # upstream dL/dv_after
    m.scale_inout.bwds(s, v)
    np.testing.assert_allclose(v.grad.numpy(), [1, 1, 6, 12])
    np.testing.assert_allclose(s.grad.numpy(), [5, 3, 14, 24])


def test_two_inouts_against_closed_form(device, load):
    m = load("calls", device)
    rng = np.random.default_rng(2)
    S, A, B, UA, UB = (rng.uniform(-2, 2, 6).astype(np.float32) for _ in range(5))
    s, a, b = (_t(device, v, requires_grad=True) for v in (S, A, B))
    a.grad.copy_from_numpy(UA)
    b.grad.copy_from_numpy(UB)
    m.two_inouts.bwds(s, a, b)
    np.testing.assert_allclose(a.grad.numpy(), UA * B * S + UB, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), UA * A * S + 2 * UB * B, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.grad.numpy(), UA * A * B, rtol=1e-5, atol=1e-5)


def test_inout_float3(device, load):
    m = load("calls", device)
    V = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    U = np.full((2, 3), 0.5, np.float32)
    s = _t(device, [1.5, -1.0], requires_grad=True)
    v = pydiff.tensor(V, dtype="float3", device=device, requires_grad=True)
    v.grad.copy_from_numpy(U)
    m.square_inout3.bwds(s, v)
    np.testing.assert_allclose(v.grad.numpy(), 2 * U * V * np.array([[1.5], [-1.0]]), rtol=1e-6)
    np.testing.assert_allclose(s.grad.numpy(), np.sum(U * V * V, axis=1), rtol=1e-6)


def test_inout_with_result(device, load):
    m = load("calls", device)
    s = _t(device, [2.0, 3.0], requires_grad=True)
    v = _t(device, [4.0, 5.0], requires_grad=True)
    v.grad.copy_from_numpy(np.array([1.0, 1.0], np.float32))  # dL/dv_after
    r = pydiff.zeros((2,), device=device).with_grads(ones=True)  # dL/dr
    m.scale_and_report.bwds(s, v, _result=r)
    # r = s v, v' = v^2: dL/dv = s + 2v, dL/ds = v
    np.testing.assert_allclose(v.grad.numpy(), [2 + 8, 3 + 10])
    np.testing.assert_allclose(s.grad.numpy(), [4, 5])


def test_inout_with_separate_buffers_accumulates_into_grad_out(device, load):
    m = load("calls", device)
    s = _t(device, [2.0, 3.0])
    v = _t(device, [4.0, 5.0]).with_grads(
        grad_in=_t(device, [1.0, 2.0]), grad_out=_t(device, [10.0, 10.0])
    )
    m.scale_inout.bwds(s, v)
    np.testing.assert_allclose(v.grad_out.numpy(), [10 + 2, 10 + 6])
    np.testing.assert_allclose(v.grad_in.numpy(), [1, 2])


def test_out_parameter_reads_upstream(device, load):
    m = load("calls", device)
    x = _t(device, [1.0, 2.0], requires_grad=True)
    y = _t(device, [0.0, 0.0]).with_grads()
    y.grad.copy_from_numpy(np.array([1.0, -1.0], np.float32))
    m.write_out.bwds(x, y)
    np.testing.assert_allclose(x.grad.numpy(), [3.0, -3.0])


def test_cache_order_no_grad_call_then_grad_call(device, load):
    """SlangPy's call cache ignores grads: a later call with grads would get zeros."""
    m = load("calls", device)
    plain = _t(device, [1.0, 2.0])
    m.square.bwds(plain, _result=1.0)
    x = _t(device, [3.0, 4.0], requires_grad=True)
    m.square.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 8.0])


def test_cache_order_grad_call_then_no_grad_call(device, load):
    m = load("calls", device)
    x = _t(device, [3.0, 4.0], requires_grad=True)
    m.square.bwds(x, _result=1.0)
    m.square.bwds(
        _t(device, [1.0, 2.0]), _result=1.0
    )  # SlangPy: "Missing required output gradients"
    y = _t(device, [5.0, 6.0], requires_grad=True)
    m.square.bwds(y, _result=1.0)
    np.testing.assert_allclose(y.grad.numpy(), [10.0, 12.0])


def test_broadcast_coefficient_gradient_with_data_input(device, load):
    m = load("seeds", device)
    xs = np.array([1.0, 2.0, 3.0], np.float32)
    a = _t(device, [2.0], requires_grad=True)
    m.polynomial.bwds(a, 8.0, -1.0, _t(device, xs), _result=1.0)
    np.testing.assert_allclose(a.grad.numpy(), [np.sum(xs**2)])


def test_struct_free_keyword_and_positional_mix(device, load):
    m = load("calls", device)
    s = _t(device, [2.0])
    v = pydiff.tensor([[1, 1]], dtype="float2", device=device)
    y = m.scale2(s, v=v, _result="tensor")
    np.testing.assert_allclose(y.numpy(), [[2, 2]])


def test_scalar_call_returns_python_value(device, load):
    m = load("calls", device)
    assert m.square(3.0) == pytest.approx(9.0)
