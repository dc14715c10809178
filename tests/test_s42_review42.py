"""Session 42, review42: cross-lane code the lane scan (pydiff/lint_lanes.py) missed: a call
through ``fwd_diff(g)(...)`` / ``bwd_diff(g)(...)`` (g's name is not followed by ``(``), GLSL
``subgroup*`` intrinsics, ``spirv_asm`` group operations, and ``[PrimalSubstitute(g)]``.
Before, the elementwise generated kernel (eight elements a thread) ran them and gave other
values than SlangPy's path (one element a thread)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from generated_paths import run_both_paths
from pydiff.lint_lanes import lane_effects

SRC = """
import slangpy;
[Differentiable] float g(float x) { return x * x + no_diff(WaveActiveSum(x)); }
float via_fwd(float a, float x) { return a * x + fwd_diff(g)(diffPair(x, 1.0)).p; }
"""


def test_cross_lane_through_fwd_diff_keeps_slangpy_path(device, forced):
    m = pydiff.load_module_from_source("s42_review42_fwd", SRC, device=device)
    xs = np.arange(1, 41, dtype=np.float32)

    def run():
        return [m.via_fwd(2.0, pydiff.tensor(xs, device=device)).numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    np.testing.assert_array_equal(gen[0], ref[0])  # before: 8 elements a thread summed
    assert counts["declined: cross-lane: 'WaveActiveSum' in g()"] == 1
    assert m.lane_effects["via_fwd"] == ("cross-lane", "'WaveActiveSum' in g()")


@pytest.mark.parametrize(
    "src",
    [
        "[Differentiable] float g(float x) { return WaveActiveSum(x); }\n"
        "[Differentiable] float h(float x) { var p = diffPair(x); bwd_diff(g)(p, 1.0); "
        "return p.d; }",
        "[Differentiable] float g(float x) { return WaveActiveSum(x); }\n"
        "float h(float x) { return __fwd_diff(g)(diffPair(x, 1.0)).d; }",
        "float h(float x) { return subgroupAdd(x); }",
        "float h(float x) { return spirv_asm { result:$$float = OpGroupNonUniformFAdd "
        "Subgroup Reduce $x }; }",
        "float g(float x) { return WaveActiveSum(x); }\n"
        "[PrimalSubstitute(g)] float h(float x) { return x; }",
        "float g(float x) { return WaveActiveSum(x); }\n"
        "[PrimalSubstituteOf(h)] float g2(float x) { return g(x); }\nfloat h(float x) "
        "{ return x; }",
        "struct P { float v; property float s { get { return WaveActiveSum(v); } } }\n"
        "float h(P p) { return p.s; }",
        "struct P { float v; __subscript(int i) -> float { get { return WaveActiveSum(v); } "
        "} }\nfloat h(P p) { return p[0]; }",
        "struct P { float v; __init(float x) { v = WaveActiveSum(x); } }\n"
        "float h(float x) { return P(x).v; }",
    ],
    ids=[
        "bwd_diff",
        "__fwd_diff",
        "subgroup",
        "spirv_asm",
        "primal_substitute",
        "of",
        "property",
        "subscript",
        "init",
    ],
)
def test_lane_scan_finds_derivative_references_and_intrinsics(src):
    assert lane_effects(src)["h"][0] == "cross-lane"


def test_lane_scan_plain_functions_unaffected():
    src = "float g(float x) { return x * 2.0; }\nfloat h(float x) { return fwd_diff(g)(x); }"
    assert lane_effects(src) == {}
    src = (
        "struct P { float v; property float s { get { return v; } } }\nfloat h(P p) { return p.s; }"
    )
    assert lane_effects(src) == {}
