"""Adversarial checks of issue 15's classes 7, 9, 10, 12, 13, 14, 16 and the coverage class,
written as a new user would trip over them. Each reference is independent of pydiff (closed
forms in float64 NumPy). Cases that fail today are strict xfails; crashes run in a subprocess.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import pydiff

ROOT = Path(__file__).parent.parent
_names = itertools.count()

X0 = np.array([0.5, 1.0, 2.0], np.float32)


def fresh_module(device, source: str, stem: str = "breaker15"):
    """A module under a name of its own: SlangPy's per-function kernel cache is not shared
    with any other test, so call order inside one test is all that matters."""
    return pydiff.load_module_from_source(f"{stem}_{next(_names)}", source, device=device)


def leaf(device, values=X0):
    return pydiff.tensor(np.array(values, np.float32), device=device, requires_grad=True)


def cli(*args: str, device=None, timeout=300):
    env = dict(os.environ)
    if device is not None:
        env["PYDIFF_DEVICE"] = device.type
    return subprocess.run(
        [sys.executable, "-m", "pydiff", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env=env,
    )


CHAIN = """
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float times(float a, float b) { return a * b; }
"""


@pytest.fixture(scope="module")
def chain(device):
    return pydiff.load_module_from_source("breaker15_chain", CHAIN, device=device)


# --------------------------------------------------------------------------------------
# class 7: a Function whose forward returns its input, a view of it, or one tensor twice


def test_function_identity_and_gradient_scaling_count_input_once(device, chain):
    class Scale(pydiff.Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            return x

        @staticmethod
        def backward(ctx, g):
            return g.numpy() * ctx.k

    x = leaf(device)
    with pydiff.Tape() as tape:
        y = Scale.apply(x, 0.5)
        z = chain.times(y, x, _result="tensor")  # x^2, one factor's gradient scaled by 0.5
    tape.backward(z, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 1.5 * X0.astype(np.float64), rtol=1e-6)
    np.testing.assert_array_equal(x.numpy(), X0)


def test_function_same_new_tensor_twice_and_input(device, chain):
    class TwoSame(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            y = chain.sq(x, _result="tensor")
            return y, y, x

        @staticmethod
        def backward(ctx, g1, g2, g3):
            (x,) = ctx.saved_tensors
            return 2 * x.numpy() * (g1.numpy() + g2.numpy()) + g3.numpy()

    x = leaf(device)
    with pydiff.Tape() as tape:
        a, b, c = TwoSame.apply(x)
        z = chain.times(chain.times(a, b, _result="tensor"), c, _result="tensor")  # x^5
    tape.backward(z, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 5 * X0.astype(np.float64) ** 4, rtol=1e-5)


def test_reshape_view_on_tape_keeps_gradient(device, chain):
    x = leaf(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pydiff.Tape() as tape:
            z = chain.times(x, x.reshape((3,)), _result="tensor")
        tape.backward(z, grad=np.ones(3))
    warned = any(issubclass(w.category, pydiff.GradientFlowWarning) for w in caught)
    # right, or at least said: a silently halved gradient is neither
    assert warned or np.allclose(x.grad.numpy(), 2 * X0, rtol=1e-6), x.grad.numpy()


def test_pattern1_function_returning_input_and_view(device, chain):
    class P1(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return x, chain.sq(x, _result="tensor"), x.reshape((3,))

    x = leaf(device)
    with pydiff.Tape() as tape:
        a, b, c = P1.apply(x)
        z = chain.times(chain.times(a, b, _result="tensor"), c, _result="tensor")  # x^4
    tape.backward(z, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 4 * X0.astype(np.float64) ** 3, rtol=1e-5)


def test_gradcheck_pattern1_identity(device):
    class Ident(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    assert pydiff.gradcheck(Ident, (leaf(device),))


# --------------------------------------------------------------------------------------
# class 16: Function.backward returning wrong things


@pytest.mark.parametrize(
    "bad, kind, words",
    [
        (lambda g: "abc", TypeError, ["MyFn.backward()", "str"]),
        (lambda g: {"x": g}, TypeError, ["MyFn.backward()", "dict"]),
        (lambda g: None, TypeError, ["MyFn.backward()", "(None,)"]),
        (lambda g: (g, g), RuntimeError, ["returned 2 gradients but expected 1"]),
        (lambda g: np.ones((3, 1)), RuntimeError, ["shape (3, 1)", "(3,)"]),
        (lambda g: np.array([1j, 1, 1]), TypeError, ["complex"]),
        (lambda g: (x for x in [g]), TypeError, ["generator"]),
        (lambda g: (1.0, 2.0, 3.0), RuntimeError, ["returned 3 gradients but expected 1"]),
    ],
)
def test_function_backward_wrong_returns_named(device, chain, bad, kind, words):
    class MyFn(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return chain.sq(x, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            return bad(g)

    x = leaf(device)
    with pydiff.Tape() as tape:
        y = MyFn.apply(x)
    with pytest.raises(kind) as info:
        tape.backward(y, grad=np.ones(3))
    for w in words:
        assert w in str(info.value)


def test_arity_error_says_which_overloads_are_builtin(device):
    m = fresh_module(device, "[Differentiable] float mad(float a, float b) { return a * b + 1.0; }")
    x = pydiff.tensor(np.ones(2, np.float32), device=device)
    with pytest.raises(TypeError) as info:
        m.mad(x, _result="numpy")
    msg = str(info.value)
    assert "built-in" in msg, msg
    lines = [ln for ln in msg.splitlines() if "ShaderFunction" in ln]
    assert len(lines) == len(set(lines)), msg


# --------------------------------------------------------------------------------------
# class 9: NaN / inf gradients fail gradcheck and `pydiff check`; strict JSON


@pytest.mark.parametrize(
    "bad",
    [
        lambda x, g: np.where(x > 1.5, np.nan, 2 * x * g),
        lambda x, g: np.where(x > 1.5, np.inf, 2 * x * g),
        lambda x, g: np.where(x > 1.5, -np.inf, 2 * x * g),
        lambda x, g: 2 * x,  # ignores the upstream gradient
        lambda x, g: 2 * x * g * g,
    ],
)
def test_gradcheck_fails_nonfinite_or_wrong_backward(device, chain, bad):
    class F(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return chain.sq(x, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return bad(x.numpy(), g.numpy())

    assert pydiff.gradcheck(F, (leaf(device),), raise_exception=False) is False


NONFINITE = """
[BackwardDerivative(bw_someinf)]
float someinf(float x) { return x * x; }
void bw_someinf(inout DifferentialPair<float> x, float d) {
    x = diffPair(x.p, x.p > 1.0 ? 1.0 / 0.0 : 2.0 * x.p * d); }
