"""Host values beyond a float dtype's range are refused (NumPy's cast would give inf), and
``copy_`` from a non-tensor says to use ``copy_from_numpy``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff


@pytest.mark.parametrize(
    "entry, make",
    [
        ("pydiff.tensor", lambda d: pydiff.tensor([1.0, 1e39], device=d)),
        ("pydiff.tensor", lambda d: pydiff.tensor(np.array([70000]), dtype="half", device=d)),
        ("Tensor.fill", lambda d: pydiff.zeros((3,), device=d).fill(-1e39)),
        ("copy_from_numpy", lambda d: pydiff.zeros((2,), device=d).copy_from_numpy([0.0, 1e39])),
        ("pydiff.full", lambda d: pydiff.full((2,), 1e5, dtype="half", device=d)),
    ],
)
def test_finite_values_beyond_the_float_range_are_refused(device, entry, make):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not NumPy's overflow warning either
        with pytest.raises(ValueError, match=f"{entry}.*beyond the largest float.*inf"):
            make(device)


def test_values_at_the_edge_of_the_range_and_inf_nan_are_kept(device):
    biggest = float(np.finfo(np.float32).max)
    values = np.array([biggest, -biggest, np.inf, -np.inf, np.nan, 65504.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pydiff.tensor(values, device=device).numpy()
        half = pydiff.tensor(np.array([65504.0, -65504.0]), dtype="half", device=device).numpy()
    np.testing.assert_array_equal(got, values.astype(np.float32))
    np.testing.assert_array_equal(half, [65504.0, -65504.0])


def test_copy_from_a_numpy_array_names_copy_from_numpy(device):
    x = pydiff.zeros((3,), device=device)
    with pytest.raises(TypeError, match=r"copy_: the source is a ndarray.*copy_from_numpy"):
        x.copy_(np.ones(3))
    with pytest.raises(ValueError, match="copy_: .* does not match"):
        x.copy_(pydiff.zeros((4,), device=device))
    x.copy_(pydiff.tensor([1.0, 2.0, 3.0], device=device))
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0, 3.0])
