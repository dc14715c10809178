"""Issue 15, Slang traps: generic differentiable functions get their gradients (classes 3);
while loops with break, do-while with break and short-circuit while conditions are refused
at .bwds with file:line and fix, never run (4, 11); struct fields and implicit scalar-to-vector
promotion that get no gradient are warned about or refused (10). Expected values are float64
closed forms and central finite differences."""

import glob
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import pydiff
from pydiff import lint


@pytest.fixture(scope="module")
def mod(device, load):
    return load("traps15", device)


def _grad(fn, *args):
    y = fn(*args)
    fn.bwds(*args, _result=y.with_grads(ones=True))
    return y


X = np.array([0.5, -1.25, 2.0], np.float32)


@pytest.mark.parametrize(
    "name, f, df",
    [
        ("sq_builtin", lambda x: x * x, lambda x: 2 * x),
        ("cube_ifloat", lambda x: x**3, lambda x: 3 * x * x),
        ("ident", lambda x: x, lambda x: np.ones_like(x)),
        ("calls_generic", lambda x: x * x + x**3, lambda x: 2 * x + 3 * x * x),
    ],
)
def test_generic_function_gradients(device, mod, name, f, df):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not differentiable" warning any more
        y = _grad(getattr(mod, name), x)
    x64 = X.astype(np.float64)
    np.testing.assert_allclose(y.numpy(), f(x64), rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), df(x64), rtol=1e-6)


