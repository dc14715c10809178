"""s50 fix50: defects earlier sessions noticed and left.

1. ``torch.from_dlpack(row)`` / ``pydiff.to_torch(row)`` of a row iteration gave: on CUDA the
   export is zero-copy, a view of the row's memory, itself a copy of the tensor's (pydiff's
   iteration yields copies): torch's writes were silently lost. Now refused there, naming
   ``torch.from_dlpack(x)[i]``, ``x[i] = ...`` and ``row.clone()``; on the host-copy devices
   every export is a copy (documented), so a row reads as any tensor.
5. ``to_torch`` of int64_t / uint64_t / 8- and 16-bit integer / double tensors was refused,
   ``pydiff.from_dlpack`` of them too (with no ``dtype=`` to ask): now handed over exactly.

References: NumPy's arrays and torch's own tensors (values, dtypes).
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import dlpack_interop

torch = pytest.importorskip("torch")

REF = np.arange(6.0, dtype=np.float32).reshape(2, 3)


# -- 1. rows through DLPack ---------------------------------------------------------------


def _zero_copy(monkeypatch, device):
    """The exports' CUDA decisions taken, as on a CUDA device (none here)."""
    monkeypatch.setattr(dlpack_interop, "_cuda_export", lambda x: True)
    monkeypatch.setattr(device, "type", "cuda")


def test_a_zero_copy_export_of_a_row_is_refused(device, monkeypatch):
    # torch: torch.from_dlpack(a)[0] is a view; writes through it change a. A zero-copy
    # export of pydiff's row would be a view of the row's copy: refused, before any CUDA call
    x = pydiff.tensor(REF, device=device)
    rows = list(x)
    _zero_copy(monkeypatch, device)
    # (torch.from_dlpack(row) calls row.__dlpack__(); a CPU torch stops first at CUDA here)
    for export in (lambda r: r.__dlpack__(stream=None), pydiff.to_torch):
        with pytest.raises(TypeError, match="row that iterating a tensor gave") as info:
            export(rows[0])
        text = str(info.value)
        assert "zero-copy export on CUDA" in text and "row 0 of a tensor of shape (2, 3)" in text
        assert "torch.from_dlpack(x)[0]" in text and "x[0] = " in text and "row.clone()" in text
        with pytest.raises(TypeError, match=r"row 1 of a tensor of shape \(2, 3\)"):
            export(rows[1].reshape(3))  # a view of the row: refused too
    monkeypatch.undo()
    np.testing.assert_array_equal(x.numpy(), REF)
    for i, row in enumerate(x):  # pydiff.from_dlpack(row) copies: not refused
        np.testing.assert_array_equal(pydiff.from_dlpack(row, device=device).numpy(), REF[i])


def test_rows_export_as_copies_where_every_export_is_one(device):
    if device.type == "cuda":
        pytest.skip("the host-copy devices' export")
    x = pydiff.tensor(REF, device=device)
    for i, row in enumerate(x):  # reads keep working: NumPy's rows' values
        np.testing.assert_array_equal(torch.from_dlpack(row).numpy(), REF[i])
        np.testing.assert_array_equal(pydiff.to_torch(row).numpy(), REF[i])
        np.testing.assert_array_equal(np.from_dlpack(row), REF[i])
        np.testing.assert_array_equal(torch.from_dlpack(row.clone()).numpy(), REF[i])


# -- 5. the newer integer dtypes and double through torch and DLPack -----------------------

WIDE = {
    "int64_t": np.array([2**40 + 3, -(2**35) - 1, 7], np.int64),
    "uint64_t": np.array([2**63 + 5, 0, 9], np.uint64),
    "int8_t": np.array([-128, 0, 127], np.int8),
    "uint8_t": np.array([0, 7, 255], np.uint8),
    "int16_t": np.array([-32768, 5, 32767], np.int16),
    "uint16_t": np.array([0, 1, 65535], np.uint16),
    "double": np.array([1 + 2.0**-40, -3.0, 1e300]),
}


@pytest.mark.parametrize("name", sorted(WIDE))
def test_to_torch_and_back_keep_the_dtype_and_values(device, name):
    ref = WIDE[name]
    x = pydiff.tensor(ref, dtype=name, device=device)
    for t in (pydiff.to_torch(x), torch.from_dlpack(x)):
        assert t.dtype == getattr(torch, ref.dtype.name)
        np.testing.assert_array_equal(t.cpu().numpy(), ref)
    np.testing.assert_array_equal(pydiff.to_torch(x.reshape(3, 1).T).numpy(), ref[None, :])
    t = torch.from_numpy(ref)
    for back in (
        pydiff.from_dlpack(t, dtype=name, device=device),
        pydiff.from_dlpack(ref, dtype=ref.dtype, device=device),  # a NumPy producer
        pydiff.from_dlpack(pydiff.to_torch(x), dtype=ref.dtype.type, device=device),
    ):
        assert back.dtype == name
        np.testing.assert_array_equal(back.numpy(), ref)


