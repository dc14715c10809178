"""Session 49 break49b: dtype spellings and new-dtype paths (references: NumPy)."""

import numpy as np
import pytest

import pydiff


@pytest.mark.parametrize("spelling", ["<i8", "=i8", "<f4", ">i4", "|u1", "<u8"])
def test_numpy_byte_order_dtype_strings_mean_their_numpy_type(spelling):
    # Before: SlangPy segfaulted the process on a dtype name starting with '<' or '>'.
    want = np.dtype(spelling).newbyteorder("=")
    values = [3, 1] if want.kind == "u" else [3, -1]
    x = pydiff.tensor(values, dtype=spelling)
    got = x.numpy()
    assert got.dtype == want
    np.testing.assert_array_equal(got, np.array(values, dtype=want))


def test_int64_byte_order_string_keeps_values_past_2_53():
    big = 2**53 + 1
    x = pydiff.tensor([big, -big], dtype="<i8")
    assert x.numpy().tolist() == [big, -big]


@pytest.mark.parametrize("spelling", ["<x9", "(float", ")"])
def test_malformed_dtype_strings_are_refused_by_name(spelling):
    with pytest.raises(TypeError, match="dtype="):
        pydiff.tensor([1.0], dtype=spelling)
