"""s49 fix49a: dtype and copy semantics that were silent.

- ``dtype=np.int64`` / ``astype(np.int64)`` gave an int32 tensor (values past int32 refused,
  the rest narrowed): now ``int64_t`` (64-bit, as NumPy's); ``np.uint64`` ``uint64_t``.
- ``dtype="int8_t"`` / ``"uint8_t"`` / ``"int16_t"`` / ``"uint16_t"`` failed in SlangPy's copy
  ("Numpy array is larger than the tensor storage"), ``dtype=np.int8`` with a bare KeyError:
  now stored (NumPy's names and types too); a NumPy type pydiff has no dtype for is a
  TypeError naming ``dtype=`` and the supported ones.
- ``for row in x: row.fill(0)`` (and ``m.scale(row)``, ``row += 1``, ...) wrote a copy (iteration
  yields copies, NumPy and PyTorch yield views): x silently unchanged. Now refused loudly.

References: NumPy's own arrays given the same operations.
"""

from __future__ import annotations


import numpy as np
import pytest

import pydiff

# -- 2. int64 ----------------------------------------------------------------------------

BIG = np.array([2**40 + 3, -(2**35) - 1, 7], dtype=np.int64)


@pytest.mark.parametrize("dtype", [np.int64, np.dtype(np.int64), "int64", "int64_t"])
def test_int64_asked_for_is_64_bit(device, dtype):
    x = pydiff.tensor(BIG, dtype=dtype, device=device)
    assert x.dtype == "int64_t"
    got = x.numpy()
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, BIG)  # (narrowed to int32 before: ValueError)
    z = pydiff.zeros((2, 3), dtype=dtype, device=device)
    assert z.dtype == "int64_t"
    np.testing.assert_array_equal(z.numpy(), np.zeros((2, 3), np.int64))
    f = pydiff.full((3,), 2**33, dtype=dtype, device=device)
    np.testing.assert_array_equal(f.numpy(), np.full(3, 2**33, np.int64))


def test_astype_int64_keeps_64_bits(device):
    ref = np.array([[0.0, 1.5, -2.7], [3e9, 4.0, -5e9]])  # beyond int32, inside int64
    x = pydiff.tensor(ref, dtype="double", device=device)
    y = x.astype(np.int64)
    assert y.dtype == "int64_t"
    np.testing.assert_array_equal(y.numpy(), ref.astype(np.int64))
    small = pydiff.tensor([1.0, -2.0, 3.9], device=device).astype(np.int64)
    assert small.numpy().dtype == np.int64
    np.testing.assert_array_equal(small.numpy(), np.array([1.0, -2.0, 3.9]).astype(np.int64))
    u = pydiff.tensor([1.0, 2.0], device=device).astype(np.uint64)
    assert u.dtype == "uint64_t" and u.numpy().dtype == np.uint64


def test_int64_data_default_stays_int(device):
    x = pydiff.tensor(np.arange(3, dtype=np.int64), device=device)  # documented default
    assert x.dtype == "int"


def test_int64_in_calls_and_operators(device):
    m = pydiff.load_module_from_source(
        "s49_fix49a_int64",
        "int64_t add64(int64_t a, int64_t b) { return a + b; }\n"
        "void inc64(inout int64_t a) { a = a + 1; }\n",
        device=device,
    )
    x = pydiff.tensor(BIG, dtype=np.int64, device=device)
    np.testing.assert_array_equal(m.add64(x, x, _result="tensor").numpy(), BIG + BIG)
    m.inc64(x)
    np.testing.assert_array_equal(x.numpy(), BIG + 1)
    small = pydiff.tensor([1, -2, 3], dtype=np.int64, device=device)
    # the operators promote integer tensors to float, as NumPy does with a float operand
    np.testing.assert_array_equal((small * 0.5).numpy(), np.array([1, -2, 3]) * 0.5)
    np.testing.assert_array_equal(small.sum().numpy(), 2.0)
    with pytest.raises(ValueError, match="no exact float value"):
        _ = x * 0.5  # 2**40 + 4 has no float32 value: refused, not rounded


def test_float64_stays_double(device):
    assert pydiff.tensor([1.0], dtype=np.float64, device=device).dtype == "double"
    assert pydiff.tensor([1.0], device=device).astype(np.float64).dtype == "double"
    assert pydiff.tensor(np.array([1.0]), device=device).dtype == "float"  # data's default


# -- 3. 8- and 16-bit integers ------------------------------------------------------------

SMALL = {
    "int8_t": np.int8,
    "uint8_t": np.uint8,
    "int16_t": np.int16,
    "uint16_t": np.uint16,
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_integer_dtypes(device, name):
    np_type = SMALL[name]
    info = np.iinfo(np_type)
    ref = np.array([[info.min, 0, 1, info.max, 5], [3, 2, 1, 0, info.max - 1]], np_type)
    for dtype in (name, np_type, np.dtype(np_type).name):
        x = pydiff.tensor(ref, dtype=dtype, device=device)
        assert x.dtype == name
        got = x.numpy()
        assert got.dtype == np_type
        np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(x[1, 1:4].numpy(), ref[1, 1:4])
    np.testing.assert_array_equal(x.T.numpy(), ref.T)
    x[0, :2] = 9
    want = ref.copy()
    want[0, :2] = 9
    np.testing.assert_array_equal(x.numpy(), want)
    f = pydiff.tensor([1.5, 2.0, -0.0], device=device)
    conv = np.array([1.5, 2.0, -0.0]).astype(np_type)
    np.testing.assert_array_equal(f.astype(dtype).numpy(), conv)
    assert f.astype(dtype).dtype == name
    with pytest.raises(ValueError, match="do not fit"):
        pydiff.tensor([int(info.max) + 1], dtype=dtype, device=device)
    odd = pydiff.zeros((7,), dtype=np_type, device=device).fill(3)  # (7 bytes: padded storage)
    np.testing.assert_array_equal(odd.numpy(), np.full(7, 3, np_type))
    np.testing.assert_array_equal((odd + 1).numpy(), np.full(7, 3, np_type) + 1.0)


def test_small_integer_tensors_in_a_call(device):
    m = pydiff.load_module_from_source(
        "s49_fix49a_small",
        "int16_t twice(int16_t a) { return a * int16_t(2); }\n"
        "float widen(uint8_t a) { return float(a); }\n",
        device=device,
    )
    a = np.array([-300, 0, 12000], np.int16)
    got = m.twice(pydiff.tensor(a, dtype=np.int16, device=device), _result="tensor")
    np.testing.assert_array_equal(got.numpy(), a * 2)
    b = np.array([0, 7, 255], np.uint8)
    got = m.widen(pydiff.tensor(b, dtype="uint8_t", device=device), _result="tensor")
    np.testing.assert_array_equal(got.numpy(), b.astype(np.float32))


@pytest.mark.parametrize("bad", [np.complex64, np.dtype("complex128"), np.float128, np.str_])
def test_a_numpy_dtype_pydiff_has_not_is_refused_by_name(device, bad):
    for make in (
        lambda: pydiff.tensor([1, 2], dtype=bad, device=device),
        lambda: pydiff.zeros((2,), dtype=bad, device=device),
        lambda: pydiff.tensor([1.0, 2.0], device=device).astype(bad),
    ):
        with pytest.raises(TypeError, match=r"dtype=.*supported: 'float'.*'int8_t'"):
            make()
