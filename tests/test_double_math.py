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
