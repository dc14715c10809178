"""`double` math the scan missed or refused wrongly (breaker, s31): type aliases, macros,
sincos/exp10/sinpi/cospi/powr, members named like intrinsics, and `pydiff check` on double
functions. On lavapipe the missed ones returned denormals (7e-315) silently."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import pydiff
from pydiff.errors import ShaderTrapError
from pydiff.lint_double import double_calls
from pydiff.modcheck import check_module

X = np.array([0.3, 0.7, 1.2])
Y = np.array([1.7, 0.4, 2.5])
CASES = {  # function -> (source, float64 reference)
    "ta": ("typealias real = double; real ta(real x, real y) { return exp(x); }", np.exp(X)),
    "td": ("typedef double real2; real2 td(real2 x, real2 y) { return log(x); }", np.log(X)),
    "chain": (
        "typealias r1 = double; typealias r2 = r1; r2 chain(r2 x, r2 y) { return sin(x); }",
        np.sin(X),
    ),
    "mac": ("#define EXPD(v) exp(v)\ndouble mac(double x, double y) { return EXPD(x); }",
            np.exp(X)),
    "mac_const": ("#define TWO 2.0l\nfloat mac_const(float x, float y) "
                  "{ return float(cos(x * TWO)); }", np.cos(2 * X)),
    "dsincos": ("double dsincos(double x, double y) { double s, c; sincos(x, s, c); "
                "return s + 10.0l * c; }", np.sin(X) + 10 * np.cos(X)),
    "dexp10": ("double dexp10(double x, double y) { return exp10(x); }", 10.0**X),
    "dsinpi": ("double dsinpi(double x, double y) { return sinpi(x) + cospi(y); }",
               np.sin(np.pi * X) + np.cos(np.pi * Y)),
    "dpowr": ("double dpowr(double x, double y) { return powr(x, y); }", X**Y),
}  # fmt: skip
SOURCE = "\n".join(src for src, _ in CASES.values())


def test_aliases_macros_and_more_intrinsics_are_right_or_refused(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pydiff.load_module_from_source("s31_dlint", SOURCE, device)
    for name, (src, want) in CASES.items():
        try:
            got = getattr(m, name)(X, Y, _result="numpy")
        except ShaderTrapError as exc:
            assert f"in {name}()" in str(exc) and "of a double" in str(exc), str(exc)
            # the device is at fault, not SlangPy
            assert "this device" in str(exc) and "SlangPy" not in str(exc), str(exc)
            continue
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"{name}: {src}")


def test_probe_measures_the_new_intrinsics(device):
    from pydiff import double_math

    got = double_math.probe_intrinsics(device, ["sincos", "exp10", "sinpi", "cospi", "powr"])
    broken = double_math.broken_intrinsics(device)
    x, y = double_math._X, double_math._Y
    want = {
        "sincos": math.sin(x) + 2 * math.cos(x),
        "exp10": 10.0**x,
        "sinpi": math.sin(math.pi * x),
        "cospi": math.cos(math.pi * x),
        "powr": x**y,
    }
    for name, value in want.items():  # right, or listed as broken
        assert name in broken or got[name] == pytest.approx(value, rel=1e-12), name


MEMBERS = """
struct S { static double exp(double x) { return x * 3.0l; } };
struct P { double k; double log(double x) { return x * k; } };
double f(double x) { return S.exp(x); }
double g(double x) { P p = { 2.0l }; return p.log(x) + S :: exp(x); }
"""


def test_member_named_like_an_intrinsic_is_not_refused(device):
    assert double_calls(MEMBERS) == {}
    m = pydiff.load_module_from_source("s31_members", MEMBERS, device)
    np.testing.assert_allclose(m.f(X, _result="numpy"), 3 * X, rtol=1e-15)
    np.testing.assert_allclose(m.g(X, _result="numpy"), 5 * X, rtol=1e-15)


def test_scan_sees_through_aliases_macros_and_out_parameters():
    src = """
    typealias real = double;
    typedef float f32;
    #define E(v) exp(v)
    #if defined(USE_SIN)
    #define TRIG(v) sin(v)
    #else
    #define TRIG(v) sqrt(v)
    #endif
    real a(real x) { return exp(x); }
    f32 b(f32 x) { return exp(x); }
    double c(double x) { return E(x); }
    double d(double x) { double s, c; sincos(x, s, c); return s; }
    double e(double x) { return TRIG(x); }
    float f(float x) { f32 y = x; return exp(y); }
    """
    found = {k: [c[:2] for c in v] for k, v in double_calls(src).items()}
    assert found == {
        "a": [(10, "exp")],
        "c": [(12, "exp")],
        "d": [(13, "sincos")],
        "e": [(14, "sqrt")],  # (measured too: right on lavapipe)
    }
    # the device's defines choose the branch
    found = double_calls(src, defines={"USE_SIN": "1"})
    assert found["e"] == [(14, "sin", "e")]


def test_check_skips_backward_of_double_functions(device, tmp_path):
    path = tmp_path / "s31_dcheck.slang"
    path.write_text(
        "[Differentiable] double ok(double x) { return sqrt(x * x + 1.0l) * x; }\n"
        "[Differentiable] double dret(float x) { return double(x) * double(x); }\n"
        "[Differentiable] float fine(float x) { return x * x; }\n"
    )
    rows = check_module(str(path), device=device)
    by = {(r.function, r.mode): r for r in rows}
    assert not [r for r in rows if r.status in ("ERROR", "FAIL")], rows
    for name, culprit in (("ok", "x, the result"), ("dret", "the result")):
        skipped = by[(name, "backward")]
        assert skipped.status == "SKIPPED"
        assert skipped.why.startswith(f"{culprit}: double values cannot get gradients")
        assert by[(name, "forward")].status == "PASS"
    assert by[("fine", "backward")].status == "PASS"
