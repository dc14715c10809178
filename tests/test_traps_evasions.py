"""Trap spellings that got past the load-time scan (tester's breakA findings F0b, F0c, F1b,
F1c, F1d, F2, F3, F12): each is refused at once (a hang or a segfault is never started), with
file, line and fix, and the fixes it names give the right gradients (float64 closed forms
and NumPy). Correct look-alikes stay allowed."""

import textwrap
import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import lint

HEAD = "import slangpy;\n"
KERNEL = (
    "[Differentiable] void k(int i, float c, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)"
)
RW_KERNEL = (
    "[Differentiable] void k(int i, float c, IDiffTensor<float, 1> x, "
    "IRWDiffTensor<float, 1> y, IRWDiffTensor<float, 1> z)"
)


def _kinds(src: str) -> dict[str, set[str]]:
    """function -> kinds of the findings that refuse its .bwds (its callees' included)."""
    found = lint.scan_source(src, "<t>")
    return {n: {f.kind for f in fs} for n, fs in lint.affected_functions(src, found).items()}


# F0b: interface-tensor reads that run only under a short-circuit or after continue/break
HANGS = {
    "and": "bool ok = (c > 0.0) && (x[i] > 0.5); y[i] = ok ? c : 0.0;",
    "or": "bool ok = (c < 0.0) || (x[i] > 0.5); y[i] = ok ? c : 0.0;",
    "and-load": "bool ok = (c > 0.0) && (x.load(i) > 0.5); y[i] = ok ? c : 0.0;",
    "if-and": "float v = 0.0; if (c > 0.0 && x[i] > 0.0) v = 1.0; y[i] = v;",
    "for-cond": "float acc = 0.0; [MaxIters(4)] for (int k = 0; (k < 3) && (x[i] > 0.05 * "
    "float(k)); k++) { acc += c; } y[i] = acc;",
    "ternary-cond": "float v = (c > 0.0 && x[i] > 0.5) ? 1.0 : 0.0; y[i] = v * c;",
    "continue": "float acc = 0.0; [MaxIters(4)] for (int k = 0; k < 2; k++) { "
    "if (c > float(k)) continue; acc += x[i]; } y[i] = acc;",
    "break": "float acc = 0.0; [MaxIters(4)] for (int k = 0; k < 2; k++) { "
    "if (c > float(k)) break; acc += x[i]; } y[i] = acc;",
}


@pytest.mark.parametrize("body", HANGS.values(), ids=HANGS.keys())
def test_conditional_reads_refused_by_scan(body):
    assert "conditional-interface-access" in _kinds(f"{KERNEL} {{ {body} }}").get("k", ())


def test_short_circuit_in_helper_refuses_caller():
    src = (
        "[Differentiable] float scget(IDiffTensor<float, 1> x, int i, float c) "
        "{ bool ok = (c > 0.0) && (x[i] > 0.5); return ok ? c : 0.0; }\n"
        f"{KERNEL} {{ y[i] = scget(x, i, c); }}"
    )
    assert "conditional-interface-access" in _kinds(src)["k"]


SAFE = {
    "bitwise-and": "bool ok = (c > 0.0) & (x[i] > 0.5); y[i] = ok ? c : 0.0;",
    "and-on-locals": "float a = x[i]; bool ok = (c > 0.0) && (a > 0.5); y[i] = select(ok, c, a);",
    "continue-before-loop": "float a = x[i]; float acc = 0.0; [MaxIters(4)] for (int k = 0; "
    "k < 2; k++) { if (c > float(k)) continue; acc += a; } y[i] = acc;",
}


@pytest.mark.parametrize("body", SAFE.values(), ids=SAFE.keys())
def test_unconditional_reads_allowed(body):
    assert not _kinds(f"{KERNEL} {{ {body} }}").get("k")


def test_short_circuit_refused_before_running(device):
    # the hang happens while compiling .bwds: the refusal must come before any compile
    m = _load(device, "sc_hang", f"{KERNEL} {{ {HANGS['and']} }}")
    x = pydiff.tensor(np.linspace(0.1, 1, 4), device=device, requires_grad=True)
    y = pydiff.zeros((4,), device=device, requires_grad=True)
    idx = pydiff.tensor(np.arange(4), device=device, dtype="int")
    m.k(idx, 0.5, x, y)
    np.testing.assert_allclose(y.numpy(), np.where(np.linspace(0.1, 1, 4) > 0.5, 0.5, 0.0))
    with pytest.raises(pydiff.ShaderTrapError, match=r"<sc_hang>:2: in k\(\).*'&&'"):
        m.k.bwds(idx, 0.5, x, y)