@pytest.mark.parametrize("name", sorted(set(WIDE) - {"uint64_t"}))
def test_from_dlpack_without_dtype_names_the_one_to_ask(device, name):
    ref = WIDE[name]
    with pytest.raises(TypeError, match=f"pass dtype='{name}' for the values as they are"):
        pydiff.from_dlpack(torch.from_numpy(ref), device=device)
    with pytest.raises(TypeError, match=f"dtype {ref.dtype.name} cannot be converted"):
        pydiff.from_dlpack(ref, device=device)


def test_from_dlpack_narrows_when_asked(device):
    got = pydiff.from_dlpack(torch.tensor([3, -4]), dtype="int", device=device)
    assert got.dtype == "int"
    np.testing.assert_array_equal(got.numpy(), np.array([3, -4], np.int32))
    with pytest.raises(ValueError, match="do not fit dtype 'int'"):
        pydiff.from_dlpack(np.array([2**40]), dtype="int", device=device)
    got = pydiff.from_dlpack(np.array([0.1, 2.5]), dtype="float", device=device)
    np.testing.assert_array_equal(got.numpy(), np.array([0.1, 2.5]).astype(np.float32))
    f = pydiff.from_dlpack(np.ones(2, np.float32), dtype="float", device=device)
    assert f.dtype == "float"  # the exact dtypes, asked for by name: as before


def test_to_torch_of_a_dtype_torch_lacks_is_refused(device, monkeypatch):
    x = pydiff.tensor(WIDE["uint16_t"], dtype="uint16_t", device=device)
    monkeypatch.delattr(torch, "uint16")  # (torch before 2.3 had no uint16)
    with pytest.raises(TypeError, match=r"uint16_t.*has no torch.uint16.*x.astype"):
        pydiff.to_torch(x)


# -- 2, 4. bool and 8/16-bit integer results into NumPy -----------------------------------

RESULTS_SOURCE = """
import slangpy;
bool positive(float a) { return a > 0; }
int8_t neg8(int8_t a) { return -a; }
uint8_t inc8(uint8_t a) { return a + uint8_t(1); }
int16_t twice16(int16_t a) { return a * int16_t(2); }
uint16_t id16(uint16_t a) { return a; }
vector<int8_t, 2> pair8(int8_t a) { return vector<int8_t, 2>(a, -a); }
[Differentiable]
void sq_at(int i, IRWDiffTensor<float, 1> d) { float v = d[i]; d[i] = v * v; }
[Differentiable]
float read_at(int i, IDiffTensor<float, 1> d) { return d[i] * d[i]; }
"""


@pytest.fixture(scope="module")
def results(device):
    return pydiff.load_module_from_source("s50_fix50_results", RESULTS_SOURCE, device=device)


A = np.array([1.5, -2.0, 0.0, 3.0], np.float32)


def test_a_bool_result_into_a_numpy_bool_array(results):
    # NumPy: out = np.zeros(n, bool); np.greater(a, 0, out=out) writes out and returns it
    out = np.zeros(4, bool)
    got = results.positive(A, _result=out)
    assert got is out
    np.testing.assert_array_equal(out, A > 0)  # (SlangPy: no marshall for dtype('bool'))
    got = results.positive(A, _result="numpy")  # (SlangPy: "numpy array size does not match")
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, A > 0)
    assert results.positive(np.float32(-1.0), _result="numpy") == np.False_
    with pytest.raises(ValueError, match=r"_result is a NumPy array of shape \(3,\).*\(4,\)"):
        results.positive(A, _result=np.zeros(3, bool))
    with pytest.raises(TypeError, match="_result='numpy' in a call with torch tensors"):
        results.positive(torch.from_numpy(A), _result="numpy")  # (as before: torch's path)


CASES = {
    "neg8": (np.array([-127, 0, 5, 127], np.int8), lambda a: -a),
    "inc8": (np.array([0, 7, 254], np.uint8), lambda a: a + np.uint8(1)),
    "twice16": (np.array([-300, 0, 12000], np.int16), lambda a: a * np.int16(2)),
    "id16": (np.array([0, 1, 65535], np.uint16), lambda a: a),
}


