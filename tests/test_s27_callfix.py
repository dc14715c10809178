"""Fixes of the s27 breaker round: error messages that name the API the user called, and
refusals of calls pydiff cannot make right."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff


# --- 1. host values a cast would change: the message names the entry point -------------------


@pytest.mark.parametrize(
    "entry, make, error, message",
    [
        (
            "Tensor.astype",
            lambda d: pydiff.tensor([1.0, np.nan], device=d).astype("int"),
            ValueError,
            "nan is not a whole number",
        ),
        (
            "Tensor.astype",
            lambda d: pydiff.tensor([-1.0], device=d).astype("uint"),
            ValueError,
            "do not fit uint32",
        ),
        (
            "Tensor.fill",
            lambda d: pydiff.zeros((3,), dtype="int", device=d).fill(2.5),
            ValueError,
            "2.5 is not a whole number",
        ),
        (
            "Tensor.fill",
            lambda d: pydiff.zeros((3,), dtype="uint", device=d).fill(-1),
            ValueError,
            "do not fit uint32",
        ),
        (
            "Tensor.fill",
            lambda d: pydiff.zeros((3,), device=d).fill(1 + 2j),
            TypeError,
            "complex values",
        ),
        (
            "Tensor.fill",
            lambda d: pydiff.zeros((3,), device=d).fill("a"),
            TypeError,
            "text, not numbers",
        ),
        (
            "pydiff.linspace",
            lambda d: pydiff.linspace(0, 1, 5, dtype="int", device=d),
            ValueError,
            "0.25 is not a whole number",
        ),
        (
            "pydiff.arange",
            lambda d: pydiff.arange(-3, 3, dtype="uint", device=d),
            ValueError,
            "do not fit uint32",
        ),
        (
            "pydiff.full: fill_value",
            lambda d: pydiff.full((2,), 2**40, dtype="int", device=d),
            ValueError,
            "do not fit int32",
        ),
        (
            "pydiff.full: fill_value",
            lambda d: pydiff.full((2,), float("nan"), dtype="int", device=d),
            ValueError,
            "nan is not a whole number",
        ),
        (
            "pydiff.tensor: data",
            lambda d: pydiff.tensor(np.array([2**40]), dtype="int", device=d),
            ValueError,
            "do not fit int32",
        ),
        (
            "pydiff.tensor: data",
            lambda d: pydiff.tensor([-1], dtype="uint", device=d),
            ValueError,
            "do not fit uint32",
        ),
        (
            "pydiff.tensor: data",
            lambda d: pydiff.tensor([1 + 2j], dtype="float", device=d),
            TypeError,
            "complex values",
        ),
        (
            "copy_from_numpy",
            lambda d: pydiff.zeros((1,), dtype="int", device=d).copy_from_numpy(np.array([0.5])),
            ValueError,
            "0.5 is not a whole number",
        ),
    ],
)
def test_host_cast_errors_name_the_api_called(device, entry, make, error, message):
    with pytest.raises(error) as info:
        make(device)
    text = str(info.value)
    assert text.startswith(f"{entry}: "), text
    assert message in text
    if entry != "copy_from_numpy":
        assert "copy_from_numpy" not in text


def test_full_with_a_complex_fill_value_is_refused_not_truncated(device):
    # np.full(..., dtype=float64) dropped the imaginary part with only a ComplexWarning
    with pytest.raises(TypeError, match="pydiff.full: fill_value: complex values"):
        pydiff.full((2,), 1 + 2j, device=device)
    np.testing.assert_array_equal(pydiff.full((2,), 3, device=device).numpy(), [3.0, 3.0])


@pytest.mark.parametrize("make", [pydiff.rand, pydiff.randn])
def test_random_values_into_an_integer_dtype_are_refused_by_name(device, make):
    name = make.__name__
    with pytest.raises(TypeError, match=f"pydiff.{name}: dtype='int', but random values are"):
        make(3, dtype="int", device=device)
    assert make(3, seed=1, dtype="half", device=device).dtype == "half"
