"""The lint refuses exactly the shaders SlangPy really gets wrong: each variant is run through
raw SlangPy in a subprocess (it may segfault) and compared with y = x*x's gradient 2x.

If a SlangPy upgrade fixes a trap, the matching case here fails and the lint rule can go.
"""

import os
import subprocess
import sys

import pytest

import pydiff
from pydiff import lint

ORACLE = os.path.join(os.path.dirname(__file__), "trap_oracle.py")

CASES = [
    # (id, params, body, shape)
    ("int-subscript", "int idx", "float a = x[idx]; y[idx] = a * a;", "3"),
    ("int-load-store", "int idx", "float a = x.load(idx); y.store(idx, a * a);", "3"),
    ("array-subscript", "int[1] idx", "float a = x[idx]; y[idx] = a * a;", "3"),
    ("array-load", "int[1] idx", "float a = x.load(idx); y[idx] = a * a;", "3"),
    ("array-store", "int[1] idx", "float a = x[idx]; y.store(idx, a * a);", "3"),
    ("uint-1d-load", "uint idx", "float a = x.load(idx); y[idx] = a * a;", "3"),
    ("mixed-1d", "int[1] idx", "int i = idx[0]; float a = x[i]; y[idx] = a * a;", "3"),
    (
        "uint-loop-1d",
        "int idx",
        "float a = 0.0; [MaxIters(4)] for (uint k = 0; k < 1; k++) { a += x[idx + int(k)]; } "
        "uint u = uint(idx); a = x[u]; y[idx] = a * a;",
        "3",
    ),
    (
        "2d-scalars",
        "int[2] idx",
        "int i = idx[0]; int j = idx[1]; float a = x[i, j]; y[i, j] = a * a;",
        "2,2",
    ),
    ("2d-arrays", "int[2] idx", "float a = x[idx]; y[idx] = a * a;", "2,2"),
    (
        "2d-mixed",
        "int[2] idx",
        "int i = idx[0]; int j = idx[1]; float a = x[i, j]; y[idx] = a * a;",
        "2,2",
    ),
    (
        "loop-bound-shape",
        "int idx",
        "float s = 0.0; [MaxIters(8)] for (int i = 0; i < x.shape[0]; i++) { s += x[i]; } "
        "y[idx] = s * 0.0 + x[idx] * x[idx];",
        "3",
    ),
    (
        "loop-bound-local",
        "int idx",
        "float s = 0.0; int n = x.shape[0]; "
        "[MaxIters(8)] for (int i = 0; i < n; i++) { s += x[i]; } "
        "y[idx] = s * 0.0 + x[idx] * x[idx];",
        "3",
    ),
    # issue 15: a short-circuit operator in a while condition segfaults bwds (for and
    # do-while are fine, and so are the non-short-circuit & and |, the fixes lint suggests)
    (
        "while-and",
        "int idx",
        "float a = x[idx]; float t = a; int k = 0; "
        "[MaxIters(4)] while (t < 100.0 && k < 2) { t = t * 1.5 + a; k++; } "
        "y[idx] = a * a + 0.0 * t;",
        "3",
    ),
    (
        "while-or-ints",
        "int idx",
        "float a = x[idx]; float t = a; int k = 0; "
        "[MaxIters(4)] while (k < 2 || k < 0) { t = t * 1.5 + a; k++; } "
        "y[idx] = a * a + 0.0 * t;",
        "3",
    ),
    (
        "while-bitand",
        "int idx",
        "float a = x[idx]; float t = a; int k = 0; "
        "[MaxIters(4)] while (t < 100.0 & k < 2) { t = t * 1.5 + a; k++; } "
        "y[idx] = a * a + 0.0 * t;",
        "3",
    ),
    (
        "for-and",
        "int idx",
        "float a = x[idx]; float t = a; int k = 0; "
        "[MaxIters(4)] for (; t < 100.0 && k < 2; k++) { t = t * 1.5 + a; } "
        "y[idx] = a * a + 0.0 * t;",
        "3",
    ),
    (
        "do-while-and",
        "int idx",
        "float a = x[idx]; float t = a; int k = 0; "
        "[MaxIters(4)] do { t = t * 1.5 + a; k++; } while (t < 100.0 && k < 2); "
        "y[idx] = a * a + 0.0 * t;",
        "3",
    ),
    # issue 15 class 4: 'break' in a while (cond) loop drops the breaking iteration's
    # derivative; for/do-while/while (true)/[ForceUnroll]/continue/return are right.
    # Expected dt/da in float64 closed form (t = c*a, c from the iteration count; no kink at
    # a = 1, 2, 3 with the threshold 5.3): 8.125, 4.75, 2.5.
    *(
        (name, "int idx", "float a = x[idx]; float t = a; int k = 0; " + loop + " y[idx] = t;", "3")
        for name, loop in [
            (
                "while-break",
                "[MaxIters(20)] while (t < 100.0) { t = 1.5*t + a; if (t > 5.3) break; }",
            ),
            (
                "while-break-counter",
                "[MaxIters(20)] while (k < 20) { k++; t = 1.5*t + a; if (t > 5.3) break; }",
            ),
            ("while-no-break", "[MaxIters(20)] while (t < 5.3) { t = 1.5*t + a; }"),
            (
                "while-true-break",
                "[MaxIters(20)] while (true) { t = 1.5*t + a; if (t > 5.3) break; }",
            ),
            (
                "while-unroll-break",
                "[ForceUnroll] while (k < 20) { k++; t = 1.5*t + a; if (t > 5.3) break; }",
            ),
            (
                "for-break",
                "[MaxIters(20)] for (; t < 100.0; ) { t = 1.5*t + a; if (t > 5.3) break; }",
            ),
            (
                "do-break",
                "[MaxIters(20)] do { t = 1.5*t + a; if (t > 5.3) break; } while (t < 100.0);",
            ),
        ]
    ),
    (
        "while-and-floats-break",
        "int idx",
        "float a = x[idx]; float t = a; "
        "[MaxIters(20)] while (t < 100.0 && t > 0.0) { t = 1.5*t + a; if (t > 5.3) break; } "
        "y[idx] = t;",
        "3",
    ),
    (
        "2d-local-array-mixed",
        "int[2] idx",
        "int i = idx[0]; int j = idx[1]; int at[2] = { i, j }; float a = x[at]; y[i, j] = a * a;",
        "2,2",
    ),
]


