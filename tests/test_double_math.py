"""`double` values: math intrinsics a device computes wrong are refused, never silent, and
double tensors refuse gradients with a clear TypeError."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff
from pydiff.errors import ShaderTrapError
from pydiff.lint_double import double_calls

X = np.array([0.25, 0.5, 0.9])
Y = np.array([1.7, 0.4, 2.5])
CASES = {  # function -> (source body, float64 reference)
    "d_sin": ("return sin(x);", np.sin(X)),
    "d_cos": ("return cos(x);", np.cos(X)),
    "d_exp": ("return exp(x);", np.exp(X)),
    "d_log": ("return log(x);", np.log(X)),
    "d_tanh": ("return tanh(x);", np.tanh(X)),
    "d_asin": ("return asin(x);", np.arcsin(X)),
    "d_pow": ("return pow(x, y);", X**Y),
    "d_atan2": ("return atan2(x, y);", np.arctan2(X, Y)),
    "d_poly": ("return x * x + d_sin(x);", X * X + np.sin(X)),  # a caller
    "d_sqrt": ("return sqrt(x) + fmod(y, x);", np.sqrt(X) + np.fmod(Y, X)),
}
SOURCE = "\n".join(
    f"double {name}(double x, double y = 1.0l) {{ {body} }}" for name, (body, _) in CASES.items()
)


def test_double_intrinsics_are_right_or_refused(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pydiff.load_module_from_source("dmath", SOURCE, device)
    refused = []
    for line, (name, (body, want)) in enumerate(CASES.items(), start=1):
        try:
            got = getattr(m, name)(X, Y, _result="numpy")
        except ShaderTrapError as exc:
            refused.append(name)
            assert f"<dmath>:{line}" in str(exc) or "d_sin()" in str(exc)
            assert "of a double" in str(exc) and "float(x)" in str(exc)
            continue
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"{name}: {body}")
    if "d_sin" in refused:  # a caller of a refused function is refused too
        assert "d_poly" in refused
    assert "d_sqrt" not in refused


def test_double_computed_in_float_is_accepted(device):
    src = "double f(double x) { return double(sin(float(x))) + sqrt(x); }"
    m = pydiff.load_module_from_source("dmath_float", src, device)
    np.testing.assert_allclose(m.f(X, _result="numpy"), np.sin(X) + np.sqrt(X), rtol=1e-6)


def test_double_fwds_is_refused_or_right(device):
    src = "[Differentiable] double g(double x) { return exp(x); }"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pydiff.load_module_from_source("dmath_fwds", src, device)
    x = pydiff.tensor(X, dtype="double", device=device).with_tangent(np.ones(3))
    try:
        y, dy = m.g.fwds(x)
    except ShaderTrapError as exc:
        assert "exp() of a double" in str(exc)
        return
    np.testing.assert_allclose(y.numpy(), np.exp(X), rtol=1e-12)
    np.testing.assert_allclose(dy.numpy(), np.exp(X), rtol=1e-12)


def test_double_tensors_refuse_gradients(device):
    with pytest.raises(TypeError, match="dtype 'double' cannot have gradients.*double atomics"):
        pydiff.tensor(X, dtype="double", requires_grad=True, device=device)
    with pytest.raises(TypeError, match="cannot have gradients"):
        pydiff.zeros((3,), dtype="double", requires_grad=True, device=device)
    with pytest.raises(TypeError, match="cannot have gradients"):
        pydiff.tensor(X, dtype="double", device=device).with_grads()
    # forward mode works on double tensors: d(x*x) = 2x
    m = pydiff.load_module_from_source(
        "dmath_sq", "[Differentiable] double sq(double x) { return x * x; }", device
    )
    y, dy = m.sq.fwds(pydiff.tensor(X, dtype="double", device=device).with_tangent(np.ones(3)))
    np.testing.assert_allclose(y.numpy(), X * X, rtol=1e-15)
    np.testing.assert_allclose(dy.numpy(), 2 * X, rtol=1e-15)


def test_scan_sees_double_arguments_only():
    src = """
    float a(float x) { return sin(x); }                       // float: fine
    double b(double x) { return sin(x) * 2.0; }
    double c(float x) { return exp(double(x)); }              // cast
    double d(float x) { double t = x, u = 2.0; return log(u); }  // second declarator
    double e(double x) { return double(cos(float(x))); }      // computed in float
    float f(float x) { return pow(x, 2.0l); }                 // double literal
    double g(double x) { return b(x) + 1.0; }                 // caller of b
    """
    calls = double_calls(src)
    assert set(calls) == {"b", "c", "d", "f", "g"}
    assert calls["b"] == [(3, "sin", "b")]
    assert calls["g"] == [(3, "sin", "b")]
    assert [c[1] for c in calls["c"] + calls["d"] + calls["f"]] == ["exp", "log", "pow"]


# Locals typed by inference and doubles returned by calls (F2b): these gave 7.65e-315, -43.67
# and 0.0 on lavapipe, silently, before the scan inferred their types.
INFERRED = {  # function -> (source, first argument, float64 reference of the value)
    "let_local": ("double let_local(double x) { let y = x; return exp(y); }", np.exp),
    "var_local": ("double var_local(double x) { var y = x; return log(y); }", np.log),
    "let_in_float_fn": (
        "[Differentiable] float let_in_float_fn(float x) "
        "{ let d = double(x); let e = exp(d); return float(e); }",
        np.exp,
    ),
    "call_result": ("float call_result(float x) { return float(exp(twice(x))); }",
                    lambda x: np.exp(2 * x)),
}  # fmt: skip
INFERRED_SOURCE = "double twice(double x) { return x * 2.0l; }\n" + "\n".join(
    src for src, _ in INFERRED.values()
)


def test_inferred_double_locals_and_call_results_are_refused_or_right(device):
    from pydiff.double_math import broken_intrinsics

    broken = broken_intrinsics(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pydiff.load_module_from_source("dinfer", INFERRED_SOURCE, device)
    x = np.array([0.3741, 0.8])
    for line, (name, (src, ref)) in enumerate(INFERRED.items(), start=2):
        intrinsic = "log" if "log(" in src else "exp"
        if intrinsic in broken:
            with pytest.raises(ShaderTrapError, match=rf"<dinfer>:{line}: in {name}\(\)"):
                getattr(m, name)(x, _result="numpy")
        else:
            got = getattr(m, name)(x, _result="numpy")
            np.testing.assert_allclose(got, ref(x), rtol=1e-6, err_msg=name)
    # .bwds is refused before it runs: no gradient is written
    t = pydiff.tensor(x, requires_grad=True, device=device)
    if "exp" in broken:
        with pytest.raises(ShaderTrapError, match=r"<dinfer>:4: in let_in_float_fn\(\)"):
            m.let_in_float_fn.bwds(t, _result=1.0)
        assert t.grad is None or not np.any(t.grad.numpy())
    else:
        m.let_in_float_fn.bwds(t, _result=1.0)
        np.testing.assert_allclose(t.grad.numpy(), np.exp(x), rtol=1e-5)


def test_scan_infers_let_var_and_call_result_types():
    src = """
    double twice(double x) { return x * 2.0l; }
    float half_of(float x) { return x * 0.5; }
    T same<T : __BuiltinFloatingPointType>(T x) { return x; }
    double a(double x) { let y = x; return exp(y); }
    float b(float x) { let d = double(x); var e = d * 3.0; let f = e; return float(sin(f)); }
    float c(float x) { return float(exp(twice(x))); }
    float d(float x) { let y : double = x; return float(cos(y)); }
    float e(float x) { double d = x; let y = same(x); return exp(y) + float(d); }
    float f(float x) { double d = x; let y = x * 2.0; return exp(y) + float(d); }
    float g(float x) { double d = x; let y = half_of(x); return exp(max(y, 1.0)) + float(d); }
    float h(float x) { let y = float(twice(x)); return exp(y); }  // exp(twice(x)) in a comment
    double i(double x) { return double(sin(float(x))); }
    float j(float x) { let y = same(x); return exp(y); }
    """
    guessed: set = set()
    calls = double_calls(src, guessed)
    assert {k: [c[:2] for c in v] for k, v in calls.items()} == {
        "a": [(5, "exp")],
        "b": [(6, "sin")],
        "c": [(7, "exp")],
        "d": [(8, "cos")],
        "e": [(9, "exp")],  # a generic's result beside doubles: refused, said to be a guess
    }
    assert guessed == {("e", 9)}


def test_double_hyperbolic_inverses_are_right_or_refused_by_name(device):
    # CUDA's nvrtc has no double asinh/acosh/atanh: the module is refused at load, naming the
    # function, instead of failing to compile (found on an H200, 2026-11-27)
    src = "double h(double x) { return asinh(x) + atanh(x * 0.5l); }"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = pydiff.load_module_from_source("dmath_hyp", src, device)
        got = m.h(X, _result="numpy")
    except ShaderTrapError as exc:
        assert "of a double" in str(exc) and "float(x)" in str(exc), str(exc)
        return
    np.testing.assert_allclose(got, np.arcsinh(X) + np.arctanh(X * 0.5), rtol=1e-12)


def test_probe_splits_around_what_does_not_compile(device):
    from pydiff import double_math

    got = double_math.probe_intrinsics(device, ["sqrt", "no_such_intrinsic", "fmod"])
    assert got["no_such_intrinsic"] is None
    np.testing.assert_allclose(got["sqrt"], np.sqrt(double_math._X), rtol=1e-12)
    np.testing.assert_allclose(got["fmod"], np.fmod(double_math._Y, double_math._X), rtol=1e-12)
