"""Session 43, lanes43: cross-lane code the lane scan (pydiff/lint_lanes.py) missed, documented
as gaps before: code reached through a user-defined operator overload (``s + t`` calling an
``S operator+(S, S)``, a ``__generic`` operator), a generic ``extension``, an interface
implementation dispatched through a generic (``T(x).get()``), inside ``__intrinsic_asm`` /
``__target_intrinsic`` strings, and in a function whose parameter list holds parentheses (a
default argument ``s = float(1)``). Before, the elementwise generated kernel (eight elements a
thread) ran them and gave other values than SlangPy's path (one element a thread)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from generated_paths import run_both_paths
from pydiff.lint_lanes import lane_effects
from pydiff.lint_macros import preprocess

SRC = """
import slangpy;
struct S { float v; };
S operator+(S a, S b) { S r; r.v = a.v + WaveActiveSum(b.v); return r; }
float op_plus(float a, float x) { S s = { a * x }; S t = { x }; return (s + t).v; }
struct Q { float v; };
float operator*(Q a, Q b) { return a.v * b.v + WaveActiveMax(b.v); }
float op_times(float a, float x) { Q p = { a }; Q q = { x }; return p * q; }
float with_default(float a, float x, float s = float(1)) { return a * x + s * WaveActiveSum(x); }
float plain(float a, float x) { return a * x + sqrt(x) * 0.5 + max(x, 2.0); }
"""


@pytest.fixture
def lanes_module(device):
    return pydiff.load_module_from_source("s43_lanes43", SRC, device=device)


@pytest.mark.parametrize("name", ["op_plus", "op_times", "with_default"])
def test_cross_lane_gaps_keep_slangpy_path(device, forced, lanes_module, name):
    m = lanes_module
    xs = np.arange(1, 41, dtype=np.float32)

    def run():
        extra = (1.0,) if name == "with_default" else ()  # (pydiff passes no defaults)
        return [getattr(m, name)(2.0, pydiff.tensor(xs, device=device), *extra).numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    # before: 8 elements a thread summed on the generated kernel (op_plus: 87, 94, 101, ...
    # where SlangPy's path gives 38, 40, 42, ...)
    np.testing.assert_array_equal(gen[0], ref[0])
    assert any(k.startswith("declined: cross-lane") for k in counts), counts


def test_plain_functions_keep_generated_kernel(device, forced, lanes_module):
    m = lanes_module
    xs = np.arange(1, 41, dtype=np.float32)
    gen, ref, counts = run_both_paths(
        forced, lambda: [m.plain(2.0, pydiff.tensor(xs, device=device)).numpy()]
    )
    np.testing.assert_allclose(gen[0], 2 * xs + np.sqrt(xs) * 0.5 + np.maximum(xs, 2), 1e-6)
    assert counts.get("forward") == 1 and not any(k.startswith("declined") for k in counts)
    assert "plain" not in m.lane_effects


GAPS = {
    "operator": "struct S { float v; };\nS operator+(S a, S b) { S r; r.v = a.v + "
    "WaveActiveSum(b.v); return r; }\nfloat h(float x) { S s = {x}; return (s + s).v; }",
    "operator_float3": "struct S { float3 v; };\nfloat3 operator+(S a, S b) { return "
    "WaveActiveSum(a.v); }\nfloat3 h(float3 x) { S s = {x}; return s + s; }",
    "operator_generic": "__generic<T : __BuiltinFloatingPointType> T operator*(T a, int b) "
    "{ return WaveActiveSum(a); }\nfloat h(float x) { return x * 2; }",
    "operator_compound": "struct S { float v; };\nvoid operator+=(inout S a, S b) "
    "{ a.v += WaveActiveSum(b.v); }\nfloat h(float x) { S s = {x}; s += s; return s.v; }",
    "operator_call_chain": "struct S { float v; };\nS operator-(S a) { S r; r.v = "
    "QuadReadAcrossX(a.v); return r; }\nS neg(S a) { return -a; }\n"
    "float h(float x) { S s = {x}; return neg(s).v; }",
    "operator_via_return": "struct S { float v; };\nS operator+(S a, S b) { S r; r.v = "
    "WaveActiveSum(b.v); return r; }\nS make(float x) { S s = {x}; return s; }\n"
    "float h(float x) { return (make(x) + make(x)).v; }",
    "operator_via_field": "struct S { float v; };\nS operator+(S a, S b) { S r; r.v = "
    "WaveActiveSum(b.v); return r; }\nstruct P { S q; };\n"
    "float h(P a) { return (a.q + a.q).v; }",
    "operator_via_helper": "struct S { float v; };\nfloat w(float x) { return WaveActiveSum(x); }"
    "\nS operator+(S a, S b) { S r; r.v = w(b.v); return r; }\n"
    "float h(S s) { return (s + s).v; }",
    "extension_generic": "__generic<T : IFloat> extension T { property float ws { get { "
    "return WaveActiveSum(1.0); } } }\nfloat h(float x) { return x.ws; }",
    "extension_generic_2": "extension<T : IFloat> T { float ws2() { return 1.0; } "
    "property float ws { get { return WaveActiveSum(1.0); } } }\nfloat h(float x) { return x.ws; }",
    "interface_init": "interface IOp { __init(float x); float get(); }\nstruct A : IOp { "
    "float v; __init(float x) { v = WaveActiveSum(x); } float get() { return v; } }\n"
    "float h<T : IOp>(float x) { return T(x).get(); }",
    "interface_subscript": "interface IOp { __subscript(int i) -> float { get; } }\n"
    "struct A : IOp { float v; __subscript(int i) -> float { get { return WaveActiveSum(v); "
    "} } }\nfloat h<T : IOp>(T t) { return t[0]; }",
    "intrinsic_asm": 'float mysum(float x) { __intrinsic_asm "WaveActiveSum($0)"; }\n'
    "float h(float x) { return mysum(x); }",
    "target_switch": "float mysum(float x) { __target_switch { case hlsl: __intrinsic_asm "
    '"WaveActiveSum($0)"; case glsl: __intrinsic_asm "subgroupAdd($0)"; } }\n'
    "float h(float x) { return mysum(x); }",
    "target_intrinsic": '__target_intrinsic(glsl, "subgroupAdd($0)")\nfloat mysum(float x);\n'
    "float h(float x) { return mysum(x); }",
    "cuda_asm": 'float mysum(float x) { __intrinsic_asm "__shfl_xor_sync(0xffffffff, $0, 1)"; }'
    "\nfloat h(float x) { return mysum(x); }",
    "asm_braces": 'float mysum(float x) { __intrinsic_asm "({ float t = subgroupAdd($0); t; })"; }'
    "\nfloat h(float x) { return mysum(x); }",
    "alias_init": "struct S { float v; __init(float x) { v = WaveActiveSum(x); } };\n"
    "typealias V = S;\nfloat h(float x) { return V(x).v; }",
    "typedef_init": "struct S { float v; __init(float x) { v = WaveActiveSum(x); } };\n"
    "typedef S V;\nfloat h(float x) { return V(x).v; }",
    "alias_operator": "struct S { float v; };\nS operator+(S a, S b) { S r; r.v = "
    "WaveActiveSum(b.v); return r; }\ntypealias V = S;\nfloat h(V s) { return (s + s).v; }",
    "holder_subscript": "struct S { float v; __subscript(int i) -> float { get { return "
    "WaveActiveSum(v); } } };\nstruct P { S q; };\nfloat h(P p) { return p.q[0]; }",
    "function_value": "float g(float x) { return WaveActiveSum(x); }\nfloat apply(IFunc<float, "
    "float> f, float x) { return f(x); }\nfloat h(float x) { return apply(g, x); }",
    "paren_default": "float h(float x, float s = float(2)) { return WaveActiveSum(x) * s; }",
    "paren_default_callee": "float g(float x, float s = max(1.0, min(2.0, 3.0))) "
    "{ return WaveActiveSum(x) * s; }\nfloat h(float x) { return g(x); }",
}


@pytest.mark.parametrize("name", list(GAPS))
def test_lane_scan_finds_gap(name):
    assert lane_effects(preprocess(GAPS[name]).text)["h"][0] == "cross-lane"


PLAIN = [
    "float g(float x) { return x * 2.0 + sin(x); }\nfloat h(float x) { return g(x) + 1; }",
    "struct S { float v; };\nS operator+(S a, S b) { S r; r.v = a.v + b.v; return r; }\n"
    "float h(float x) { S s = {x}; return (s + s).v * 2 - 1; }",
    "interface IOp { float get(); }\nstruct A : IOp { float v; float get() { return v; } }\n"
    "float h<T : IOp>(T t) { return t.get(); }",
    "extension float { property float twice { get { return this * 2; } } }\n"
    "float h(float x) { return x.twice; }",
    "float h(float x, float s = float(2)) { float t = max(x, float(1)); return t * s; }",
    "float h(float x) { return x; }\nfloat k(float x) { return WaveActiveSum(x); }",
]


@pytest.mark.parametrize("src", PLAIN)
def test_lane_scan_plain_functions_not_declined(src):
    assert "h" not in lane_effects(preprocess(src).text)


def test_cross_lane_operator_declines_only_its_users():
    src = (
        "struct S { float v; };\nS operator+(S a, S b) { S r; r.v = WaveActiveSum(b.v); return r; }"
        "\nfloat h(float x) { S s = {x}; return (s + s).v; }\nfloat k(float x) { return x * 2; }"
    )
    found = lane_effects(preprocess(src).text)
    assert found["h"] == ("cross-lane", "'WaveActiveSum' in operator+()")
    assert "k" not in found
