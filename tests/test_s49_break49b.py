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


@pytest.mark.parametrize(
    ("torch_name", "asked", "values"),
    [
        ("int64", np.int64, [2**53 + 1, -(2**62)]),
        ("int64", "int64_t", [2**53 + 1, 5]),
        ("int8", np.int8, [-128, 127]),
        ("uint8", "uint8", [0, 255]),
        ("int16", np.int16, [-32768, 32767]),
        ("float64", np.float64, [0.1, 1e300]),
    ],
)
def test_from_torch_takes_same_width_dtypes_when_asked(torch_name, asked, values):
    # Before: refused, "torch.int64 with dtype=" although dtype= had been given.
    torch = pytest.importorskip("torch")
    t = torch.tensor(values, dtype=getattr(torch, torch_name))
    x = pydiff.from_torch(t, dtype=asked)
    want = t.numpy()
    got = x.numpy()
    assert got.dtype == want.dtype
    assert got.tolist() == want.tolist()


def test_from_torch_same_width_still_refuses_a_gradient():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="requires_grad"):
        pydiff.from_torch(torch.tensor([1, 2]), dtype=np.int64, requires_grad=True)