[BackwardDerivative(bw_vnan)]
float3 vnan(float3 x) { return x * 2.0; }
void bw_vnan(inout DifferentialPair<float3> x, float3 d) {
    x = diffPair(x.p, float3(2.0 * d.x, 0.0 / 0.0, 2.0 * d.z)); }
[Differentiable][ForwardDerivative(fwd_nan)]
float fnan(float x) { return x * x; }
DifferentialPair<float> fwd_nan(DifferentialPair<float> x)
    { return diffPair(x.p * x.p, 0.0 / 0.0); }
"""


def test_check_nonfinite_derivatives_fail_and_json_is_strict(device, tmp_path):
    src = tmp_path / "nonfinite.slang"
    src.write_text(NONFINITE)
    out = cli("check", str(src), "--json", device=device)
    assert out.returncode == 1, out.stdout + out.stderr

    def refuse(c):
        raise ValueError(f"bare {c} in JSON")

    report = json.loads(out.stdout, parse_constant=refuse)
    rows = {(r["function"], r["parameter"], r["mode"]): r for r in report["results"]}
    assert rows[("someinf", "x", "backward")]["status"] == "FAIL"
    assert rows[("someinf", "x", "backward")]["max_abs_error"] == "inf"
    assert rows[("vnan", "x", "backward")]["status"] == "FAIL"
    assert rows[("fnan", "(all)", "forward")]["status"] == "FAIL"
    assert rows[("fnan", "x", "backward")]["status"] == "PASS"


def test_check_forward_derivative_only_function(device, tmp_path):
    src = tmp_path / "fwd_only.slang"
    src.write_text(
        "[ForwardDerivative(fwd_ok)]\nfloat fok(float x) { return x * x; }\n"
        "DifferentialPair<float> fwd_ok(DifferentialPair<float> x) "
        "{ return diffPair(x.p * x.p, 2.0 * x.p * x.d); }\n"
    )
    out = cli("check", str(src), "--json", device=device)
    report = json.loads(out.stdout)
    statuses = {(r["mode"], r["status"]) for r in report["results"]}
    assert not any(s == "ERROR" for _, s in statuses), report
    assert ("forward", "PASS") in statuses, report


# --------------------------------------------------------------------------------------
# coverage: `pydiff check` on inout, struct, int parameters; gradcheck of in-place calls

COVERAGE = """
[Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
[Differentiable] void inout2(inout float a, inout float b)
    { float t = a; a = a * b; b = t + b * b; }
struct P : IDifferentiable { float a; float b; }
struct Q : IDifferentiable { P inner; float c; }
[Differentiable] float qs(Q q, float x) { return q.inner.a * x * q.c + sin(q.inner.b); }
[Differentiable] float threeints(int i, int j, uint k, float x)
    { return float(i - j * int(k)) * x * x; }
[BackwardDerivative(ints_bwd)]
float ints_wrong(int i, int j, float x) { return float(i) * x + float(j) * x * x; }
void ints_bwd(int i, int j, inout DifferentialPair<float> x, float d) {
    x = diffPair(x.p, (float(j) + 2.0 * float(i) * x.p) * d); }
[BackwardDerivative(si_bwd)]
void si_wrong(float s, inout float v) { v = v * s; }
void si_bwd(inout DifferentialPair<float> s, inout DifferentialPair<float> v) {
    float dv = v.d; s = diffPair(s.p, 2.0 * dv); v = diffPair(v.p, s.p * dv); }
"""


def test_check_inout_struct_int_functions(device, tmp_path):
    src = tmp_path / "coverage.slang"
    src.write_text(COVERAGE)
    out = cli("check", str(src), "--json", device=device)
    report = json.loads(out.stdout)
    rows = {(r["function"], r["parameter"], r["mode"]): r["status"] for r in report["results"]}
    for key in [
        ("scale_inout", "v", "backward"),
        ("scale_inout", "s", "backward"),
        ("inout2", "a", "backward"),
        ("inout2", "b", "backward"),
        ("qs", "q.inner.a", "backward"),
        ("qs", "q.c", "backward"),
        ("threeints", "x", "backward"),
        ("threeints", "(all)", "forward"),
    ]:
        assert rows[key] == "PASS", (key, rows)
    assert rows[("ints_wrong", "x", "backward")] == "FAIL"
    assert rows[("si_wrong", "(all)", "adjoint")] == "FAIL"
    assert out.returncode == 1


def test_custom_backward_of_inout_reading_primal_does_not_crash(device):
    code = textwrap.dedent(
        f"""
        import json, numpy as np, pydiff
        dev = pydiff.create_device({device.type!r})
        m = pydiff.load_module_from_source("seg_inout", '''
        [BackwardDerivative(bw)]
        void f(float s, inout float v) {{ v = v * s; }}
        void bw(inout DifferentialPair<float> s, inout DifferentialPair<float> v) {{
            float dv = v.d; s = diffPair(s.p, v.p * dv); v = diffPair(v.p, s.p * dv); }}
        ''', device=dev)
        s = pydiff.tensor(np.array([0.5, 1.5], np.float32), device=dev, requires_grad=True)
        v = pydiff.tensor(np.array([2.0, 3.0], np.float32), device=dev, requires_grad=True)
        m.f(s, v)
        v.grad.copy_from_numpy(np.ones(2, np.float32))
        try:
            m.f.bwds(s, v)
            print("GRADS" + json.dumps([s.grad.numpy().tolist(), v.grad.numpy().tolist()]))
        except Exception as exc:
            print("REFUSED", type(exc).__name__, exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"process died ({out.returncode}): {out.stderr[-800:]}"
    if "GRADS" in out.stdout:  # ds = v_before * dv, dv_before = s * dv
        grads = json.loads(out.stdout.split("GRADS", 1)[1].strip())
        assert np.allclose(grads, [[2.0, 3.0], [0.5, 1.5]]), out.stdout


def test_gradcheck_inplace_functions_no_false_alarm(device):
    m = fresh_module(
        device,
        """
        import slangpy;
        [Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
        [Differentiable] void inout2(inout float a, inout float b)
            { float t = a; a = a * b; b = t + b * b; }
        [Differentiable] void sq_rw(int i, IRWDiffTensor<float,1> data)
            { data[i] = data[i] * data[i]; }
        [Differentiable] float ret_and_inout(float s, inout float v)
            { float r = v * s; v = v + s; return r; }
        [Differentiable] void twice_inout(inout float v) { v = v * 1.5; v = v * v; }
        """,
    )
    v = leaf(device, [2.0, 3.0, 0.4])
    assert pydiff.gradcheck(m.scale_inout, (leaf(device, [0.5, 1.5, -0.7]), v))
    np.testing.assert_array_equal(v.numpy(), np.float32([2.0, 3.0, 0.4]))  # restored
    assert pydiff.gradcheck(m.scale_inout, (1.3, v))
    assert pydiff.gradcheck(
        m.inout2, (leaf(device, [0.5, 1.2, -0.3]), leaf(device, [0.7, -0.4, 1.1]))
    )
    idx = pydiff.tensor(np.arange(3, dtype=np.int32), device=device)
    assert pydiff.gradcheck(m.sq_rw, (idx, leaf(device, [0.5, 1.2, -0.3])))
    assert pydiff.gradcheck(
        m.ret_and_inout, (leaf(device, [0.5, 1.2, -0.3]), leaf(device, [0.7, -0.4, 1.1]))
    )
    assert pydiff.gradcheck(m.twice_inout, (leaf(device, [0.5, 1.2, -0.3]),))


def test_same_tensor_to_two_inout_parameters(device):
    m = fresh_module(
        device,
        """
        [Differentiable] void inout2(inout float a, inout float b)
            { float t = a; a = a * b; b = t + b * b; }
        [Differentiable] float times(float a, float b) { return a * b; }
        """,
    )
    a = leaf(device)
    x = X0.astype(np.float64)
    try:
        with pydiff.Tape() as tape:
            m.inout2(a, a)  # each thread writes a then b: the value left is x + x^2
            f = a.numpy().astype(np.float64)
            y = m.times(a, a, _result="tensor")
        tape.backward(y, grad=np.ones(3))
    except (ValueError, RuntimeError) as exc:  # a refusal naming both parameters is fine
        assert "'a'" in str(exc) and "'b'" in str(exc)
        return
    np.testing.assert_allclose(f, x + x * x, rtol=1e-6)
    np.testing.assert_allclose(a.grad.numpy(), 2 * f * (1 + 2 * x), rtol=1e-5)


def test_partial_irw_tensor_write_on_tape(device):
    m = fresh_module(
        device,
        """
        import slangpy;
        [Differentiable] void sq_rw(int i, IRWDiffTensor<float,1> data)
            { data[i] = data[i] * data[i]; }
        [Differentiable] float times(float a, float b) { return a * b; }
        """,
    )
    d = leaf(device)
    try:
        with pydiff.Tape() as tape:
            m.sq_rw(1, d)
            y = m.times(d, d, _result="tensor")
        tape.backward(y, grad=np.ones(3))
    except (ValueError, RuntimeError) as exc:
        assert "'data'" in str(exc)
        return
    x = X0.astype(np.float64)
    f = x.copy()
    f[1] = x[1] ** 2
    ref = 2 * f
    ref[1] *= 2 * x[1]
    np.testing.assert_allclose(d.grad.numpy(), ref, rtol=1e-5)


def test_gradcheck_same_tensor_twice_no_false_alarm(device, chain):
    x = leaf(device, [0.5, 1.0, -2.0])
    assert pydiff.gradcheck(chain.times, (x, x))


def test_check_half_parameter_no_false_alarm(device, tmp_path):
    src = tmp_path / "halfp.slang"
    src.write_text("[Differentiable] float withhalf(half h) { return float(h) * float(h); }\n")
    out = cli("check", str(src), "--json", device=device)
    report = json.loads(out.stdout)
    assert all(r["status"] in ("PASS", "SKIPPED") for r in report["results"]), report


def test_check_int_vector_parameter_forward_row(device, tmp_path):
    src = tmp_path / "int2p.slang"
    src.write_text(
        "[Differentiable] float withint2(int2 k, float x) { return float(k.x + k.y) * x; }\n"
    )
    out = cli("check", str(src), "--json", device=device)
    rows = {(r["parameter"], r["mode"]): r for r in json.loads(out.stdout)["results"]}
    fwd = rows[("(all)", "forward")]
    assert fwd["status"] == "PASS" or "struct" not in fwd["why"], fwd


# --------------------------------------------------------------------------------------
# class 10: tensors nested in structs; warnings where no gradient flows

DSTRUCT = """
struct DP : IDifferentiable { float a; float b; }
[Differentiable] float dps(DP p, float x) { return p.a * x + p.b * p.b; }
"""


def test_gradcheck_struct_list_dict_inputs(device):
    m = fresh_module(
        device,
        DSTRUCT
        + """
        struct DQ : IDifferentiable { DP inner; float c; }
        [Differentiable] float dqs(DQ q, float x)
            { return q.inner.a * x * q.c + q.inner.b * q.inner.b; }
        [BackwardDerivative(bw)]
        float wrongb(float a, float b) { return a * b; }
        void bw(inout DifferentialPair<float> a, inout DifferentialPair<float> b, float d) {
            a = diffPair(a.p, b.p * d); b = diffPair(b.p, b.p * d); }
        """,
    )
    a, b, c, x = (
        leaf(device, v) for v in ([0.5, 1.0, 2.0], [0.3, -1.0, 2.0], [0.7, 1.2, -0.4], X0)
    )
    assert pydiff.gradcheck(m.dqs, ({"inner": {"a": a, "b": b}, "c": c}, x))
    assert pydiff.gradcheck(m.dps, ({"a": a, "b": b}, x))
    with pytest.raises(pydiff.GradcheckError, match=r"input 0\['q'\]"):
        pydiff.gradcheck(lambda d: m.wrongb(d["p"], d["q"], _result="tensor"), ({"p": a, "q": b},))
    with pytest.raises(pydiff.GradcheckError, match=r"input 0\[1\]"):
        pydiff.gradcheck(lambda s: m.wrongb(s[0][1], s[1], _result="tensor"), ([(1.0, a), b],))


def test_struct_field_gradient_after_field_without_grads(device):
    m = fresh_module(device, DSTRUCT)
    a_plain = pydiff.tensor(X0, device=device)
    a, b, x = leaf(device), leaf(device, [0.3, -1.0, 2.0]), leaf(device)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    m.dps.bwds({"a": a_plain, "b": b}, x, _result=y)
    m.dps.bwds({"a": a, "b": b}, x, _result=y)
    np.testing.assert_allclose(a.grad.numpy(), X0, rtol=1e-6)  # d(a x)/da = x


def test_struct_field_without_grads_after_all_fields_with_grads(device):
    m = fresh_module(device, DSTRUCT)
    a, b, x = leaf(device), leaf(device, [0.3, -1.0, 2.0]), leaf(device)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    m.dps.bwds({"a": a, "b": b}, x, _result=y)
    b.zero_grad()
    m.dps.bwds({"a": pydiff.tensor(X0, device=device), "b": b}, x, _result=y)
    np.testing.assert_allclose(b.grad.numpy(), 2 * np.float32([0.3, -1.0, 2.0]), rtol=1e-6)


def test_tape_records_call_with_grads_only_in_struct_fields(device):
    m = fresh_module(device, DSTRUCT)
    a, b = leaf(device), leaf(device, [0.3, -1.0, 2.0])
    x = pydiff.tensor(X0, device=device)  # no gradient wanted
    with pydiff.Tape() as tape:
        y = m.dps({"a": a, "b": b}, x, _result="tensor")
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(a.grad.numpy(), X0, rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), 2 * np.float32([0.3, -1.0, 2.0]), rtol=1e-6)


def test_nested_non_differentiable_struct_warns_for_every_field(device):
    m = fresh_module(
        device,
        """
        struct P { float a; float b; }
        struct Q { P inner; float c; }
        [Differentiable] float qs(Q q, float x) { return q.inner.a * x * q.c + q.inner.b; }
        """,
    )
    a, b, c, x = leaf(device), leaf(device), leaf(device), leaf(device)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.qs.bwds({"inner": {"a": a, "b": b}, "c": c}, x, _result=y)
    text = " ".join(
        str(w.message) for w in caught if issubclass(w.category, pydiff.GradientFlowWarning)
    )
    assert "inner.a" in text and "inner.b" in text, text


def test_no_diff_and_non_differentiable_warn(device):
    m = fresh_module(
        device,
        """
        [Differentiable] float nd(no_diff float s, float x) { return s * x; }
        float plain_sq(float x) { return x * x; }
        [Differentiable] float times(float a, float b) { return a * b; }
        """,
    )
    s, x = leaf(device), leaf(device)
    with pytest.warns(pydiff.GradientFlowWarning, match="no_diff"):
        with pydiff.Tape() as tape:
            y = m.nd(s, x, _result="tensor")
        tape.backward(y, grad=np.ones(3))
    np.testing.assert_array_equal(s.grad.numpy(), 0)
    np.testing.assert_allclose(x.grad.numpy(), X0, rtol=1e-6)
    x2 = leaf(device)
    with pytest.warns(pydiff.GradientFlowWarning, match="plain_sq"):
        with pydiff.Tape() as tape:
            a = m.plain_sq(x2, _result="tensor")
            b = m.times(a, x2, _result="tensor")
        tape.backward(b, grad=np.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydiff.GradientFlowWarning)
        with pydiff.Tape() as tape:  # detached: no warning
            y = m.nd(s.detach(), x, _result="tensor")
        tape.backward(y, grad=np.ones(3))


def test_plain_inout_on_tape_gives_no_passthrough_gradient(device):
    m = fresh_module(
        device,
        """
        void plain_inout(inout float v) { v = v * v; }
        [Differentiable] float times(float a, float b) { return a * b; }
        """,
    )
    v, x = leaf(device), leaf(device)
    with pytest.warns(pydiff.GradientFlowWarning):
        with pydiff.Tape() as tape:
            m.plain_inout(v)
            z = m.times(v, x, _result="tensor")
        tape.backward(z, grad=np.ones(3))
    g = v.grad.numpy()
    true = 2 * X0.astype(np.float64) * X0  # d(v^2 x)/dv
    assert np.allclose(g, 0) or np.allclose(g, true, rtol=1e-5), g


# --------------------------------------------------------------------------------------
# class 12: host values for shader parameters


HOST = """
[Differentiable] float affine(float a, float x) { return a * x + 1.0; }
[Differentiable] float times_k(int k, float x) { return float(k) * x; }
[Differentiable] float3 v3(float3 a, float s) { return a * s; }
float bsel(bool b, float x) { return b ? x : -x; }
"""


@pytest.fixture(scope="module")
def host(device):
    return pydiff.load_module_from_source("breaker15_host", HOST, device=device)


def test_host_values_converted_exactly(device, host):
    a64 = np.array([0.1, 1 / 3, 1e-40, 2.5, -7.25], np.float64)
    ref = a64.astype(np.float32) * np.float32(2) + np.float32(1)
    np.testing.assert_array_equal(host.affine(a64, 2.0, _result="numpy"), ref)
    np.testing.assert_array_equal(host.affine(a64[::-2], 2.0, _result="numpy"), ref[::-2])
    A = np.arange(6.0).reshape(2, 3) / 3
    np.testing.assert_array_equal(host.v3(A.T.copy().T, 1.0, _result="numpy"), A.astype(np.float32))
    np.testing.assert_array_equal(
        host.v3(np.arange(12.0).reshape(2, 6)[:, ::2], 1.0, _result="numpy"),
        np.arange(12.0).reshape(2, 6)[:, ::2].astype(np.float32),
    )
    np.testing.assert_array_equal(
        host.times_k(np.array([1.0, -2.0]), 1.5, _result="numpy"), [1.5, -3.0]
    )
    assert host.times_k(3.0, 1.0) == 3.0
    assert host.affine(np.float64(1 / 3), 3.0) == np.float32(np.float32(1 / 3) * 3 + 1)
    x = leaf(device)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    host.affine.bwds(np.linspace(0, 1, 6)[::2], x, _result=y)  # dx = a
    np.testing.assert_array_equal(x.grad.numpy(), np.linspace(0, 1, 6)[::2].astype(np.float32))
    _, dy = host.affine.fwds(np.array([0.1, 1 / 3, 2.5]), x.with_tangent([1.0, 1.0, 1.0]))
    np.testing.assert_array_equal(dy.numpy(), np.float32([0.1, 1 / 3, 2.5]))


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda m: m.affine(np.array([1e39]), 1.0), ["'a'", "float64"]),
        (lambda m: m.times_k(np.array([1.0, 2.5]), 1.0), ["'k'", "2.5"]),
        (lambda m: m.times_k(np.array([2**31]), 1.0), ["'k'", "2147483648"]),
        (
            lambda m: m.times_k.bwds(np.array([1.0, 2.5, 3.0]), leaf(m.device), _result=1.0),
            ["'k'", "2.5"],
        ),
        (lambda m: m.affine(np.array([True, False]), 1.0), ["'a'", "bool"]),
    ],
)
def test_host_values_refused_naming_parameter(host, call, words):
    with pytest.raises((ValueError, TypeError)) as info:
        call(host)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_number_for_bool_parameter_refused_by_name(host):
    with pytest.raises((TypeError, ValueError)) as info:
        host.bsel(1, 1.0)
    assert "'b'" in str(info.value), str(info.value)