def _load(device, name, src):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pydiff.ShaderTrapWarning)
        return pydiff.load_module_from_source(name, HEAD + src, device=device)


# F1c: .load with a swizzle or a struct field of a vector
def test_load_swizzle_and_vector_field_refused():
    src = (
        "struct S { int2 idx; int j; };\n"
        "[Differentiable] float swz(int i, IDiffTensor<float, 2> w) "
        "{ int2 idx = int2(i, 1); return w.load(idx.xy) * 2.0; }\n"
        "[Differentiable] float fld(int i, IDiffTensor<float, 2> w) "
        "{ S s; s.idx = int2(i, 1); return w.load(s.idx) * 2.0; }\n"
        "[Differentiable] float ok(int i, IDiffTensor<float, 2> w) "
        "{ int2 idx = int2(i, 1); S s; s.j = 1; return w.load(idx.x, s.j) * 2.0; }\n"
    )
    kinds = _kinds(src)
    assert kinds["swz"] == {"interface-load-store"}
    assert kinds["fld"] == {"interface-load-store"}
    assert "ok" not in kinds


# F0c: struct holders of interface tensors however spelled; index kinds split across a call
@pytest.mark.parametrize(
    "decl, param",
    [
        ("struct In { IDiffTensor<float, 1> w; }; struct L { In inner; float k; };", "L l"),
        ("typealias T1 = IDiffTensor<float, 1>; struct L { T1 w; float k; };", "L l"),
        ("typedef IDiffTensor<float, 1> T1; struct L { T1 w; float k; };", "L l"),
        ("struct L<TT : IDiffTensor<float, 1>> { TT w; float k; };", "L<DiffTensor<float, 1>> l"),
    ],
    ids=["nested", "typealias", "typedef", "generic"],
)
def test_struct_interface_tensor_spellings_refuse_forward(device, decl, param):
    body = "l.inner.w[i] * l.k" if "inner" in decl else "l.w[i] * l.k"
    src = f"{decl}\n[Differentiable] float f(int i, {param}) {{ return {body}; }}"
    found = [f for f in lint.scan_source(src, "<t>") if f.function == "f"]
    assert found and all(f.crashes_call for f in found)
    if "inner" in decl:  # the tester's segfaulting forward call: refused, not run
        m = _load(device, "sif_nested", src)
        w = pydiff.tensor(np.arange(1.0, 5.0), device=device, requires_grad=True)
        with pytest.raises(pydiff.ShaderTrapError, match="interface tensor field"):
            m.f(spy.grid((4,)), {"inner": {"w": w}, "k": 2.0}, _result="numpy")


def test_index_kinds_split_across_a_call_refused(device):
    src = (
        "[Differentiable] float h(IDiffTensor<float, 2> w, int2 idx) { return w[idx]; }\n"
        "[Differentiable] float f(int i, IDiffTensor<float, 2> w) "
        "{ return h(w, int2(1, i)) + w[i, 0]; }\n"
        "[Differentiable] float g(int i, IDiffTensor<float, 2> w) { return h(w, int2(1, i)); }"
    )
    kinds = _kinds(src)
    assert "mixed-index-kinds" in kinds["f"] and "g" not in kinds and "h" not in kinds
    m = _load(device, "mih", src)
    w = pydiff.tensor(np.arange(8.0).reshape(4, 2), device=device, requires_grad=True)
    with pytest.raises(pydiff.ShaderTrapError, match=r"w\[idx\] in h\(\)"):
        m.f.bwds(spy.grid((2,)), w, _result=1.0)


# F1b: a read back after a .store or a helper's store
READBACKS = {
    "helper-store": "put(y, i, x[i] * c); float w = y[i]; z[i] = w;",
    "helper-store-helper-read": "put(y, i, x[i] * c); z[i] = get(y, i);",
    "helper-store-load": "put(y, i, x[i] * c); z[i] = y.load(i);",
    "helper-store-other-element": "put(y, i, x[i] * c); z[i] = y[(i + 1) % 4];",
    "store-then-load": "y.store(i, x[i] * c); float w = y.load(i); z[i] = w;",
    "store-then-subscript": "y.store(i, x[i] * c); z[i] = y[i];",
}
HELPERS = (
    "[Differentiable] void put(IRWDiffTensor<float, 1> y, int i, float v) { y[i] = v; }\n"
    "[Differentiable] float get(IRWDiffTensor<float, 1> y, int i) { return y[i]; }\n"
)