def test_generic_on_vectors_and_2d(device, mod):
    xs = np.array([[0.5, -1.0, 1.5], [2.0, 0.25, -0.75]], np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    _grad(mod.cube_ifloat, x)
    np.testing.assert_allclose(x.grad.numpy(), 3 * xs.astype(np.float64) ** 2, rtol=1e-6)
    v = pydiff.tensor(xs, device=device, dtype="float3", requires_grad=True)
    _grad(mod.vec_generic, v)
    np.testing.assert_allclose(v.grad.numpy(), 3 * xs.astype(np.float64) ** 2, rtol=1e-6)


def test_generic_no_diff_parameter(device, mod):
    a = pydiff.tensor(X, device=device, requires_grad=True)
    b = pydiff.tensor(np.array([4.0, 5.0, 6.0], np.float32), device=device)
    _grad(mod.mul_nd, a, b)
    np.testing.assert_allclose(a.grad.numpy(), [4.0, 5.0, 6.0])


LOOP = """
[Differentiable]
float grow(float a)
{
    float t = a;
    [MaxIters(20)]
    %s
    return t;
}
"""


@pytest.mark.parametrize(
    "loop, kind, line, forward",
    [
        ("while (t < 100.0) { t = 1.5 * t + a; if (t > 5.3) break; }", "while-break", 7, 8.125),
        ("while (t < 10.0 && t > 0.0) { t = 1.5 * t + a; }", "while-short-circuit", 7, 13.1875),
        # a do-while with break crashes even the forward kernel's build: refused in-process
        # only because the refusal comes first (the oracle runs the crash in a subprocess)
        (
            "do { t = 1.5 * t + a; if (t > 5.3) break; } while (t < 100.0);",
            "do-while-break",
            7,
            None,
        ),
    ],
)
def test_loop_traps_refused_with_line_and_fix(device, loop, kind, line, forward):
    src = LOOP % loop
    assert [f.kind for f in lint.scan_source(src)] == [kind]
    name = "grow_" + kind.replace("-", "_")
    with pytest.warns(pydiff.ShaderTrapWarning, match=rf"{name}\S*:{line}"):
        m = pydiff.load_module_from_source(name, src, device=device)
    x = pydiff.tensor(np.array([1.0, 2.0], np.float32), device=device, requires_grad=True)
    if forward is None:
        with pytest.raises(pydiff.ShaderTrapError, match=rf"{name}\S*:{line}: in grow\(\)"):
            m.grow(x)
        return
    y = m.grow(x)  # the forward is unaffected
    assert y.numpy()[0] == pytest.approx(forward)  # 1 -> 2.5 -> 4.75 -> 8.125 (-> 13.1875)
    with pytest.raises(pydiff.ShaderTrapError, match=rf"{name}\S*:{line}: in grow\(\).*for \("):
        m.grow.bwds(x, _result=y.with_grads(ones=True))


@pytest.mark.parametrize(
    "loop",
    [
        "for (; t < 100.0; ) { t = 1.5 * t + a; if (t > 5.3) break; }",  # the suggested fix
        "while (true) { t = 1.5 * t + a; if (t > 5.3) break; }",
        "for (;;) { t = 1.5 * t + a; if (t > 5.3) break; if (!(t < 100.0)) break; }",
    ],
)
def test_loop_fixes_give_finite_difference_gradients(device, loop):
    src = LOOP % loop
    assert lint.scan_source(src) == []

    def ref(a):
        t = a
        for _ in range(20):
            t = 1.5 * t + a
            if t > 5.3:
                break
        return t

    xs = np.array([1.0, 2.0, 3.0, 0.7], np.float32)
    m = pydiff.load_module_from_source(f"grow_fix_{abs(hash(loop))}", src, device=device)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    _grad(m.grow, x)
    h = 1e-6
    fd = [(ref(a + h) - ref(a - h)) / (2 * h) for a in xs.astype(np.float64)]
    np.testing.assert_allclose(x.grad.numpy(), fd, rtol=1e-5)


def test_crashing_while_condition_refused_in_subprocess():
    """Issue 15 class 11: the refusal must come before the compiler segfaults."""
    code = textwrap.dedent(
        """
        import numpy as np, pydiff, warnings
        warnings.simplefilter("ignore")
        src = '''[Differentiable]
        float f(float x) { float y = x; int k = 0;
            [MaxIters(20)] while (y < 10.0 && k < 10) { y = y * 1.5 + x; k++; }
            return y; }'''
        m = pydiff.load_module_from_source("crash11", src)
        x = pydiff.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
        y = m.f(x)
        try:
            m.f.bwds(x, _result=y.with_grads(ones=True))
        except pydiff.ShaderTrapError as e:
            print("refused", ":3: in f()" in str(e))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["refused", "True"]


@pytest.mark.parametrize("name", ["affine_plain", "affine_mixed"])
def test_struct_field_without_gradient_warns(device, mod, name):
    a = pydiff.tensor(np.array([1.0, 2.0], np.float32), device=device, requires_grad=True)
    b = pydiff.tensor(np.array([3.0, 4.0], np.float32), device=device, requires_grad=True)
    x = pydiff.tensor(np.array([5.0, 7.0], np.float32), device=device, requires_grad=True)
    with pytest.warns(pydiff.GradientFlowWarning) as record:
        _grad(getattr(mod, name), {"a": a, "b": b}, x)
    named = sorted(
        f for f in ("p.a", "p.b") if any(f"'{f}' requires" in str(w.message) for w in record)
    )
    assert named == (["p.a", "p.b"] if name == "affine_plain" else ["p.b"])
    np.testing.assert_allclose(x.grad.numpy(), [1.0, 2.0])  # d/dx = a
    if name == "affine_mixed":
        np.testing.assert_allclose(a.grad.numpy(), [5.0, 7.0])  # d/da = x still flows


def test_struct_fields_detached_do_not_warn(device, mod):
    a = pydiff.tensor(np.array([1.0], np.float32), device=device, requires_grad=True)
    b = pydiff.tensor(np.array([3.0], np.float32), device=device)
    x = pydiff.tensor(np.array([5.0], np.float32), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _grad(mod.affine_mixed, {"a": a, "b": b}, x)
    np.testing.assert_allclose(a.grad.numpy(), [5.0])


def test_scalar_vector_promotion_refused(device):
    src = (
        "[Differentiable]\nfloat3 scale(float s, float3 v)\n{\n    return s * v;\n}\n"
        "[Differentiable]\nfloat3 scale_ok(float s, float3 v) { return float3(s) * v; }\n"
    )
    with pytest.warns(pydiff.ShaderTrapWarning, match=r"promote4\S*:4"):
        m = pydiff.load_module_from_source("promote4", src, device=device)
    s = pydiff.tensor(np.array([2.0], np.float32), device=device, requires_grad=True)
    v = pydiff.tensor(np.array([[1.0, 2.0, 3.0]], np.float32), device=device, dtype="float3")
    with pytest.raises(pydiff.ShaderTrapError, match=r"floatN\(s\) \* v"):
        _grad(m.scale, s, v)
    _grad(m.scale_ok, s, v)
    np.testing.assert_allclose(s.grad.numpy(), [6.0])  # d/ds sum(s * v) = sum(v)


# Scanner verdicts measured against raw SlangPy (tests/test_trap_oracle.py, float64 central
# differences): True = SlangPy 0.43.1 gives a wrong gradient or crashes, so lint must flag it.
LOOP_VERDICTS = [
    ("while (t < 100.0) { t = 1.5 * t + a; if (t > 5.3) break; }", True),
    ("while (t < 100.0) { if (t > 5.3) break; t = 1.5 * t + a; }", False),
    ("while (t < 100.0) { if (t > 5.3) { break; } t = 1.5 * t + a; }", False),
    ("while (t < 100.0) { k++; if (t > 5.3) break; t = 1.5 * t + a; }", False),
    ("while (t < 100.0) { k = k + 1; if (t > 5.3) break; t = 1.5 * t + a; }", False),
    ("while (t < 100.0) { float u = t * 2.0; if (u > 10.6) break; t = 1.5 * t + a; }", False),
    ("while (t < 100.0) { step(t, a); if (t > 5.3) break; }", False),
    ("while (t < 100.0) { if (t > 5.3) { t = 2.0 * t; break; } t = 1.5 * t + a; }", True),
    ("while (t < 100.0) { if (t > 500.0) break; t = 1.5 * t + a; if (t > 5.3) break; }", True),
    ("while (t < 100.0) { s = s + t; if (t > 5.3) break; t = 1.5 * t + a; }", True),
    ("while (k < 4) { k++; if (t > 5.3) continue; t = 1.5 * t + a; }", False),
    ("while (true) { t = 1.5 * t + a; if (t > 5.3) break; }", False),
    ("for (; t < 100.0; ) { t = 1.5 * t + a; if (t > 5.3) break; }", False),
    ("do { t = 1.5 * t + a; if (t > 5.3) break; } while (t < 100.0);", True),
    ("do { t = 1.5 * t + a; if (t > 5.3) break; } while (a < 100.0);", True),
    ("do { if (t > 5.3) break; t = 1.5 * t + a; } while (a < 100.0);", False),
    ("do { t = 1.5 * t + a; if (t > 5.3) break; } while (true);", False),
    ("do { k++; if (t > 5.3) continue; t = 1.5 * t + a; } while (k < 4);", False),
]


LOOP_VERDICTS += [  # class 11: crashes of .bwds (segfaults), measured in subprocesses
    ("while (t < 100.0 && k < 2) { t = 1.5 * t + a; k++; }", True),
    ("while (!(t >= 100.0 || k >= 2)) { t = 1.5 * t + a; k++; }", True),
    ("while (k < 2 ? t < 100.0 : false) { t = 1.5 * t + a; k++; }", True),
    ("while (select(k < 2, t < 100.0, false)) { t = 1.5 * t + a; k++; }", False),
    ("while (t < 100.0 & k < 2) { t = 1.5 * t + a; k++; }", False),
    ("for (; k < 2 ? t < 100.0 : false; ) { t = 1.5 * t + a; k++; }", False),
    ("do { t = 1.5 * t + a; k++; } while (t < 100.0 && k < 2);", False),
]


@pytest.mark.parametrize("loop, flagged", LOOP_VERDICTS)
def test_loop_scan_verdicts(loop, flagged):
    src = (
        "[Differentiable] void step(inout float t, float a) { t = 1.5 * t + a; }\n"
        "[Differentiable]\nfloat grow(float a)\n{\n    float t = a; float s = 0.0; int k = 0;\n"
        f"    [MaxIters(20)]\n    {loop}\n    return t + 0.0 * s;\n}}\n"
    )
    found = [f for f in lint.scan_source(src) if f.function == "grow"]
    assert bool(found) == flagged, found
    if flagged:
        assert found[0].line == 7 and ("break" in found[0].message or "crash" in found[0].message)


PROMOTION_VERDICTS = [
    ("return s * v;", True),
    ("return (s) * v;", True),
    ("return s / v;", True),
    ("return v + s;", True),
    ("return v - s;", True),
    ("float3 u = v; u += s; return u;", True),
    ("float3 u = v; u -= s; return u;", True),
    ("float t = s; return t * v;", True),
    ("return a - s * v;", True),
    ("return v * s;", False),
    ("return v / s;", False),
    ("float3 u = v; u *= s; return u;", False),
    ("return float3(s) * v;", False),
    ("float3 u = s; return u * v;", False),
    ("return -s * v;", False),
    ("return 2.0 * s * v;", False),
    ("float t = s * 3.0; return t * v;", False),
    ("float t = s + 1.0; return t * v;", False),
    ("return (s + 1.0) * v;", False),
    ("return v + s * 2.0;", False),
    ("return h(s) * v;", False),
    ("return v.x + s;", False),
]


@pytest.mark.parametrize("body, flagged", PROMOTION_VERDICTS)
def test_promotion_scan_verdicts(body, flagged):
    src = f"[Differentiable] float3 g(float s, float3 v, float a) {{ {body} }}"
    found = lint.scan_source(src)
    assert [f.kind for f in found] == (["scalar-vector-promotion"] if flagged else []), found


def test_promotion_of_a_loaded_value_is_not_flagged():
    # measured right: a local from a tensor load, promoted on either side
    src = (
        "[Differentiable]\nvoid f(int i, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)\n"
        "{ float a = x[i]; float3 v = float3(1.0, 2.0, 3.0); float3 w = a + v; w = w * a;\n"
        "  y[i] = w.x + w.y + w.z; }\n"
    )
    assert lint.scan_source(src) == []


def _project_slang_sources():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("samples", "shaders", "tests/shaders"):
        for path in sorted(glob.glob(os.path.join(root, folder, "**", "*.slang"), recursive=True)):
            with open(path) as f:
                yield os.path.relpath(path, root), f.read()
    for path in sorted(glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True)):
        with open(path) as f:
            text = f.read()
        for i, m in enumerate(re.finditer(r"```(?:slang|hlsl)\n(.*?)```", text, re.S)):
            yield f"{os.path.relpath(path, root)}#{i}", m.group(1)


def test_scanner_flags_no_correct_project_shader():
    """False positives refuse correct code: every shader of the project, the samples and the
    docs' code blocks scan clean, except tests/shaders/traps.slang (traps on purpose)."""
    sources = list(_project_slang_sources())
    assert len(sources) > 20
    found = [str(f) for name, src in sources for f in lint.scan_source(src, name)]
    assert [f for f in found if not f.startswith("tests/shaders/traps.slang:")] == []


def test_loop_guard_first_and_counter_give_finite_difference_gradients(device):
    src = LOOP % ("while (t < 100.0) { k++; if (t > 5.3) break; float u = 1.5 * t; t = u + a; }")
    src = src.replace("float t = a;", "float t = a; int k = 0;")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no trap warning: this loop is right in SlangPy
        m = pydiff.load_module_from_source("grow_guard_first", src, device=device)

    def ref(a):
        t = a
        for _ in range(20):
            if t > 5.3:
                break
            t = 1.5 * t + a
        return t

    xs = np.array([1.0, 2.0, 3.0, 0.7], np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    _grad(m.grow, x)
    h = 1e-6
    fd = [(ref(a + h) - ref(a - h)) / (2 * h) for a in xs.astype(np.float64)]
    np.testing.assert_allclose(x.grad.numpy(), fd, rtol=1e-5)


@pytest.mark.parametrize("expr, fix", [("v + s", "v + floatN(s)"), ("v - s", "v - floatN(s)")])
def test_promotion_on_the_right_refused(device, expr, fix):
    src = f"[Differentiable]\nfloat3 shift(float s, float3 v)\n{{\n    return {expr};\n}}\n"
    name = "promote_right_" + ("plus" if "+" in expr else "minus")
    with pytest.warns(pydiff.ShaderTrapWarning, match=rf"{name}\S*:4"):
        m = pydiff.load_module_from_source(name, src, device=device)
    s = pydiff.tensor(np.array([2.0], np.float32), device=device, requires_grad=True)
    v = pydiff.tensor(np.array([[1.0, 2.0, 3.0]], np.float32), device=device, dtype="float3")
    y = m.shift(s, v)  # the forward is right
    np.testing.assert_allclose(y.numpy(), [[3.0, 4.0, 5.0]] if "+" in expr else [[-1, 0, 1]])
    with pytest.raises(pydiff.ShaderTrapError, match=re.escape(fix)):
        m.shift.bwds(s, v, _result=y.with_grads(ones=True))
