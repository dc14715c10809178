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


# -- 1. rows iteration gives -------------------------------------------------------------

ROWS_SOURCE = """
import slangpy;
void scale2(inout float x) { x = 2.0 * x; }
void setv(float v, out float y) { y = v; }
float sq(float a) { return a * a; }
void set_first(RWTensor<float, 1> t) { t[0] = 5.0; }
"""


@pytest.fixture(scope="module")
def rows_module(device):
    return pydiff.load_module_from_source("s49_fix49a_rows", ROWS_SOURCE, device=device)


REF = np.arange(6.0).reshape(2, 3)

ROW_WRITES = {
    "fill": lambda m, row: row.fill(0.0),
    "zero_": lambda m, row: row.zero_(),
    "copy_": lambda m, row: row.copy_(pydiff.zeros((3,), device=row.device)),
    "copy_from_numpy": lambda m, row: row.copy_from_numpy(np.zeros(3)),
    "setitem": lambda m, row: row.__setitem__(slice(None), 0.0),
    "inout": lambda m, row: m.scale2(row),
    "out by name": lambda m, row: m.setv(7.0, y=row),
    "_result": lambda m, row: m.sq(row, _result=row),
    "RWTensor": lambda m, row: m.set_first(row),
    "a reshape view": lambda m, row: row.reshape(3, 1).fill(0.0),
    "detach": lambda m, row: row.detach().fill(0.0),
    "copy.copy": lambda m, row: __import__("copy").copy(row).fill(0.0),
}


@pytest.mark.parametrize("case", sorted(ROW_WRITES))
def test_writing_a_row_iteration_gave_is_refused(device, rows_module, case):
    # NumPy: `for row in a: <write row>` changes `a` (rows are views); pydiff's rows are
    # copies, so the write is refused rather than silently lost
    x = pydiff.tensor(REF, device=device)
    with pytest.raises(TypeError, match="row that iterating a tensor gave") as info:
        for row in x:
            ROW_WRITES[case](rows_module, row)
    assert "row 0 of a tensor of shape (2, 3)" in str(info.value)
    assert "x[0] = " in str(info.value) and "row.clone()" in str(info.value)
    np.testing.assert_array_equal(x.numpy(), REF)  # nothing written


@pytest.mark.parametrize("op", ["+=", "-=", "*=", "/="])
def test_augmented_assignment_to_a_row_is_refused(device, op):
    x = pydiff.tensor(REF, device=device)
    with pytest.raises(TypeError, match=r"row \S+ value writes a row that iterating"):
        for row in x:
            exec(f"row {op} 2.0")
    np.testing.assert_array_equal(x.numpy(), REF)


def test_rows_of_unpacking_and_lists_are_refused_too(device):
    x = pydiff.tensor(REF, device=device)
    first, second = x
    with pytest.raises(TypeError, match=r"row 1 of a tensor of shape \(2, 3\)"):
        second.fill(1.0)
    with pytest.raises(TypeError, match=r"row 2 of a tensor of shape \(3,\)"):
        list(pydiff.tensor([1.0, 2.0, 3.0], device=device))[2].fill(0.0)  # 0-d rows
    np.testing.assert_array_equal(x.numpy(), REF)


def test_the_documented_ways_give_numpys_result(device, rows_module):
    ref = REF.copy()
    for row in ref:  # NumPy: rows are views
        row *= 2.0
    x = pydiff.tensor(REF, device=device)
    for i, row in enumerate(x):  # read the row, write through x
        x[i] = row * 2.0
    np.testing.assert_array_equal(x.numpy(), ref)
    y = pydiff.tensor(REF, device=device)
    for i, row in enumerate(y):  # a shader call on a copy, written back
        r = row.clone()
        rows_module.scale2(r)
        y[i] = r
    np.testing.assert_array_equal(y.numpy(), ref)


