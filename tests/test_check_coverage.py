"""`pydiff check` on inout, struct and several-int parameters (issue 15): each correct
function passes, each wrong twin (a term detached from its derivative) fails, and NaN or
infinite derivatives fail."""

from pathlib import Path

import numpy as np
import pytest

from pydiff.modcheck import check_module

SHADERS = Path(__file__).parent / "shaders"


@pytest.fixture(scope="module")
def rows(device):
    results = check_module(SHADERS / "check_coverage.slang", device=device)
    return {(r.function, r.parameter, r.mode): r for r in results}


def _status(rows, function):
    return {(p, mode): r.status for (f, p, mode), r in rows.items() if f == function}


@pytest.mark.parametrize(
    "function, checked",
    [
        ("scale_inout", ["s", "v"]),
        ("two_inouts", ["s", "a", "b"]),
        ("affine", ["p.a", "p.b", "x"]),
        ("nested", ["o.inner.a", "o.inner.b", "o.c", "x"]),
        ("with_fixed", ["x"]),  # a struct that is not IDifferentiable is held fixed
        ("power", ["x"]),  # two int parameters held at small values
        ("shift_read", ["x"]),  # a tensor function with a second int
        ("square_inplace", ["data"]),  # IRWDiffTensor: input and output
    ],
)
def test_correct_functions_pass(rows, function, checked):
    status = _status(rows, function)
    for p in checked:
        assert status[(p, "backward")] == "PASS", (function, p, status)
    assert status[("(all)", "adjoint")] == "PASS"
    assert not any(s in ("FAIL", "ERROR") for s in status.values()), status
    assert {p for p, mode in status if mode == "backward"} == set(checked)


@pytest.mark.parametrize(
    "function, wrong, right",
    [
        ("scale_inout_wrong", "v", ["s"]),
        ("affine_wrong", "p.a", ["p.b", "x"]),
        ("power_wrong", "x", []),
        ("square_inplace_wrong", "data", []),
    ],
)
def test_wrong_twins_fail(rows, function, wrong, right):
    status = _status(rows, function)
    assert status[(wrong, "backward")] == "FAIL", status
    assert status[("(all)", "adjoint")] == "FAIL"
    for p in right:
        assert status[(p, "backward")] == "PASS"


def test_inout_forward_mode_is_checked(rows):
    assert rows[("scale_inout", "(all)", "forward")].status == "PASS"
    assert rows[("scale_inout_wrong", "(all)", "forward")].status == "FAIL"
    assert rows[("two_inouts", "(all)", "forward")].status == "PASS"


def test_nan_and_inf_derivatives_fail(device):
    found = check_module(SHADERS / "check_nan.slang", device=device)
    by = {(r.function, r.parameter, r.mode): r for r in found}
    for fn, bad_points in (("nan_grad", 16), ("inf_grad", 16), ("half_nan", 8)):
        row = by[(fn, "x", "backward")]
        assert row.status == "FAIL", row
        assert f"NaN or infinite at {bad_points} sample point" in row.why
        assert by[(fn, "(all)", "adjoint")].status == "FAIL"
        for value in row.as_dict().values():  # strict-JSON values only
            assert not (isinstance(value, float) and not np.isfinite(value))
    assert by[("fine", "x", "backward")].status == "PASS"
