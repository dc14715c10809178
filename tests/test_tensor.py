"""pydiff.Tensor: construction, dtypes, gradient buffers, host copies."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pydiff


def test_tensor_from_list_defaults_to_float(device):
    x = pydiff.tensor([1, 2, 3.5], device=device)
    assert (x.shape, x.dtype, x.requires_grad, x.grad) == ((3,), "float", False, None)
    np.testing.assert_array_equal(x.numpy(), np.array([1, 2, 3.5], np.float32))
    assert x.device is device


def test_integer_data_and_explicit_dtype(device):
    assert pydiff.tensor(np.arange(4), device=device).dtype == "int"
    assert pydiff.tensor(np.arange(4), dtype="float", device=device).dtype == "float"
    assert pydiff.tensor(np.arange(4, dtype=np.float16), device=device).dtype == "half"


def test_vector_dtype_takes_last_dimension(device):
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = pydiff.tensor(data, dtype="float3", device=device, requires_grad=True)
    assert p.shape == (4,) and p.dtype == "float3"
    np.testing.assert_array_equal(p.numpy(), data)
    assert p.grad.shape == (4,) and p.grad.dtype == "float3"
    np.testing.assert_array_equal(p.grad.numpy(), np.zeros((4, 3)))


def test_zeros_ones_empty(device):
    np.testing.assert_array_equal(pydiff.zeros((2, 3), device=device).numpy(), np.zeros((2, 3)))
    np.testing.assert_array_equal(pydiff.ones(5, device=device).numpy(), np.ones(5))
    np.testing.assert_array_equal(
        pydiff.ones((2,), dtype="float2", device=device).numpy(), np.ones((2, 2))
    )
    assert pydiff.empty((7,), device=device).shape == (7,)


def test_default_shared_gradient_buffer_is_zeroed(device):
    x = pydiff.ones((4,), device=device, requires_grad=True)
    assert x.grad is x.grad_in is x.grad_out
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(4))


def test_with_grads_shares_storage_and_keeps_given_buffers(device):
    x = pydiff.tensor([1.0, 2.0], device=device)
    upstream = pydiff.tensor([5.0, 6.0], device=device)
    y = x.with_grads(grad_in=upstream)
    assert y.grad_in is upstream and y.grad_out is not upstream
    np.testing.assert_array_equal(upstream.numpy(), [5, 6])  # SlangPy would have zeroed it
    np.testing.assert_array_equal(y.grad_out.numpy(), [0, 0])
    y.copy_from_numpy(np.array([9.0, 9.0]))
    np.testing.assert_array_equal(x.numpy(), [9, 9])  # same storage
    assert not x.requires_grad


def test_with_grads_ones(device):
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    np.testing.assert_array_equal(y.grad.numpy(), np.ones(3))


def test_zero_grad_and_detach(device):
    x = pydiff.zeros((3,), device=device, requires_grad=True)
    x.grad.fill(4.0)
    x.zero_grad()
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(3))
    d = x.detach()
    assert not d.requires_grad and d.shape == x.shape


def test_requires_grad_in_place_and_item(device):
    x = pydiff.tensor([2.5], device=device)
    assert x.requires_grad_().requires_grad
    assert x.item() == 2.5
    with pytest.raises(ValueError, match="one element"):
        pydiff.zeros((2,), device=device).item()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=64))
def test_round_trip_is_exact(values):
    x = pydiff.tensor(np.array(values, np.float32))
    np.testing.assert_array_equal(x.numpy(), np.array(values, np.float32))


def test_odd_sized_half_tensors_zero_completely(device):
    """SlangPy's clear() works in 4-byte words: the last of an odd number of halves used to
    keep its old value (a stale gradient after zero_grad)."""
    t = pydiff.tensor(
        np.array([3.0, 5.0, 7.0], np.float16), dtype="half", device=device, requires_grad=True
    )
    t.grad.copy_from_numpy(np.array([1.0, 2.0, 3.0], np.float16))
    t.zero_grad()
    np.testing.assert_array_equal(t.grad.numpy(), [0.0, 0.0, 0.0])
    for n in (1, 3, 5):
        np.testing.assert_array_equal(
            pydiff.zeros((n,), dtype="half", device=device).numpy(), np.zeros(n)
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a[None],  # stride 0 on the new axis: NumPy calls it contiguous
        lambda a: a[:, None],
        lambda a: np.expand_dims(a, 0),
        lambda a: np.repeat(a, 2)[::2],  # a strided view
        lambda a: a.astype(np.float64),
    ],
)
def test_host_arrays_of_any_strides_are_copied_exactly(device, make):
    arr = make(np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(pydiff.tensor(arr, device=device).numpy(), arr)
    t = pydiff.zeros(arr.shape, device=device).copy_from_numpy(arr)
    np.testing.assert_array_equal(t.numpy(), arr)


def test_a_raw_slangpy_device_can_be_the_default(device):
    pydiff.set_default_device(device.native)
    try:
        assert pydiff.default_device() is device
        x = pydiff.tensor([1.0, 2.0], requires_grad=True)
        assert x.device is device
    finally:
        pydiff.set_default_device(None)


@pytest.mark.parametrize(
    "shape, strides, offset",
    [
        ((16,), (1,), 0),  # the start of a large buffer
        ((16,), (1,), 1000),  # the middle
        ((4, 4), (4, 1), 4096),
        ((5,), (3,), 7),  # strided
        ((3, 2), (1, 3), 11),  # transposed layout
        ((4096,), (1,), 0),  # more than half the buffer: SlangPy's own read
    ],
)
def test_views_read_back_exactly(device, shape, strides, offset):
    import slangpy as spy

    base = np.arange(8192, dtype=np.float32)
    t = pydiff.tensor(base, device=device)
    n = t.native
    view = pydiff.Tensor(spy.Tensor(n.storage, n.dtype, list(shape), list(strides), offset), device)
    want = np.lib.stride_tricks.as_strided(
        base[offset:], shape=shape, strides=tuple(4 * s for s in strides)
    )
    np.testing.assert_array_equal(view.numpy(), want)


@pytest.mark.parametrize(
    "data, dtype, error, message",
    [
        (
            np.array([2**32 + 1, 2]),
            None,
            ValueError,
            "values from 2 to 4294967297 do not fit int32",
        ),
        ([2**40], "int", ValueError, "values from 1099511627776 to 1099511627776 do not fit int32"),
        (np.array([-1]), "uint", ValueError, "values from -1 to -1 do not fit uint32"),
        (np.array([2.7]), "int", ValueError, "2.7 is not a whole number"),
        (np.array([np.nan, 1.0]), "int", ValueError, "nan is not a whole number"),
        (np.array([np.inf]), "uint", ValueError, "inf is not a whole number"),
        (np.array([1 + 5j, 2.0]), "float", TypeError, "complex values"),
    ],
)
def test_host_values_a_cast_would_change_are_refused(device, data, dtype, error, message):
    # NumPy's cast wraps 2**32 + 1 to 1 in int32, truncates 2.7, makes NaN anything and drops
    # an imaginary part: a label wrapped into range would pass as another class
    with pytest.raises(error, match=f"pydiff.tensor: data: {message}"):
        pydiff.tensor(data, dtype=dtype, device=device)
    target = pydiff.zeros((np.asarray(data).size,), dtype=dtype or "int", device=device)
    with pytest.raises(error, match=f"copy_from_numpy: {message}"):
        target.copy_from_numpy(np.asarray(data).reshape(-1))
    assert not target.numpy().any()  # nothing written


def test_host_values_that_fit_are_taken_exactly(device):
    edges = np.array([2**31 - 1, -(2**31), 0], np.int64)
    assert pydiff.tensor(edges, device=device).numpy().tolist() == edges.tolist()
    whole = np.array([3.0, -4.0, 0.0])
    assert pydiff.tensor(whole, dtype="int", device=device).numpy().tolist() == [3, -4, 0]
    u = pydiff.tensor(np.array([2**32 - 1], np.int64), dtype="uint", device=device)
    assert u.numpy().tolist() == [2**32 - 1]
    t = pydiff.zeros((2,), dtype="int", device=device)
    with pytest.raises(ValueError, match="do not fit int32"):
        t.fill(2**40)
    assert t.fill(-7).numpy().tolist() == [-7, -7]
    # astype converts as NumPy and C do, toward zero
    x = pydiff.tensor([-2.7, 2.7, -0.5], device=device)
    assert x.astype("int").numpy().tolist() == np.trunc([-2.7, 2.7, -0.5]).astype(int).tolist()


def test_a_label_beyond_int32_is_not_wrapped_into_range(device):
    z = pydiff.zeros((1, 3), device=device)
    with pytest.raises(ValueError, match="do not fit int32"):
        pydiff.ops.cross_entropy(z, pydiff.tensor(np.array([2**32 + 1]), device=device))


def test_bool_conversions_take_non_zero_as_true(device):
    # NumPy's and C's rule: any non-zero value (NaN too) is true, never a truncation to int
    values = np.array([0.0, 0.5, -0.3, 2.0, np.nan, -0.0])
    want = values.astype(bool).tolist()
    x = pydiff.tensor(values, device=device)
    assert x.astype("bool").numpy().tolist() == want
    assert pydiff.tensor(values, dtype="bool", device=device).numpy().tolist() == want
    ints = pydiff.tensor(np.array([-1, 0, 2]), device=device)
    assert ints.astype("bool").numpy().tolist() == [True, False, True]
    assert pydiff.zeros((2,), dtype="bool", device=device).fill(0.5).numpy().tolist() == [1, 1]


def test_host_casts_of_small_and_foreign_dtypes(device):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float16 against int32's bounds warned of an overflow
        h = np.array([1.0, 2.0, -3.0], np.float16)
        assert pydiff.tensor(h, dtype="int", device=device).numpy().tolist() == [1, 2, -3]
        assert pydiff.tensor(h, device=device).astype("int").numpy().tolist() == [1, 2, -3]
    big_endian = np.array([1.5, -2.25], ">f4")
    t = pydiff.tensor(big_endian, device=device)
    assert t.dtype == "float" and t.numpy().tolist() == [1.5, -2.25]
    image = np.array([0, 17, 255], np.uint8)
    u = pydiff.tensor(image, device=device)
    assert u.dtype == "int" and u.numpy().tolist() == image.tolist()
    assert pydiff.tensor(np.array([-7], ">i2"), device=device).numpy().tolist() == [-7]
    with pytest.raises(TypeError, match="uint64 has no default Slang dtype"):
        pydiff.tensor(np.array([1], np.uint64), device=device)