@pytest.mark.parametrize("fn", sorted(CASES))
def test_small_integer_results_as_numpy(results, fn):
    a, ref = CASES[fn]
    want = ref(a)  # NumPy's values and dtype
    got = getattr(results, fn)(a, _result="numpy")
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    two_d = getattr(results, fn)(np.stack([a, a]), _result="numpy")
    np.testing.assert_array_equal(two_d, np.stack([want, want]))
    out = np.zeros(a.shape, a.dtype)
    assert getattr(results, fn)(a, _result=out) is out
    np.testing.assert_array_equal(out, want)
    scalar = getattr(results, fn)(a[1].item(), _result="numpy")
    assert scalar.shape == () and scalar == want[1]


def test_a_small_integer_vector_result_as_numpy(results):
    a = np.array([3, -4], np.int8)
    got = results.pair8(a, _result="numpy")
    np.testing.assert_array_equal(got, np.stack([a, -a], axis=-1))
    assert got.dtype == np.int8


# -- 3. a host array at a diff tensor parameter of .bwds ------------------------------------


def test_a_numpy_array_at_a_diff_tensor_parameter_of_bwds(device, results):
    values = np.array([3.0, -2.0], np.float32)
    with pytest.raises(TypeError, match=r"sq_at.bwds: parameter 'd' \(IRWDiffTensor<float, 1>\)"):
        results.sq_at.bwds(0, values)
    with pytest.raises(TypeError, match="pydiff.tensor\\(values, requires_grad=True\\)"):
        results.sq_at.bwds(0, values.tolist())
    if device.type != "cuda":
        with pytest.raises(TypeError, match=r"parameter 'd' \(IDiffTensor<float, 1>\)"):
            results.read_at.bwds(0, values, _result=pydiff.tensor([1.0]).with_grads(ones=True))
    # what the message says works: d(v^2)/dv = 2 v at element 0, 1 elsewhere (upstream g)
    x = pydiff.tensor(values, requires_grad=True, device=device)
    results.sq_at(0, x)
    g = np.array([1.0, 2.0], np.float32)
    x.grad.copy_from_numpy(g)
    results.sq_at.bwds(0, x)
    np.testing.assert_allclose(x.grad.numpy(), [2 * values[0] * g[0], g[1]], rtol=1e-6)


# -- 6. the messages' suggestions work -------------------------------------------------------


def test_int64_data_past_int32_suggests_dtype_int64(device):
    data = np.array([2**40 + 1, -3], np.int64)
    with pytest.raises(ValueError, match=r"do not fit int32.*pass dtype=np.int64") as info:
        pydiff.tensor(data, device=device)
    hint = str(info.value).rpartition("pass ")[2]  # what it says to pass, taken as it is
    x = pydiff.tensor(data, dtype=eval(hint.removeprefix("dtype="), {"np": np}), device=device)
    np.testing.assert_array_equal(x.numpy(), data)  # NumPy's values, exactly
    with pytest.raises(ValueError, match=r"do not fit uint32.*pass dtype=np.uint64"):
        pydiff.tensor(np.array([2**33]), dtype="uint", device=device)


def test_an_integer_operator_past_float32_suggests_what_works(device):
    ref = np.array([2**25 + 1, -7, 2**40 + 3], np.int64)
    x = pydiff.tensor(ref, dtype=np.int64, device=device)
    with pytest.raises(ValueError, match="no exact float value") as info:
        _ = x + 1  # (it suggested dtype='int' and dtype='double': neither works for x + 1)
    text = str(info.value)
    assert text.startswith("add: the int64_t tensor's integer") and "dtype='int'" not in text
    assert "pydiff.tensor(x.numpy() + 1, dtype=x.numpy().dtype)" in text
    y = pydiff.tensor(x.numpy() + 1, dtype=x.numpy().dtype, device=device)  # as it says
    assert y.dtype == "int64_t"
    np.testing.assert_array_equal(y.numpy(), ref + 1)  # NumPy's exact sum
    m = pydiff.load_module_from_source(
        "s50_fix50_add64", "int64_t inc(int64_t a) { return a + 1; }\n", device=device
    )
    np.testing.assert_array_equal(m.inc(x, _result="tensor").numpy(), ref + 1)


def test_data_past_float32_suggests_an_integer_dtype_that_holds_it(device):
    for value, kept in ((2**25 + 1, "int"), (2**40 + 1, "int64_t")):
        with pytest.raises(ValueError, match=f"keep it an integer \\(dtype='{kept}'\\)"):
            pydiff.tensor(np.array([value]), dtype="float", device=device)
        got = pydiff.tensor(np.array([value]), dtype=kept, device=device).numpy()
        assert got.tolist() == [value]  # exact, as the message promises