LOOP_GRAD = "8.125,4.75,2.5"  # d/da of the issue-15 loop cases at a = 1, 2, 3


def _oracle(params: str, body: str, shape: str, expected: str = "", prefix: str = "") -> str:
    try:
        out = subprocess.run(
            [sys.executable, ORACLE, params, body, shape, prefix, expected],
            capture_output=True,
            text=True,
            timeout=45,  # a healthy variant takes about 3 s; a hung kernel never returns
        )
    except subprocess.TimeoutExpired:
        return "hang"
    if out.returncode != 0:
        return (
            "crash"
            if out.returncode < 0 or out.returncode in (139, 134)
            else f"error {out.stderr[-300:]}"
        )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lint_verdict_matches_slangpy(case):
    if "vulkan" not in pydiff.available_devices():
        pytest.skip("the oracle runs on Vulkan")
    _, params, body, shape = case
    dims = len(shape.split(","))
    src = (
        f"[Differentiable]\nvoid f({params}, IDiffTensor<float, {dims}> x, "
        f"IWDiffTensor<float, {dims}> y)\n{{\n{body}\n}}\n"
    )
    refused = bool(lint.affected_functions(src, lint.scan_source(src)))
    expected = LOOP_GRAD if "t = 1.5*t + a" in body else ""
    outcome = _oracle(params, body, shape, expected)
    assert outcome.split()[0] in ("ok", "wrong", "crash", "hang"), outcome
    assert refused == (outcome != "ok"), f"lint refused={refused}, SlangPy: {outcome}"


# issue 15 class 10: a float scalar LEFT of a float vector in + - * / is promoted implicitly and
# its derivative dropped. g(s, v) summed over v = (1, 2, 3): d/ds = 6 wherever s enters once.
PROMOTION_CASES = [
    ("s-times-v", "return s * v;", "6,6,6"),
    ("s-plus-v", "return s + v - float3(s);", "0,0,0"),
    ("scalar-local-times-v", "float t = s * 1.0; return t * v;", "6,6,6"),
    ("v-times-s", "return v * s;", "6,6,6"),
    ("explicit-splat", "return float3(s) * v;", "6,6,6"),
    ("assign-splat", "float3 u = s; return u * v;", "6,6,6"),
    ("v-plus-s-times-v", "return v + s * v;", "6,6,6"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", PROMOTION_CASES, ids=[c[0] for c in PROMOTION_CASES])
def test_promotion_lint_matches_slangpy(case):
    if "vulkan" not in pydiff.available_devices():
        pytest.skip("the oracle runs on Vulkan")
    _, g, expected = case
    prefix = "[Differentiable] float3 g(float s, float3 v) { " + g + " }"
    body = "float a = x[idx]; float3 w = g(a, float3(1.0, 2.0, 3.0)); y[idx] = w.x + w.y + w.z;"
    src = (
        prefix
        + "\n[Differentiable]\nvoid f(int idx, IDiffTensor<float, 1> x, "
        + "IWDiffTensor<float, 1> y)\n{\n"
        + body
        + "\n}\n"
    )
    refused = bool(lint.affected_functions(src, lint.scan_source(src)).get("f"))
    outcome = _oracle("int idx", body, "3", expected, prefix)
    assert outcome.split()[0] in ("ok", "wrong", "crash", "hang"), outcome
    assert refused == (outcome != "ok"), f"lint refused={refused}, SlangPy: {outcome}"