def test_python_bool_for_number_parameter_refused(host):
    with pytest.raises(TypeError, match="'a'"):
        host.affine(True, 1.0)


def test_numpy_result_of_all_number_call(host):
    r = host.affine(2.5, 1.0, _result="numpy")
    assert float(np.asarray(r)) == 3.5


def test_wrong_vector_width_names_parameter(host):
    with pytest.raises((ValueError, TypeError)) as info:
        host.v3(np.ones((2, 4)), 2.0, _result="numpy")
    assert "'a'" in str(info.value), str(info.value)


# --------------------------------------------------------------------------------------
# class 13: two devices


def test_ops_refuse_two_devices(device):
    from pydiff import ops

    other = pydiff.create_device(device.type, include_paths=[str(ROOT / "tests" / "shaders")])
    assert other is not device
    rng = np.random.default_rng(0)
    A = pydiff.tensor(rng.standard_normal((4, 4)).astype(np.float32), device=device)
    B = pydiff.tensor(rng.standard_normal((4, 4)).astype(np.float32), device=other)
    for name, call in [
        ("matmul", lambda: ops.matmul(A, B)),
        ("linear", lambda: ops.linear(A, B)),
        ("add", lambda: ops.add(A, B)),
        ("attention", lambda: ops.attention(A, A, B)),
    ]:
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert name in msg and str(device) in msg and str(other) in msg, msg


# --------------------------------------------------------------------------------------
# class 14: sizes


def test_too_large_tensor_and_broadcast_refused(device, chain):
    with pytest.raises(pydiff.TensorTooLargeError, match="17,179,869,184"):
        pydiff.empty((2**34,), device=device)
    a = pydiff.zeros((2**16, 1), device=device)
    b = pydiff.zeros((1, 2**16), device=device)
    with pytest.raises(pydiff.TensorTooLargeError, match="4,294,967,296"):
        chain.times(a, b, _result="tensor")


def test_broadcast_result_just_over_byte_limit(device, chain):
    a = pydiff.zeros((2**15, 1), device=device)
    b = pydiff.zeros((1, 2**15), device=device)
    with pytest.raises(pydiff.TensorTooLargeError) as info:
        chain.times(a, b, _result="tensor")
    msg = str(info.value)
    assert "4,294,967,296" in msg and "4,294,967,295" in msg and "createBuffer" not in msg, msg


def test_fractional_shape_refused(device):
    with pytest.raises((ValueError, TypeError)):
        pydiff.empty((2.5,), device=device)