def test_reading_rows_and_writing_their_clones_work(device, rows_module):
    x = pydiff.tensor(REF, device=device)
    for i, row in enumerate(x):
        np.testing.assert_array_equal(row.numpy(), REF[i])
        np.testing.assert_array_equal(rows_module.sq(row, _result="tensor").numpy(), REF[i] ** 2)
        np.testing.assert_array_equal((row + 1.0).numpy(), REF[i] + 1.0)
        c = row.clone().fill(0.0)  # a copy of its own: written
        np.testing.assert_array_equal(c.numpy(), np.zeros(3))
        total = row  # rebinding a name, then +, is not a write
        total = total + 1.0
    np.testing.assert_array_equal(x.numpy(), REF)
    t = pydiff.tensor(REF, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        loss = sum((row * row).sum() for row in t)
    tape.backward(loss)
    np.testing.assert_allclose(t.grad.numpy(), 2 * REF)  # d/dx sum x^2 = 2x


def test_augmented_assignment_elsewhere_still_rebinds(device):
    x = pydiff.tensor([1.0, 2.0], device=device)
    y = x
    y += 1.0  # no row: computed as y + 1.0 (pydiff has no in-place operators)
    np.testing.assert_array_equal(y.numpy(), [2.0, 3.0])
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0])
    z = pydiff.tensor(np.arange(4.0), device=device)
    z[1:3] += 1.0  # NumPy's result: the slice written back
    ref = np.arange(4.0)
    ref[1:3] += 1.0
    np.testing.assert_array_equal(z.numpy(), ref)


def test_a_temporary_copy_at_a_writable_tensor_parameter_is_refused(device, rows_module):
    # NumPy: a function writing a[1] (a view) changes `a`; here x[1] is a copy nothing holds
    x = pydiff.tensor(REF, device=device)
    with pytest.raises(TypeError, match="parameter 't' would write x\\[1\\], a temporary copy"):
        rows_module.set_first(x[1])
    np.testing.assert_array_equal(x.numpy(), REF)
    c = x[1]  # a named copy is written
    rows_module.set_first(c)
    np.testing.assert_array_equal(c.numpy(), [5.0, 4.0, 5.0])


# -- host values for 8- and 16-bit integer parameters -------------------------------------


@pytest.fixture(scope="module")
def small_params(device):
    return pydiff.load_module_from_source(
        "s49_fix49a_small_params",
        "int8_t neg8(int8_t a) { return -a; }\n"
        "uint16_t twice16(uint16_t a) { return a * uint16_t(2); }\n"
        "[Differentiable] float times(float x, no_diff int8_t k) { return x * float(k); }\n",
        device=device,
    )


def test_small_integer_parameters_take_host_values(device, small_params):
    # (SlangPy: std::bad_cast for 1.0, a Slang compile error for a list, no int8 array at all)
    for value in ([1, -2, 127], np.array([1, -2, 127], np.int64), np.array([1, -2, 127], np.int8)):
        got = small_params.neg8(value, _result="tensor")
        np.testing.assert_array_equal(got.numpy(), -np.array([1, -2, 127], np.int8))
    assert small_params.neg8(1.0, _result="tensor").numpy() == -1
    got = small_params.twice16(np.array([0, 7, 30000], np.int32), _result="tensor")
    np.testing.assert_array_equal(got.numpy(), np.array([0, 7, 30000], np.uint16) * 2)
    x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True, device=device)
    y = small_params.times(x, [2, -1, 3], _result="tensor")
    small_params.times.bwds(x, [2, -1, 3], _result=y.with_grads(ones=True))
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, -1.0, 3.0])  # d(x k)/dx = k


@pytest.mark.parametrize(
    "value, error, text",
    [
        (200, ValueError, r"200 is outside the range of int8_t \[-128, 127\]"),
        (-129, ValueError, "outside the range of int8_t"),
        (2.5, ValueError, "not a whole number"),
        ([1, 300], ValueError, "do not fit int8"),
        (np.array([1, 200], np.uint8), ValueError, "do not fit int8"),
        (True, TypeError, "pass an integer"),
    ],
)
def test_small_integer_parameters_refuse_values_they_cannot_hold(small_params, value, error, text):
    # NumPy: np.array(200).astype(np.int8) wraps to -56; refused by name instead
    with pytest.raises(error, match=text) as info:
        small_params.neg8(value, _result="tensor")
    assert "parameter 'a' (int8_t)" in str(info.value)


@pytest.mark.parametrize("dtype", ["double", "int64_t", "int8_t", "float3", "uint16_t"])
def test_a_tensor_as_data_keeps_its_dtype(device, dtype):
    # NumPy: np.array(a) keeps a's dtype (a double tensor's values were rounded to float32,
    # a float3 tensor became a (..., 3) float one)
    ref = {
        "double": np.array([1 + 2.0**-40, -3.0]),
        "int64_t": np.array([2**40, -5], np.int64),
        "int8_t": np.array([-128, 127], np.int8),
        "float3": np.arange(6.0, dtype=np.float32).reshape(2, 3),
        "uint16_t": np.array([65535, 0], np.uint16),
    }[dtype]
    x = pydiff.tensor(ref, dtype=dtype, device=device)
    y = pydiff.tensor(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y.numpy(), np.array(ref))
    assert pydiff.tensor(x, dtype="float").dtype == "float"  # asked for: converted