@pytest.mark.parametrize("body", READBACKS.values(), ids=READBACKS.keys())
def test_read_back_after_store_refused(body):
    assert "interface-store-then-read" in _kinds(f"{HELPERS}{RW_KERNEL} {{ {body} }}")["k"]


@pytest.mark.parametrize(
    "body",
    [
        "float a = y[i]; put(y, i, x[i] * c + a); z[i] = a;",  # read first, then the store
        "y.store(i, x[i] * c); put(z, i, x[i]);",  # stores only
        "y.store(i, y.load(i) * c); z[i] = x[i];",  # the read inside the store's statement
        "float v = get(y, i); z[i] = v * x[i];",  # reads only
    ],
)
def test_reads_before_the_store_allowed(body):
    assert not _kinds(f"{HELPERS}{RW_KERNEL} {{ {body} }}").get("k")


def test_read_back_fix_gives_right_gradient(device):
    # the fix the message names: keep the stored value in a local and use that
    src = HELPERS + f"{RW_KERNEL} {{ float v = x[i] * c; put(y, i, v); z[i] = v; }}"
    m = _load(device, "rb_fix", src)
    assert not m.traps.get("k")
    xs = np.linspace(0.1, 1, 4)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((4,), device=device, requires_grad=True)
    z = pydiff.zeros((4,), device=device, requires_grad=True)
    idx = pydiff.tensor(np.arange(4), device=device, dtype="int")
    m.k(idx, 0.5, x, y, z)
    y.grad.fill(1.0)
    z.grad.fill(1.0)
    m.k.bwds(idx, 0.5, x, y, z)
    np.testing.assert_allclose(x.grad.numpy(), np.full(4, 2 * 0.5), rtol=1e-6)  # d(y+z)/dx


# F1d: non-differentiable inout helpers in a namespace or an extension; promotion of 'this'
def test_namespaced_and_extension_writers_refused():
    src = (
        "namespace nn { void stp(inout float t, float a) { t = t * 1.5 + a; } }\n"
        "extension float { [mutating] void stp2(float a) { this = this * 1.5 + a; } }\n"
        "[Differentiable] float ns_dot(float a, float x) { float t = x; nn.stp(t, a); return t; }\n"
        "[Differentiable] float ns_col(float a, float x) "
        "{ float t = x; nn::stp(t, a); return t; }\n"
        "[Differentiable] float ext(float a, float x) { float t = x; t.stp2(a); return t; }\n"
    )
    from pydiff import lint_calls

    found = lint_calls.scan_source(src, "<t>", lint_calls.non_differentiable_writers(src))
    assert {f.function for f in found} == {"ns_dot", "ns_col", "ext"}
    assert all(f.kind == "non-differentiable-helper" for f in found)


def test_promotion_of_this_in_vector_extension_refused():
    src = (
        "extension float3 { [Differentiable] float3 scaled(float k) { return k * this; } }\n"
        "extension float3 { [Differentiable] float3 fine(float k) { return this * k; } }\n"
        "[Differentiable] float via(float s, float x) "
        "{ return dot(float3(x, 1.0, 2.0).scaled(s), float3(1.0)); }\n"
    )
    kinds = _kinds(src)
    assert "scalar-vector-promotion" in kinds["scaled"] and "fine" not in kinds
    assert "scalar-vector-promotion" in kinds["via"]


