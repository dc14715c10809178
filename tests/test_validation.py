"""Every bad input gets a clear Python exception naming what is wrong, before dispatch."""

import numpy as np
import pytest
import slangpy as spy

import pydiff
from conftest import SHADERS


def test_grad_shape_mismatch(device):
    x = pydiff.zeros((3,), device=device)
    with pytest.raises(
        ValueError,
        match=r"grad_out: gradient shape \(4,\) does not match the primal's shape \(3,\)",
    ):
        x.with_grads(grad_out=pydiff.zeros((4,), device=device))


def test_grad_dtype_mismatch(device):
    x = pydiff.zeros((3,), device=device)
    with pytest.raises(ValueError, match="grad_in: gradient dtype 'half'"):
        x.with_grads(grad_in=pydiff.zeros((3,), dtype="half", device=device))


def test_integer_tensor_cannot_have_grads(device):
    with pytest.raises(TypeError, match="dtype 'int' cannot have gradients"):
        pydiff.zeros((3,), dtype="int", device=device, requires_grad=True)


def test_bwds_of_non_differentiable_function(device, load):
    m = load("calls", device)
    with pytest.raises(TypeError, match=r"calls\.not_differentiable is not differentiable"):
        m.not_differentiable.bwds(pydiff.zeros((2,), device=device), _result=1.0)


def test_bwds_without_result(device, load):
    m = load("calls", device)
    with pytest.raises(ValueError, match="needs _result="):
        m.square.bwds(pydiff.zeros((2,), device=device, requires_grad=True))


def test_bwds_result_without_grads(device, load):
    m = load("calls", device)
    x = pydiff.zeros((2,), device=device, requires_grad=True)
    with pytest.raises(ValueError, match="_result has no gradient buffer"):
        m.square.bwds(x, _result=pydiff.zeros((2,), device=device))


def test_number_result_for_vector_function(device, load):
    m = load("calls", device)
    v = pydiff.zeros((2,), dtype="float2", device=device)
    with pytest.raises(TypeError, match="result is vector<float,2>"):
        m.scale2.bwds(1.0, v, _result=1.0)


def test_output_tensor_without_grads(device, load):
    m = load("calls", device)
    x = pydiff.zeros((2,), device=device, requires_grad=True)
    with pytest.raises(ValueError, match="parameter 'y' is written by the call"):
        m.write_out.bwds(x, pydiff.zeros((2,), device=device))


def test_output_interface_tensor_without_grads(device, load):
    m = load("seeds", device)
    x = pydiff.zeros((4,), device=device, requires_grad=True)
    with pytest.raises(ValueError, match="parameter 'result' is written"):
        m.polynomial_tensor.bwds(
            spy.grid((4,)), 2.0, 8.0, -1.0, x, pydiff.zeros((4,), device=device)
        )


def test_concrete_difftensor_without_grads(device, load):
    m = load("calls", device)
    with pytest.raises(
        ValueError, match=r"parameter 't' is a concrete DiffTensor<float, 1>.*IDiffTensor"
    ):
        m.concrete_reader(spy.grid((2,)), pydiff.zeros((2,), device=device), _result="tensor")
    with pytest.raises(ValueError, match=r"parameter 't' is a concrete DiffTensor"):
        m.concrete_reader.bwds(spy.grid((2,)), pydiff.zeros((2,), device=device), _result=1.0)


def test_tensor_from_another_device(device, load):
    m = load("calls", device)
    other = pydiff.create_device(device.type, include_paths=[str(SHADERS)])
    assert other != device
    x = pydiff.zeros((2,), device=other)
    with pytest.raises(ValueError, match="parameter 'x' is on device"):
        m.square(x, _result="tensor")


def test_argument_errors(device, load):
    m = load("calls", device)
    with pytest.raises(TypeError, match=r"has no parameter 'xx'; did you mean 'x'"):
        m.square(xx=1.0)
    with pytest.raises(TypeError, match="takes 1 arguments but 2 were given"):
        m.square(1.0, 2.0)
    with pytest.raises(TypeError, match="missing argument"):
        m.scale2(1.0)


def test_copy_from_numpy_shape(device):
    x = pydiff.zeros((2,), dtype="float3", device=device)
    with pytest.raises(ValueError, match=r"needs \(2, 3\)"):
        x.copy_from_numpy(np.zeros((2, 2)))


def test_bad_shapes_and_dtypes(device):
    with pytest.raises(ValueError, match="positive"):
        pydiff.zeros((0, 3), device=device)
    with pytest.raises(TypeError, match="dtype='floot'"):
        pydiff.zeros((2,), dtype="floot", device=device)
    with pytest.raises(ValueError, match="last dimension"):
        pydiff.tensor(np.zeros((4, 2)), dtype="float3", device=device)


def test_result_must_not_be_numpy_or_raw_tensor(device, load):
    m = load("calls", device)
    x = pydiff.zeros((2,), device=device, requires_grad=True)
    with pytest.raises(TypeError, match="_result must be a pydiff.Tensor.*not ndarray"):
        m.square.bwds(x, _result=np.ones(2, np.float32))
    with pytest.raises(TypeError, match="raw slangpy.Tensor"):
        m.square.bwds(x.native, _result=1.0)
