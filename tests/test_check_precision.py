"""`pydiff check` follows each function's precision and derivatives (issue 15, class 9):
half functions that are right pass with the default step (a derivative 10% off still fails),
a function with only a [ForwardDerivative] is checked in forward mode (only a
[BackwardDerivative]: forward skipped with that reason), and int vectors are ints, not
structs. The references are central differences in float64 (pydiff.finite_diff)."""

from pathlib import Path

import numpy as np
import pytest

from pydiff import finite_diff as fd
from pydiff.modcheck import check_module

SHADERS = Path(__file__).parent / "shaders"


@pytest.fixture(scope="module")
def rows(device):
    results = check_module(SHADERS / "check_precision.slang", device=device)
    return {(r.function, r.parameter, r.mode): r for r in results}


def _status(rows, function):
    return {(p, mode): r.status for (f, p, mode), r in rows.items() if f == function}


@pytest.mark.parametrize(
    "function", ["withhalf", "hsq", "hvec", "hcube", "hsin", "hsq_right", "withint2", "withuint3"]
)
def test_right_functions_pass(rows, function, device):
    status = _status(rows, function)
    if function == "hvec" and device.type == "cuda":  # half3 gradients are refused on CUDA
        hvec = [r for (f, *_), r in rows.items() if f == "hvec" and r.status == "ERROR"]
        assert hvec and all("half3" in r.why for r in hvec), status
        return
    assert status[("(all)", "adjoint")] == "PASS", status
    assert not any(s in ("FAIL", "ERROR") for s in status.values()), status
    assert all(r.points >= 12 for (f, *_), r in rows.items() if f == function and r.points)


@pytest.mark.parametrize(
    "function, parameter", [("hsq_wrong", "x"), ("withhalf_wrong", "h"), ("withint3_wrong", "x")]
)
def test_wrong_derivatives_still_fail(rows, function, parameter):
    status = _status(rows, function)
    assert status[(parameter, "backward")] == "FAIL", status
    assert status[("(all)", "adjoint")] == "FAIL", status


def test_forward_derivative_only(rows):
    for fn in ("fsq", "fhcube", "ftwo"):
        status = _status(rows, fn)
        assert status[("(all)", "forward")] == "PASS", (fn, status)
        back = rows[(fn, "(all)", "backward")]
        assert back.status == "SKIPPED" and "[ForwardDerivative] only" in back.why
    assert rows[("fsq_wrong", "(all)", "forward")].status == "FAIL"


def test_backward_derivative_only_skips_forward_naming_why(rows):
    for fn in ("bsq", "hsq_right", "hsq_wrong"):
        row = rows[(fn, "(all)", "forward")]
        assert row.status == "SKIPPED" and "[BackwardDerivative] only" in row.why, row
    assert rows[("bsq", "x", "backward")].status == "PASS"


def test_int_vectors_are_ints_with_a_forward_row(rows):
    for fn in ("withint2", "withuint3"):
        row = rows[(fn, "(all)", "forward")]
        assert row.status == "PASS", row
        assert {p for (f, p, m) in rows if f == fn and m == "backward"} == {"x"}
    assert rows[("withint3_wrong", "(all)", "forward")].status == "FAIL"


def test_precision_settings():
    assert fd.for_precision(1e-3, 1e-3, 1e-2) == (1e-3, 2.5e-4, 1e-3, 1e-2)
    p = fd.for_precision(1e-3, 1e-3, 1e-2, half=True)
    assert p.eps == 2.0**-5 and p.second == 2.0**-4 and p.atol >= 2e-2 and p.rtol >= 3e-2
    assert fd.for_precision(0.05, 0.1, 0.5, half=True) == (0.0625, 0.125, 0.1, 0.5)
    # the half step is exact from every sampled value on half's grid (|x| <= 1.5)
    x = np.round(np.linspace(-1.5, 1.5, 1001) * 1024) / 1024
    for step in (p.eps, p.second, p.eps * 0.75):
        y = x + step
        assert np.array_equal(y.astype(np.float16).astype(np.float64), y)
