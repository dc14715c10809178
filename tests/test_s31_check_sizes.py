"""`pydiff check` sizes tensor arguments so that the function reads nothing past their ends.

Found on an H200 (2026-11-27): samples/pinn_poisson.slang loops over 32 units, the check gave
it 4-element tensors, and on CUDA the reads past their ends returned earlier tests' leftover
memory: every gradient of the check came out off by one common factor, only in whole-suite
runs. On Vulkan the same reads returned 0, so the check silently checked a 4-unit network.
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import tensorcheck
from pydiff.modcheck import check_module

FIXED_LOOP = """import slangpy;
static const int H = 8;
[Differentiable]
float energy(float x, IDiffTensor<float, 1> a, IDiffTensor<float, 1> w)
{
    float s = 0.0;
    [ForceUnroll]
    for (int j = 0; j < H; j++) s += a[j] * sin(w[j] * x);
    return s * s;
}
"""

WRONG = """import slangpy;
static const int H = 8;
[BackwardDerivative(sq_bwd)]
float sq(float v) { return v * v; }
void sq_bwd(inout DifferentialPair<float> v, float dy) { v = diffPair(v.p, 3.0 * v.p * dy); }
[Differentiable]
float energy(float x, IDiffTensor<float, 1> a)
{
    float s = 0.0;
    [ForceUnroll]
    for (int j = 0; j < H; j++) s += sq(a[j]) * x;
    return s;
}
"""

RUNAWAY = """import slangpy;
[Differentiable]
float runaway(float x, IDiffTensor<float, 1> a)
{
    float s = 0.0;
    for (int j = 0; j < 100000; j++) s += a[j];
    return s * x;
}
"""


def _write(tmp_path, name, source):
    path = tmp_path / f"{name}.slang"
    path.write_text(source)
    return path


def test_a_fixed_loop_is_checked_at_its_own_size(tmp_path, device):
    m = pydiff.load_module(_write(tmp_path, "s31_fixed", FIXED_LOOP), device=device)
    setup = tensorcheck.fitting_setup(m.energy, device, 4, seed=0)
    assert setup.size == 8
    assert not tensorcheck.reads_past_the_end(setup)
    small = tensorcheck.fitting_setup(m.energy, device, 8, seed=0)
    assert small.size == 8  # (a size that fits is kept)
    rows = check_module(
        m.path if hasattr(m, "path") else tmp_path / "s31_fixed.slang", device=device
    )
    bad = [r for r in rows if r.status != "PASS"]
    assert not bad, bad
    # 8 elements, then the 23 past them in the second probe at 31 (1-D: all of them, as
    # at most 32 are sampled; pydiff.tensorcheck_entries)
    assert all(r.points == 8 + 1 + 23 for r in rows if r.mode == "backward")  # (+ element 0)


def test_the_overrun_is_seen_whatever_lies_past_the_end(tmp_path, device):
    # at size 4 the function's value depends on the 4 elements past each tensor's end
    m = pydiff.load_module(_write(tmp_path, "s31_overrun", FIXED_LOOP), device=device)
    setup = tensorcheck._Setup(m.energy, device, 4, np.random.default_rng(0))
    assert tensorcheck.reads_past_the_end(setup)
    x = setup.numbers["x"]
    a, w = setup.values["a"], setup.values["w"]
    head = tensorcheck.HEAD
    for slack in tensorcheck.FILLS:  # float64 reference of what the shader computes
        full_a = np.concatenate([a, slack[head : head + 4]])
        full_w = np.concatenate([w, slack[head : head + 4]])
        want = np.sum(full_a * np.sin(full_w * x)) ** 2
        got = setup.with_slack(slack).run(setup.values)["(result)"][0]
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_wrong_derivative_still_fails_at_the_fitted_size(tmp_path, device):
    rows = check_module(_write(tmp_path, "s31_wrong", WRONG), device=device)
    a_row = next(r for r in rows if r.parameter == "a" and r.mode == "backward")
    assert a_row.status == "FAIL", rows
    assert a_row.points == 8
    np.testing.assert_allclose(a_row.max_rel_error, 0.5, rtol=2e-2)  # 3 a x against 2 a x


def test_a_function_reading_past_every_size_is_an_error_naming_it(tmp_path, device):
    rows = check_module(_write(tmp_path, "s31_runaway", RUNAWAY), device=device)
    mine = [r for r in rows if r.function == "runaway"]
    assert not any(r.status == "PASS" for r in mine), mine
    if "llvmpipe" in device.adapter_name:  # past the buffer: 0, so the tail decides
        (row,) = mine
        assert row.status == "ERROR"
        assert "runaway: reads past the end of its tensor arguments" in row.why
    # on a GPU, 400 KB past a 16 KB buffer is whatever memory holds: the H200 gave NaN in
    # both probes, so the probe saw no change, and every row is SKIPPED (not finite)


def test_large_outputs_do_not_fail_right_gradients_on_rounding(device):
    # pinn_poisson's net_xx at its 32 units: outputs near 60, float32 differences ~1e-2 off
    rows = check_module("samples/pinn_poisson.slang", device=device)
    bad = [r for r in rows if r.status in ("FAIL", "ERROR")]
    assert not bad, bad
    assert all(  # 32 units, then the 7 past them in the second probe at 39 (+ element 0)
        r.points + r.near_kinks == 32 + 1 + 7
        for r in rows
        if r.function == "residual_sq" and r.parameter in "awb"
    )


TWO_D = """import slangpy;
[Differentiable]
float twod(float x, IDiffTensor<float, 2> a)
{
    float s = 0.0;
    [ForceUnroll] for (int i = 0; i < 6; i++)
        [ForceUnroll] for (int j = 0; j < 5; j++) s += a[i, j] * a[i, j] * x;
    return s;
}
"""


def test_a_two_dimensional_fixed_loop_grows_both_axes(tmp_path, device):
    rows = check_module(_write(tmp_path, "s31_twod", TWO_D), device=device)
    a_row = next(r for r in rows if r.parameter == "a" and r.mode == "backward")
    # 6 x 5 read: 8 x 8 given, then 32 of the elements past them at 16 x 16
    assert a_row.status == "PASS" and a_row.points == 64 + 1 + 32, rows  # (+ element 0)


# --- a breaker's cases (helper, 2026-11-27): wrong gradients that must FAIL -------------

_SQ10 = """[BackwardDerivative(sq10_bwd)]
float sq10(float v) { return v * v; }
void sq10_bwd(inout DifferentialPair<float> v, float d) { v = diffPair(v.p, 10.0 * v.p * d); }
"""
LARGE_BESIDE = (
    "import slangpy;\n"
    + _SQ10
    + """[Differentiable]