def test_rows_of_reversed_are_refused_too(device):
    x = pydiff.tensor(REF, device=device)
    rows = [row.numpy() for row in reversed(x)]  # NumPy: reversed(a) gives a[1], a[0]
    np.testing.assert_array_equal(rows, [REF[i] for i in reversed(range(len(REF)))])
    with pytest.raises(TypeError, match=r"row 1 of a tensor of shape \(2, 3\)"):
        for row in reversed(x):
            row.fill(0.0)
    np.testing.assert_array_equal(x.numpy(), REF)


# -- a narrower integer _result -------------------------------------------------------------

RESULTS_SOURCE = """
int64_t add64(int64_t a, int64_t b) { return a + b; }
int add32(int a, int b) { return a + b; }
bool positive(int a) { return a > 0; }
"""


@pytest.fixture(scope="module")
def results_module(device):
    return pydiff.load_module_from_source("s49_fix49a_results", RESULTS_SOURCE, device=device)


@pytest.mark.parametrize(
    "fn, into",
    [
        ("add64", "int"),
        ("add64", "float"),
        ("add32", "uint"),
        ("add32", "int8_t"),
        ("add32", "half"),
    ],
)
def test_a_result_the_result_tensor_cannot_hold_is_refused(device, results_module, fn, into):
    # NumPy: np.can_cast(result, into, "safe") is False (int64 2**40 + 2 into int32 wrapped to 2)
    a = np.array([2**30, -5], np.int64)
    with pytest.raises(TypeError, match=f"_result has dtype {into} but the function returns"):
        getattr(results_module, fn)(a, 2, _result=pydiff.zeros((2,), dtype=into, device=device))


@pytest.mark.parametrize(
    "fn, into",
    [("add32", "int64_t"), ("add32", "double"), ("add64", "double"), ("positive", "int")],
)
def test_a_result_tensor_holding_every_value_is_written(device, results_module, fn, into):
    a = np.array([2**30, -5], np.int64)
    out = pydiff.zeros((2,), dtype=into, device=device)
    getattr(results_module, fn)(a, *([2] if fn != "positive" else []), _result=out)
    want = a > 0 if fn == "positive" else a + 2  # NumPy's values, then a safe cast
    np.testing.assert_array_equal(out.numpy(), want.astype(out.numpy().dtype))


def test_a_numpy_result_array_that_cannot_hold_the_result_is_refused(device, results_module):
    a = np.array([2**40, -5], np.int64)
    with pytest.raises(TypeError, match="_result is a NumPy array of dtype int32 but"):
        results_module.add64(a, 2, _result=np.zeros(2, np.int32))  # (wrapped to [2, -3])
    with pytest.raises(TypeError, match="_result is a NumPy array of dtype float16 but"):
        results_module.add32(np.array([3000, 5]), 1, _result=np.zeros(2, np.float16))
    out = np.zeros(2, np.int64)  # int32 -> int64: safe, written
    results_module.add32(np.array([3000, -5], np.int32), 1, _result=out)
    np.testing.assert_array_equal(out, np.array([3000, -5]) + 1)


# -- a NumPy float64 dtype object compared equal to the name "float" ----------------------


@pytest.mark.parametrize("make", ["zeros", "empty", "ones"])
def test_numpy_float64_dtype_object_is_double(device, make):
    # np.dtype(np.float64) == "float" is True in NumPy: the constructors took it for 'float'
    x = getattr(pydiff, make)((3,), dtype=np.dtype(np.float64), device=device)
    assert x.dtype == "double" and x.numpy().dtype == np.float64


def test_arange_with_a_numpy_int64_dtype_object(device):
    x = pydiff.arange(2**33, 2**33 + 3, dtype=np.dtype(np.int64), device=device)
    assert x.dtype == "int64_t"
    np.testing.assert_array_equal(x.numpy(), np.arange(2**33, 2**33 + 3, dtype=np.int64))


def test_from_torch_does_not_narrow_an_asked_float64(device):
    torch = pytest.importorskip("torch")
    t = torch.tensor([1.0 + 2.0**-40, 2.0], dtype=torch.float64)
    # (was float32: 1 + 2**-40 -> 1; then refused; since break49b the exact double values)
    exact = pydiff.from_torch(t, dtype=np.dtype(np.float64), device=device)
    assert exact.dtype == "double" and exact.numpy().tolist() == t.tolist()
    narrowed = pydiff.from_torch(t, dtype="float", device=device)  # asked for: narrowed
    np.testing.assert_array_equal(narrowed.numpy(), t.numpy().astype(np.float32))
