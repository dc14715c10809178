"""Generic functions calling math intrinsics on their generic type, called with doubles where
the type is inferred (``tsin(d)``, no ``<double>``): on a device that computes the intrinsic
wrong on doubles (lavapipe: sin of a double gave 0) the call is refused, never a silent wrong
value; called with floats, or on a device that gets doubles right, the values match NumPy's
float64."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff
from pydiff import double_math
from pydiff.errors import ShaderTrapError
from pydiff.lint_double import double_calls

X = np.array([0.5, 1.0, 2.0], np.float32)
GENERICS = """
T tsin37<T : __BuiltinFloatingPointType>(T x) { return sin(x); }
T touter37<T : __BuiltinFloatingPointType>(T x) { let y = x * x; return tsin37(y) + x; }
vector<T, 3> vexp37<T : __BuiltinFloatingPointType>(vector<T, 3> v) { return exp(v); }
"""
CASES = {  # the caller's body (x a float), the float64 reference, whether it uses doubles
    "direct": ("double d = x; return float(tsin37(d));", np.sin(X.astype(np.float64)), True),
    "cast": ("return float(tsin37(double(x)));", np.sin(X.astype(np.float64)), True),
    "let": ("let d = double(x) * 2.0l; return float(tsin37(d));", np.sin(2.0 * X), True),
    "chain": (
        "double d = x; return float(touter37(d));",
        np.sin(X.astype(np.float64) ** 2) + X,
        True,
    ),
    "namespaced": (
        "double d = x; return float(ns37::nsin(d));",
        np.sin(X.astype(np.float64)),
        True,
    ),
    "vector": (
        "double3 v = double3(x, 0.0l, 1.0l); return float(vexp37(v).x + vexp37(v).z);",
        np.exp(X.astype(np.float64)) + np.e,
        True,
    ),
    "float": ("return tsin37(x) + touter37(x);", np.sin(X) + np.sin(X * X) + X, False),
}
NAMESPACE = """
namespace ns37 { T nsin<T : __BuiltinFloatingPointType>(T x) { return sin(x); } }
"""


def _source(name: str, body: str) -> str:
    return GENERICS + NAMESPACE + f"float f37_{name}(float x) {{ {body} }}\n"


@pytest.mark.parametrize("name", list(CASES))
def test_inferred_double_generic_calls_are_refused_or_right(device, name):
    body, want, uses_double = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pydiff.load_module_from_source(f"s37_dgen_{name}", _source(name, body), device)
    broken = double_math.broken_intrinsics(device)
    wrong_here = uses_double and ({"sin", "exp"} & set(broken))
    x = pydiff.tensor(X, device=device)
    fn = getattr(m, f"f37_{name}")
    if wrong_here and (name != "vector" or "exp" in broken):
        with pytest.raises(ShaderTrapError, match="of a double"):
            fn(x)
        return
    np.testing.assert_allclose(fn(x).numpy(), want, rtol=1e-5, atol=1e-6)


def test_scan_sees_inferred_generic_calls_only_with_doubles():
    calls = double_calls(_source("direct", CASES["direct"][0]))
    assert ("sin", "tsin37") in {(c[1], c[2]) for c in calls["f37_direct"]}
    calls = double_calls(_source("chain", CASES["chain"][0]))
    assert any(c[1] == "sin" for c in calls["f37_chain"])
    calls = double_calls(_source("float", CASES["float"][0]))
    assert "f37_float" not in calls  # floats: nothing to refuse
    assert "tsin37" not in calls  # the generic itself is not a double call
