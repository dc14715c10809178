"""`_result` tensors that would lose values are refused (issue 15, class 5), and the result
may be passed positionally to `.bwds` as in SlangPy (class 17). References are closed forms
in float64."""

import re

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float prod2(float a, float b) { return a * b; }
[Differentiable] float3 spread(float x) { return float3(x, 2.0 * x, 3.0 * x); }
[Differentiable] void sq_out(float x, out float y) { y = x * x; }
[Differentiable] half hcube(half x) { return x * x * x; }
"""

X = np.array([1.5, -2.5, 3.25])


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("results", SOURCE, device=device)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_result_smaller_than_the_call_is_refused(device, m, shape):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    small = pydiff.zeros(shape, device=device)
    with pytest.raises(ValueError, match=r"_result has shape .* broadcast to shape \(3,\)"):
        m.sq(x, _result=small)
    with pytest.raises(ValueError, match="_result has shape"):
        m.sq.bwds(x, _result=small.with_grads(ones=True))
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(3))  # nothing ran


def test_result_smaller_than_a_broadcast_of_two_arguments(device, m):
    a = pydiff.tensor(np.ones((4, 1)), device=device)
    b = pydiff.tensor(np.ones((1, 3)), device=device)
    with pytest.raises(ValueError, match=r"\(4, 3\)"):
        m.prod2(a, b, _result=pydiff.zeros((4, 1), device=device))
    with pytest.raises(ValueError, match=r"\(4, 3\)"):
        m.prod2(a, b, _result=pydiff.zeros((1, 3), device=device))
    out = m.prod2(a, b, _result=pydiff.zeros((4, 3), device=device))
    np.testing.assert_array_equal(out.numpy(), np.ones((4, 3)))


@pytest.mark.parametrize("dtype", ["int", "uint", "bool"])
def test_integer_result_for_a_float_function_is_refused(device, m, dtype):
    x = pydiff.tensor(X, device=device)
    with pytest.raises(TypeError, match=rf"_result has dtype {dtype} .* truncated"):
        m.sq(x, _result=pydiff.zeros((3,), dtype=dtype, device=device))


def test_results_that_fit_still_work(device, m):
    x = pydiff.tensor(X, device=device)
    wide = m.sq(x, _result=pydiff.zeros((2, 3), device=device))  # broadcast over a new axis
    np.testing.assert_allclose(wide.numpy(), np.broadcast_to(X**2, (2, 3)), rtol=1e-6)
    vec = m.spread(x, _result=pydiff.zeros((3,), dtype="float3", device=device))
    np.testing.assert_allclose(vec.numpy(), np.outer(X, [1.0, 2.0, 3.0]), rtol=1e-6)


def test_bwds_takes_the_result_positionally(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    y = m.sq(x, _result="tensor")
    m.sq.bwds(x, y.with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)
    a = pydiff.tensor(X, device=device, requires_grad=True)
    b = pydiff.tensor(2 * X, device=device, requires_grad=True)
    z = m.prod2(a, b, _result="tensor")
    seed = np.array([1.0, 0.5, -2.0])
    m.prod2.bwds(a, b, z.with_grads(pydiff.tensor(seed, device=device)))
    np.testing.assert_allclose(a.grad.numpy(), seed * 2 * X, rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), seed * X, rtol=1e-6)


def test_positional_result_number_seeds_a_scalar(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    m.sq.bwds(x, 1.0)
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)


def test_result_given_twice_is_refused(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    y = m.sq(x, _result="tensor").with_grads(ones=True)
    with pytest.raises(TypeError, match="given twice"):
        m.sq.bwds(x, y, _result=y)


def test_void_function_takes_no_extra_argument(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    with pytest.raises(TypeError, match="takes 2 arguments but 3 were given"):
        m.sq_out.bwds(x, y, y)


def test_result_that_is_an_input_is_refused_on_a_tape(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        with pytest.raises(ValueError, match="_result is the tensor passed as parameter 'x'"):
            m.sq(x, _result=x)
        y = m.sq(x, _result="tensor")  # the way out
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)
    np.testing.assert_allclose(x.numpy(), X, rtol=1e-6)  # the refused call wrote nothing


def test_result_that_is_an_input_off_tape_is_an_in_place_update(device, m):
    x = pydiff.tensor(X, device=device)
    m.sq(x, _result=x)
    np.testing.assert_allclose(x.numpy(), X**2, rtol=1e-6)


def test_bwds_with_result_and_input_sharing_a_gradient_buffer_is_refused(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="also the gradient buffer of parameter 'x'"):
        m.sq.bwds(x, _result=x)


@pytest.mark.parametrize("seed", [1.0, 0.5, -2.0, 3])
def test_number_result_seeds_a_half_function(device, m, seed):
    H = np.array([0.5, -1.25, 2.0])  # exact in half
    x = pydiff.tensor(H, dtype="half", device=device, requires_grad=True)
    m.hcube.bwds(x, _result=seed)
    np.testing.assert_allclose(x.grad.numpy(), seed * 3 * H**2, rtol=2e-3)
    x.zero_grad()
    m.hcube.bwds(x, seed)  # positionally too
    np.testing.assert_allclose(x.grad.numpy(), seed * 3 * H**2, rtol=2e-3)


def test_number_result_of_a_half_function_without_a_call_shape(device, m):
    with pytest.raises(TypeError, match="half function needs the call's shape"):
        m.hcube.bwds(0.5, _result=1.0)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.bool_])
def test_integer_numpy_result_for_a_float_function_is_refused(device, m, dtype):
    x = pydiff.tensor(X, device=device)
    with pytest.raises(TypeError, match=rf"_result is a NumPy array of dtype {np.dtype(dtype)}"):
        m.sq(x, _result=np.zeros(3, dtype))


@pytest.mark.parametrize("shape", [(1,), (1, 1), (2, 1)])
def test_numpy_result_smaller_than_the_call_is_refused(device, m, shape):
    x = pydiff.tensor(X, device=device)
    with pytest.raises(ValueError, match=r"_result is a NumPy array of shape .* \(3,\)"):
        m.sq(x, _result=np.zeros(shape, np.float32))
    with pytest.raises(ValueError, match=r"broadcast to shape \(3,\)"):
        m.sq(X.astype(np.float32), _result=np.zeros(shape, np.float32))  # a host argument
    with pytest.raises(ValueError, match=r"broadcast to shape \(3,\)"):
        m.spread(x, _result=np.zeros((*shape, 3), np.float32))  # a float3 result


def test_numpy_results_that_fit_are_written(device, m):
    x = pydiff.tensor(X, device=device)
    for dtype in (np.float32, np.float64):
        out = np.zeros(3, dtype)
        m.sq(x, _result=out)
        np.testing.assert_allclose(out, X**2, rtol=1e-6)
    out = np.zeros((2, 3), np.float32)  # larger than the arguments: one element per thread
    m.prod2(x, pydiff.tensor([[2.0], [-1.0]], device=device), _result=out)
    np.testing.assert_allclose(out, [2 * X, -X], rtol=1e-6)
    out = np.zeros((3, 3), np.float32)
    m.spread(x, _result=out)
    np.testing.assert_allclose(out, X[:, None] * [1.0, 2.0, 3.0], rtol=1e-6)


def test_strided_numpy_result_is_refused(device, m):
    x = pydiff.tensor(X, device=device)
    with pytest.raises(TypeError, match=r"_result is a NumPy array with strides"):
        m.sq(x, _result=np.zeros(6, np.float32)[::2])


@pytest.mark.parametrize("number", [1.0, 2, np.float32(0.5)])
def test_number_result_of_a_forward_call_is_refused(device, m, number):
    x = pydiff.tensor(X, device=device)
    with pytest.raises(TypeError, match=r"_result=.*only seeds the result's gradient in .bwds"):
        m.sq(x, _result=number)
    with pytest.raises(TypeError, match=r"_result=.*only seeds"):
        m.hcube(pydiff.tensor(X, dtype="half", device=device), _result=number)


# ---- element axes, written parameters and generic results (issue 15, classes 5 and 3) ----

SHAPES_SOURCE = """
[Differentiable] float3 spread3(float x) { return float3(x, 2.0 * x, 3.0 * x); }
[Differentiable] float2x2 outer2(float a, float b) { return float2x2(a * b, a, b, 2.0 * a * b); }
[Differentiable] void out3(float x, out float3 y) { y = float3(x, x * x, -x); }
[Differentiable] void sq_out(float x, out float y) { y = x * x; }
[Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
[Differentiable] T cube<T : __BuiltinFloatingPointType>(T x) { return x * x * x; }
[Differentiable] T wsum<T : __BuiltinFloatingPointType>(T a, T x) { return a * x + x * x; }
[Differentiable] float via_cube(float x) { return cube(x) * 2.0; }
float plain(float a, float b) { return a * b + 0.5; }
float msum(float2x2 m) { return m[0][0] + 10.0 * m[0][1] + 100.0 * m[1][0] + 1000.0 * m[1][1]; }
"""


@pytest.fixture(scope="module")
def s(device):
    return pydiff.load_module_from_source("results_shapes", SHAPES_SOURCE, device=device)


SPREAD = np.array([1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    "shape, dtype, words",
    [
        ((3,), "float", ["(3,)", "float3", "race"]),  # one float3 for a call of 3
        ((3, 2), "float", ["(3, 2)", "(..., 3)"]),
        ((3, 4), "float", ["(3, 4)", "(..., 3)"]),
        ((3, 1), "float", ["(3, 1)", "(..., 3)"]),
        ((3,), "float2", ["float2 elements", "float3"]),
        ((3,), "float4", ["float4 elements", "float3"]),
    ],
)
def test_result_without_the_vector_axes_is_refused(device, s, shape, dtype, words):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    bad = pydiff.zeros(shape, dtype=dtype, device=device)
    for call in (
        lambda: s.spread3(x, _result=bad),
        lambda: s.spread3.bwds(x, _result=bad.with_grads(ones=True)),
    ):
        with pytest.raises(ValueError, match="_result") as info:
            call()
        for w in words:
            assert w in str(info.value), str(info.value)
    np.testing.assert_array_equal(bad.numpy(), np.zeros_like(bad.numpy()))  # nothing ran
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(3))


@pytest.mark.parametrize("shape", [(3,), (3, 2), (3, 4), (1, 3), (3, 1)])
def test_numpy_result_without_the_vector_axes_names_the_vector(device, s, shape):
    x = pydiff.tensor(X, device=device)
    with pytest.raises(ValueError, match=r"_result.*float3") as info:
        s.spread3(x, _result=np.zeros(shape, np.float32))
    assert str(shape) in str(info.value)


def test_results_with_the_element_axes_are_right(device, s):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    y = s.spread3(x, _result=pydiff.zeros((3, 3), device=device))
    np.testing.assert_allclose(y.numpy(), X[:, None] * SPREAD, rtol=1e-6)
    wide = s.spread3(x, _result=np.zeros((2, 3, 3), np.float32))  # broadcast over a new axis
    np.testing.assert_allclose(wide, np.broadcast_to(X[:, None] * SPREAD, (2, 3, 3)), rtol=1e-6)
    up = np.array([[1.0, 0.5, -1.0], [2.0, 0.0, 1.0], [0.0, 3.0, 0.25]])
    y = pydiff.zeros((3, 3), device=device).with_grads()
    y.grad.copy_from_numpy(up)
    s.spread3.bwds(x, _result=y)  # d<up, spread(x)>/dx = up . (1, 2, 3)
    np.testing.assert_allclose(x.grad.numpy(), up @ SPREAD, rtol=1e-6)
    b = np.array([[2.0], [-1.0]])  # (2, 1) against (3,): a call of shape (2, 3)
    m2 = s.outer2(X, b, _result=pydiff.zeros((2, 3, 2, 2), device=device)).numpy()
    ref = np.stack([X * b, np.broadcast_to(X, (2, 3)), np.broadcast_to(b, (2, 3)), 2 * X * b], -1)
    np.testing.assert_allclose(m2, ref.reshape(2, 3, 2, 2), rtol=1e-6)


@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 2, 1), (2, 3, 2), (2, 3, 3, 2)])
def test_matrix_result_with_wrong_element_axes_is_refused(device, s, shape):
    b = np.array([[2.0], [-1.0]])
    with pytest.raises(ValueError, match=r"_result \(float2x2\).*\(\.\.\., 2, 2\)"):
        s.outer2(X, b, _result=pydiff.zeros(shape, device=device))


@pytest.mark.parametrize("shape", [(1,), (2, 1), (1, 1)])
def test_out_parameter_smaller_than_the_call_is_refused(device, s, shape):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    y = pydiff.zeros(shape, device=device, requires_grad=True)
    said = re.escape(str(shape))
    with pytest.raises(ValueError, match=rf"parameter 'y' has shape {said}.*race") as info:
        s.sq_out(x, y)
    assert "(3,)" in str(info.value)
    with pytest.raises(ValueError, match="parameter 'y' has shape"):
        s.sq_out.bwds(x, y)
    with pytest.raises(ValueError, match=r"parameter 'y' is a NumPy array of shape"):
        s.sq_out(x, np.zeros(shape, np.float32))
    np.testing.assert_array_equal(y.numpy(), np.zeros(shape))
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(3))


def test_inout_parameter_smaller_than_the_call_is_refused(device, s):
    sc = pydiff.tensor(X, device=device)
    v = pydiff.tensor([2.0], device=device)
    with pytest.raises(ValueError, match=r"parameter 'v' has shape \(1,\).*\(3,\)"):
        s.scale_inout(sc, v)
    np.testing.assert_array_equal(v.numpy(), [2.0])
    v = pydiff.tensor(np.full((2, 3), 2.0), device=device)  # as large as the call: fine
    s.scale_inout(sc, v)
    np.testing.assert_allclose(v.numpy(), np.broadcast_to(2.0 * X, (2, 3)), rtol=1e-6)


def test_vector_out_parameter_needs_its_element_axis(device, s):
    x = pydiff.tensor(X, device=device)
    for bad in (
        pydiff.zeros((3,), device=device),
        pydiff.zeros((3, 2), device=device),
        pydiff.zeros((1,), dtype="float3", device=device),
    ):
        with pytest.raises(ValueError, match=r"parameter 'y' \(float3\)|parameter 'y' has shape"):
            s.out3(x, bad)
    y = pydiff.zeros((3, 3), device=device)
    s.out3(x, y)
    np.testing.assert_allclose(y.numpy(), np.stack([X, X * X, -X], -1), rtol=1e-6)
    y = pydiff.zeros((3,), dtype="float3", device=device)
    s.out3(x, y)
    np.testing.assert_allclose(y.numpy(), np.stack([X, X * X, -X], -1), rtol=1e-6)


@pytest.mark.parametrize("seed", [1.0, 2.5, -3, 0.0])
def test_number_seeds_a_generic_result(device, s, seed):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    s.cube.bwds(x, _result=seed)
    np.testing.assert_allclose(x.grad.numpy(), seed * 3 * X**2, rtol=1e-6)
    a = pydiff.tensor(2 * X, device=device, requires_grad=True)
    x = pydiff.tensor(X, device=device, requires_grad=True)
    s.wsum.bwds(a, x, seed)  # positional; d/da = x, d/dx = a + 2x
    np.testing.assert_allclose(a.grad.numpy(), seed * X, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), seed * (2 * X + 2 * X), rtol=1e-6)
    x = pydiff.tensor(X, device=device, requires_grad=True)
    s.via_cube.bwds(x, _result=seed)
    np.testing.assert_allclose(x.grad.numpy(), seed * 6 * X**2, rtol=1e-6)


def test_number_seeds_a_generic_half_result(device, s):
    H = np.array([0.5, -1.25, 2.0])  # exact in half
    h = pydiff.tensor(H, dtype="half", device=device, requires_grad=True)
    s.cube.bwds(h, _result=2.0)  # the call's shape comes from the argument of T = half
    np.testing.assert_allclose(h.grad.numpy(), 2 * 3 * H**2, rtol=2e-3)


def test_generic_result_smaller_than_the_call_is_refused(device, s):
    x = pydiff.tensor(X, device=device)
    with pytest.raises(ValueError, match=r"_result has shape \(1,\)"):
        s.cube(x, _result=pydiff.zeros((1,), device=device))


def test_numpy_result_of_a_call_of_single_values(device, s):
    got = s.plain(2.5, -2.0, _result="numpy")
    assert isinstance(got, np.ndarray) and got.shape == () and got.dtype == np.float32
    assert float(got) == 2.5 * -2.0 + 0.5
    assert s.plain(np.float64(1.5), 2, _result="numpy") == np.float32(3.5)
    m = np.array([[1.0, 2.0], [3.0, 4.0]])  # one float2x2: a call of shape ()
    got = s.msum(m, _result="numpy")
    assert got.shape == () and float(got) == 1.0 + 20.0 + 300.0 + 4000.0
    t = s.plain(2.5, -2.0, _result="tensor")  # as the tensor result is
    np.testing.assert_array_equal(t.numpy(), got * 0 + np.float32(-4.5))
    np.testing.assert_allclose(s.spread3(2.0, _result="numpy"), 2.0 * SPREAD)


def test_checks_remembered_per_shape_still_refuse_other_shapes(device, m):
    """A function remembers the argument shapes and dtypes that passed its shape checks (a
    third of a small call's cost): calls with those shapes skip them, any other shape or
    dtype is checked again, and the outcome is the same as without the memory."""
    x = pydiff.tensor(X, device=device)
    ok = pydiff.zeros((3,), device=device)
    for _ in range(3):
        m.sq(x, _result=ok)
    np.testing.assert_allclose(ok.numpy(), X**2, rtol=1e-6)
    with pytest.raises(ValueError, match="_result has shape"):
        m.sq(x, _result=pydiff.zeros((1,), device=device))
    with pytest.raises(TypeError, match="truncated"):
        m.sq(x, _result=pydiff.zeros((3,), dtype="int", device=device))
    y = pydiff.tensor(np.arange(6.0).reshape(2, 3), device=device)
    for _ in range(70):  # more shapes than a function remembers: still right, still checked
        m.sq(y, _result=pydiff.zeros((2, 3), device=device))
        m.sq(x, _result=ok)
    with pytest.raises(ValueError, match="_result has shape"):
        m.sq(y, _result=pydiff.zeros((3,), device=device))
    np.testing.assert_allclose(ok.numpy(), X**2, rtol=1e-6)