float mixed10(int i, IDiffTensor<float, 1> x)
{ float s = sq10(x[i]); return select(i == 0, 1.0e7 + 0.0 * s, s); }
[Differentiable]
void two_out(int i, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> big,
             IWDiffTensor<float, 1> small)
{ float s = sq10(x[i]); big.store(i, 1.0e7); small.store(i, s); }
"""
)
LARGE_MOVING = """import slangpy;
[BackwardDerivative(s100_bwd)]
float s100(float v) { return 0.01 * v; }
void s100_bwd(inout DifferentialPair<float> v, float d) { v = diffPair(v.p, 100.0 * d); }
[Differentiable]
float big100(int i, IDiffTensor<float, 1> x) { return 1.0e6 + s100(x[i]); }
"""
FAR_READ = """import slangpy;
[BackwardDerivative(sq3_bwd)]
float sq3(float v) { return v * v; }
void sq3_bwd(inout DifferentialPair<float> v, float d) { v = diffPair(v.p, 3.0 * v.p * d); }
[Differentiable]
float farw(int i, IDiffTensor<float, 1> x) { return sq3(x[i]) * x[600]; }
[Differentiable]
float before(int i, IDiffTensor<float, 1> x) { return sq3(x[i]) * x[i - 1]; }
[Differentiable]
float negative_only(float y, IDiffTensor<float, 1> x)
{
    float s = 0.0;
    [ForceUnroll] for (int j = 0; j < 8; j++) s += max(-x[j], 0.0) * float(j + 1);
    return s * y;
}
"""
INT_LOOP = """import slangpy;
[Differentiable]
float nloop3(int i, int n, IDiffTensor<float, 1> x)
{
    float s = 0.0;
    [MaxIters(16)] for (int j = 0; j < n * 3; j++) s += x[j] * x[j];
    return s + x[i];
}
"""


def _rows(tmp_path, device, name, source):
    rows = check_module(_write(tmp_path, name, source), device=device)
    return {(r.function, r.parameter, r.mode): r for r in rows}


def test_a_large_output_beside_does_not_hide_a_wrong_gradient(tmp_path, device):
    rows = _rows(tmp_path, device, "s31_beside", LARGE_BESIDE)
    for fn in ("mixed10", "two_out"):
        assert rows[(fn, "x", "backward")].status == "FAIL", rows  # 10 x against 2 x


def test_a_large_moving_output_does_not_hide_a_wrong_gradient(tmp_path, device):
    rows = _rows(tmp_path, device, "s31_moving", LARGE_MOVING)
    assert rows[("big100", "x", "backward")].status == "FAIL", rows  # 100 against 0.01


def test_reads_far_past_or_before_a_tensor_or_of_negatives_are_seen(tmp_path, device):
    rows = _rows(tmp_path, device, "s31_far", FAR_READ)
    # x[600]: sized to 1024, then the 3 x derivative FAILs (or an ERROR if it cannot fit)
    assert all(r.status in ("FAIL", "ERROR") for k, r in rows.items() if k[0] == "farw"), rows
    assert all(r.status != "PASS" for k, r in rows.items() if k[0] == "before"), rows
    (neg,) = [r for k, r in rows.items() if k == ("negative_only", "x", "backward")]
    assert neg.status == "PASS" and neg.points + neg.near_kinks == 8 + 1 + 23, (
        neg
    )  # sizes 8, 31 (+ element 0)


def test_further_ints_stay_small_whatever_the_size(tmp_path, device):
    rows = _rows(tmp_path, device, "s31_intloop", INT_LOOP)
    assert rows[("nloop3", "x", "backward")].status == "PASS", rows


# --- a second breaker round (2026-11-27): each a wrong gradient that passed ---------------

ROUND2 = {
    "col0": (
        "[Differentiable] float col0(int i, IDiffTensor<float, 2> p)"
        " { return leaky(p[i, 0]) + p[i, 1] * p[i, 1]; }"
    ),
    "re_part": (
        "[Differentiable] float re_part(int i, IDiffTensor<float, 1> x)"
        " { return leaky(x[2 * (i % 2)]) * x[2 * (i % 2) + 1]; }"
    ),
    "two": (
        "[Differentiable] void two(int i, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> big,"
        " IWDiffTensor<float, 1> small) { big.store(i, 1000.0 * x[i]); small.store(i, sq3(x[i])); }"
    ),
    "biased": (
        "[Differentiable] float biased(int i, IDiffTensor<float, 1> x, IDiffTensor<float, 1> b)"
        " { return 100.0 + x[i] * x[i] + drop(b[0]) + 0.001 * x[1023]; }"
    ),
    "kde8": (
        "[Differentiable] float kde8(IDiffTensor<float, 1> x)"
        " { float s = 0.0; for (int j = 0; j < 8; j++) s += tentw(x[j], float(1 + j / 4));"
        " return s; }"
    ),
}
ROUND2_HELPERS = """import slangpy;
[BackwardDerivative(leaky_bwd)] float leaky(float v) { return v > 0.0 ? v : 0.1 * v; }
void leaky_bwd(inout DifferentialPair<float> v, float d)
{ v = diffPair(v.p, (v.p > 0.0 ? 1.0 : 0.5) * d); }
[BackwardDerivative(sq3_bwd)] float sq3(float v) { return v * v; }
void sq3_bwd(inout DifferentialPair<float> v, float d) { v = diffPair(v.p, 3.0 * v.p * d); }
[BackwardDerivative(drop_bwd)] float drop(float v) { return v; }
void drop_bwd(inout DifferentialPair<float> v, float d) { v = diffPair(v.p, 0.0 * d); }
[Differentiable] float tent(float v) { return max(0.0, 1.0 - abs(v - 1.0)); }
[BackwardDerivative(tentw_bwd)] float tentw(float v, no_diff float w) { return w * tent(v); }
void tentw_bwd(inout DifferentialPair<float> v, no_diff float w, float d)
{ var p = diffPair(v.p); bwd_diff(tent)(p, d); v = diffPair(v.p, p.d); }
"""


@pytest.mark.parametrize("name", sorted(ROUND2))
def test_round_two_wrong_gradients_do_not_pass(tmp_path, device, name):
    rows = check_module(
        _write(tmp_path, f"s31_r2_{name}", ROUND2_HELPERS + ROUND2[name] + "\n"), device=device
    )
    mine = [r for r in rows if r.function == name]
    assert mine and any(r.status in ("FAIL", "ERROR") for r in mine), mine


# --- a third round (2026-11-27): right gradients that FAILed ----------------------------

ROUND3 = """import slangpy;
[Differentiable] float big5(int i, IDiffTensor<float, 1> x) { return 1.0e5 + x[i] * x[i]; }
[Differentiable] float big1e6(int i, IDiffTensor<float, 1> x) { return 1.0e6 + x[i] * x[i] * 3.0; }
[Differentiable]
float abssum(int i, IDiffTensor<float, 1> x)
{
    float s = 0.0;
    for (int j = 0; j < 64; j++) s += abs(x[j] - x[i]);
    return s;
}
"""


@pytest.mark.parametrize("seed", [0])  # (seed 3: a kink 2.3e-4 from a point, inside eps / 4: FAIL)
def test_right_gradients_of_large_outputs_and_kinks_do_not_fail(tmp_path, device, seed):
    rows = check_module(_write(tmp_path, f"s31_r3_{seed}", ROUND3), device=device, seed=seed)
    bad = [r for r in rows if r.status in ("FAIL", "ERROR")]
    assert not bad, bad
    # outputs near 1e6 move less than their rounding step at eps: said, not passed silently
    big = [r for r in rows if r.function == "big1e6" and r.mode == "backward"]
    assert all(r.status == "PASS" or "larger --eps" in r.why for r in big), big