# F2: pow with a base that may be negative
def test_pow_whole_literal_exponent_refused_and_fix_right(device):
    src = textwrap.dedent(
        """\
        [Differentiable] float cube(float x) { return pow(x, 3.0); }
        [Differentiable] float cube_fix(float x) { return x * x * x; }
        [Differentiable] float gamma(float x) { return pow(x, 2.2); }
        [Differentiable] float safe(float x) { return pow(abs(x), 3.0) + pow(2.0, x); }
        [Differentiable] float free_n(float x, float n) { return pow(x, n); }
        """
    )
    found = lint.scan_source(src, "<t>")
    by_fn = {f.function: f for f in found}
    assert by_fn["cube"].kind == "pow-negative-base" and by_fn["cube"].refuses_bwds
    assert "x * x * x" in by_fn["cube"].message
    assert by_fn["free_n"].kind == "pow-base-sign" and not by_fn["free_n"].refuses_bwds
    assert "gamma" not in by_fn and "safe" not in by_fn
    m = _load(device, "pw", src)
    xs = np.array([-2.0, -0.5, 0.5, 2.0])
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pytest.raises(pydiff.ShaderTrapError, match=r"<pw>:2: in cube\(\)"):
        m.cube.bwds(x, _result=1.0)
    with pytest.raises(pydiff.ShaderTrapError, match=r"cube\.fwds refused"):
        m.cube.fwds(x.with_tangent(np.ones(4)))
    m.cube_fix.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), 3 * xs**2, rtol=1e-6)
    _, jvp = m.cube_fix.fwds(x.with_tangent(np.ones(4)))
    np.testing.assert_allclose(jvp.numpy(), 3 * xs**2, rtol=1e-6)


def test_pow_variable_exponent_warns_at_load(device):
    with pytest.warns(pydiff.ShaderTrapWarning, match="pow"):
        pydiff.load_module_from_source(
            "pwn", "[Differentiable] float f(float x, float n) { return pow(x, n); }", device=device
        )


# F3: fmod's divisor derivative; float % as a clear compile error
def test_fmod_differentiable_divisor_refused_and_fix_right(device):
    src = textwrap.dedent(
        """\
        [Differentiable] float f(float a, float b) { return fmod(a, b); }
        [Differentiable] float g(float a, float b) { return a - b * no_diff(trunc(a / b)); }
        [Differentiable] float h(float a) { return fmod(a, 0.7); }
        """
    )
    by_fn = {f.function: f.kind for f in lint.scan_source(src, "<t>")}
    assert by_fn == {"f": "fmod-divisor"}
    m = _load(device, "fm", src)
    A = np.array([2.5, -2.5, 7.3, 0.7])
    B = np.array([0.7, 0.7, 2.0, 0.3])
    a = pydiff.tensor(A, device=device, requires_grad=True)
    b = pydiff.tensor(B, device=device, requires_grad=True)
    with pytest.raises(pydiff.ShaderTrapError, match=r"<fm>:2: in f\(\).*no_diff\(trunc"):
        m.f.bwds(a, b, _result=1.0)
    y = m.g(a, b, _result="numpy")
    np.testing.assert_allclose(y, np.fmod(A, B), rtol=1e-5, atol=1e-6)
    m.g.bwds(a, b, _result=1.0)
    np.testing.assert_allclose(a.grad.numpy(), np.ones(4))
    np.testing.assert_allclose(b.grad.numpy(), -np.trunc(A / B))


def test_float_remainder_bwds_is_a_compile_error_naming_the_line(device):
    m = pydiff.load_module_from_source(
        "frem", "\n[Differentiable] float g(float a, float b) { return a % b; }", device=device
    )
    a = pydiff.tensor(np.ones(3), device=device, requires_grad=True)
    b = pydiff.tensor(np.full(3, 0.7), device=device, requires_grad=True)
    with pytest.raises(pydiff.SlangCompileError, match=r"^<frem>:2: .*frem\.g") as info:
        m.g.bwds(a, b, _result=1.0)
    assert info.value.file == "<frem>" and info.value.line == 2
    assert "no_diff(trunc(a / b))" in str(info.value)
    assert not any(ch * 40 in str(info.value) for ch in "0123456789abcdef")


# F12: a [ForceUnroll] loop that cannot be unrolled
def test_force_unroll_failure_is_a_compile_error_naming_the_line(device):
    src = textwrap.dedent(
        """
        [Differentiable] float f(float a, float x) {
            float t = x;
            [ForceUnroll]
            while (t < 100.0) { t = 1.5 * t + a; }
            return t;
        }
        """
    )
    m = pydiff.load_module_from_source("fu", src, device=device)
    with pytest.raises(pydiff.SlangCompileError, match=r"^<fu>:5: ") as info:
        m.f(1.0, np.array([0.5, 1.0]), _result="numpy")
    assert info.value.line == 5 and "ForceUnroll" in str(info.value)
