"""`_result` tensors that would lose values are refused (issue 15, class 5), and the result
may be passed positionally to `.bwds` as in SlangPy (class 17). References are closed forms
in float64."""

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
