"""Review of breaker43 / lanes43 (session 43, review43b): strided writes, the shifted-overlap
refusal, the lane scan. Values are checked against NumPy (float64 where values are computed).

Fixed here (each test failed before):
- ``copy_from_numpy`` / ``fill`` into a strided *bool* view wrote the wrong elements: SlangPy
  reads and writes a bool storage's 4-byte words as 1-byte bools, so the read-modify-write of
  ``staging.write_strided`` moved bytes (elements 3 and 4 set for a view of 3, 6, 9).
- A written view holding elements more than once (a stride of 0: an expanded view) ran
  silently: as ``_result`` of a call reading the very same view, the values were the function
  applied several times (``2x+1`` came back ``4x+3``); over an input of its own, the kept value
  depended on the device's order. Now refused naming ``_result``/the parameter.
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

SOURCE = "[Differentiable] float r43b_f(float a, float x) { return a * x + 1.0; }"


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s43_review43b", SOURCE, device=device)


def _view(t, shape, strides, offset, device):
    return pydiff.Tensor(t.native.view(shape=shape, strides=strides, offset=offset), device)


@pytest.mark.parametrize("how", ["copy_from_numpy", "fill", "copy_"])
def test_strided_bool_view_writes_its_elements(device, how):
    flags = np.array([True, False, True, False, True, False, False, True, False, True])
    x = pydiff.tensor(flags, dtype="bool", device=device)
    v = _view(x, (3,), (3,), 3, device)  # elements 3, 6, 9 (up to the storage's end)
    want = flags.copy()
    if how == "copy_from_numpy":
        v.copy_from_numpy(np.array([True, True, False]))
        want[3::3] = [True, True, False]
    elif how == "fill":
        v.fill(True)
        want[3::3] = True
    else:
        v.copy_(pydiff.tensor(np.array([False, True, True]), dtype="bool", device=device))
        want[3::3] = [False, True, True]
    np.testing.assert_array_equal(x.numpy(), want)
    np.testing.assert_array_equal(v.numpy(), want[3::3])


def test_contiguous_bool_writes_unchanged(device):
    x = pydiff.tensor(np.zeros(6, bool), dtype="bool", device=device)
    x.copy_from_numpy(np.array([1, 0, 1, 1, 0, 1], bool))
    np.testing.assert_array_equal(x.numpy(), [1, 0, 1, 1, 0, 1])
    _view(x, (2,), (1,), 4, device).fill(False)
    np.testing.assert_array_equal(x.numpy(), [1, 0, 1, 1, 0, 0])


def test_expanded_view_in_place_is_refused(mod, device):
    xs = np.arange(4, dtype=np.float32)
    x = pydiff.tensor(xs, device=device)
    expanded = _view(x, (3, 4), (0, 1), 0, device)  # each element three times
    with pytest.raises(ValueError, match=r"_result .*more than once"):
        mod.r43b_f(2.0, expanded, _result=expanded)
    np.testing.assert_array_equal(x.numpy(), xs)  # nothing ran
    mod.r43b_f(2.0, x, _result=x)  # the plain in-place call runs: 2x + 1 once
    np.testing.assert_allclose(x.numpy(), 2 * xs.astype(np.float64) + 1)


@pytest.mark.parametrize("first_contiguous", [False, True])
def test_result_view_holding_elements_twice_is_refused(mod, device, first_contiguous):
    src = pydiff.tensor(np.arange(12, dtype=np.float32).reshape(3, 4), device=device)
    out = pydiff.zeros((4,), device=device)
    if first_contiguous:  # (a plan for this layout from a call with a result of its own)
        mod.r43b_f(2.0, src, _result=pydiff.zeros((3, 4), device=device))
    with pytest.raises(ValueError, match=r"_result .*more than once"):
        mod.r43b_f(2.0, src, _result=_view(out, (3, 4), (0, 1), 0, device))
    np.testing.assert_array_equal(out.numpy(), np.zeros(4))


def test_legitimate_views_of_one_storage_still_run(mod, device):
    ys = np.arange(16, dtype=np.float32)
    y = pydiff.tensor(ys, device=device)
    mod.r43b_f(2.0, y.reshape(4, 4), _result=y.reshape(4, 4))
    mod.r43b_f(2.0, y, _result=y.reshape(1, 16))
    mod.r43b_f(2.0, y.reshape(16, 1), _result=y.reshape(16, 1))
    want = ys.astype(np.float64)
    for _ in range(3):
        want = 2 * want + 1
    np.testing.assert_allclose(y.numpy(), want)
    read_expanded = pydiff.tensor(np.arange(4, dtype=np.float32), device=device)
    z = pydiff.zeros((3, 4), device=device)  # an expanded view only read: runs
    mod.r43b_f(2.0, _view(read_expanded, (3, 4), (0, 1), 0, device), _result=z)
    np.testing.assert_allclose(z.numpy(), np.tile(2 * np.arange(4.0) + 1, (3, 1)))


LANES = """
import slangpy;
func lane_sum(x: float) -> float { return WaveActiveSum(x); }
float via_func(float a, float x) { return a * x + lane_sum(x); }
float lane_deep(float x, float s = max(1.0, min(2.0, abs(0.5)))) { return s * WaveActiveSum(x); }
float via_deep(float a, float x) { return a * x + lane_deep(x, 1.0); }
"""


@pytest.mark.parametrize("name", ["via_func", "via_deep"])
def test_lane_scan_finds_modern_and_deeply_nested_definitions(device, forced, name):
    from generated_paths import run_both_paths

    m = pydiff.load_module_from_source("s43_review43b_lanes", LANES, device=device)
    xs = np.arange(1, 41, dtype=np.float32)
    gen, ref, counts = run_both_paths(
        forced, lambda: [getattr(m, name)(2.0, pydiff.tensor(xs, device=device)).numpy()]
    )
    np.testing.assert_array_equal(gen[0], ref[0])
    assert any(k.startswith("declined: cross-lane") for k in counts), counts


@pytest.mark.parametrize(
    "head",
    [
        "func g(x: float) -> float",
        "float g(float x) throws MyError",
        "float g(float x) : SV_Target",
        "float g(float x, float s = max(1.0, min(2.0, abs(x))))",
    ],
)
def test_lane_scan_reads_definition_heads(head):
    from pydiff.lint_lanes import lane_effects

    src = head + " { return WaveActiveSum(x); }\nfloat f(float x) { return g(x) + x; }"
    assert lane_effects(src).get("f") == ("cross-lane", "'WaveActiveSum' in g()")


def test_lane_scan_keeps_common_code_off_the_list():
    from pydiff.lint_lanes import lane_effects

    src = """
    struct C { float r; float i; }
    C operator+(C a, C b) { C o; o.r = a.r + b.r; o.i = a.i + b.i; return o; }
    C operator*(C a, C b)
    { C o; o.r = a.r * b.r - a.i * b.i; o.i = a.r * b.i + a.i * b.r; return o; }
    func sq(x: float) -> float { return x * x; }
    float smooth(float e0, float e1, float x)
    { float t = clamp((x - e0) / (e1 - e0), 0.0, 1.0); return t * t * (3.0 - 2.0 * t); }
    float reduce_all(float x) { return WaveActiveSum(x); }
    float f(float x) { C a = {x, 1.0}; return (a * a + a).r + sq(x) + smooth(0.0, 1.0, x); }
    """
    found = lane_effects(src)
    assert "f" not in found and "sq" not in found and "smooth" not in found
    assert found["reduce_all"][0] == "cross-lane"


STRUCTS = """
struct S { float a; float b; };
float r43b_g(S s) { return s.a * 2.0 + s.b; }
"""


def test_struct_field_read_shifted_under_result_is_refused(device):
    """A struct field read through a view one element before ``_result`` on one buffer: the
    same race the plain-tensor case refuses (before: ran, errors up to 4.0 against the values
    read before the call, at 4096 elements)."""
    m = pydiff.load_module_from_source("s43_review43b_structs", STRUCTS, device=device)
    n = 4096
    xs = np.linspace(-1, 1, n + 1).astype(np.float32)
    base = pydiff.tensor(xs, device=device)
    x = _view(base, (n,), (1,), 0, device)
    with pytest.raises(ValueError, match=r"_result and parameter 's' are views of one storage"):
        m.r43b_g({"a": x, "b": 1.0}, _result=_view(base, (n,), (1,), 1, device))
    np.testing.assert_array_equal(base.numpy(), xs)
    out = pydiff.zeros((n,), device=device)  # a result of its own: runs
    m.r43b_g({"a": x, "b": 1.0}, _result=out)
    np.testing.assert_allclose(out.numpy(), 2 * xs[:n].astype(np.float64) + 1, rtol=1e-6)
    m.r43b_g({"a": x, "b": 1.0}, _result=x)  # the very same view: in place, runs
    np.testing.assert_allclose(base.numpy()[:n], 2 * xs[:n].astype(np.float64) + 1, rtol=1e-6)
