"""Generic specialisations (``getattr(m, "f<2>")``) and namespaced functions (``"A::f"``)
against pydiff's per-function checks (gen36).

SlangPy names a specialisation's call ``f<2>`` and a namespaced one ``A::f``; the checks read
per function from the source keyed by the name as written (``f``, or ``A::f`` for no_diff).
Each case below went wrong before, silently or by crashing the process:

- a ``no_diff`` diff tensor parameter of ``f<2>`` got its gradient (``s.grad = M x^2``, no
  warning), and so did one of a generic with a ``where`` clause or a nested constraint
  (``f<T : IArray<float>>``), whose header the no_diff scan did not read;
- ``f<float>.bwds`` of a generic with a hand-written ``[BackwardDerivative]`` reading an
  inout's primal segfaulted (the direct wrapper was not used), and so did ``A::f.bwds``;
- deterministic mode did not warn about float atomics reached by ``f<3>`` or ``A::f``, nor
  in a generic with a ``where`` clause;
- a trap in a namespaced function (``A::f``, ``A::f<2>``) was never refused (ds = 0);
- ``2.0 * (s * v)``: the promotion inside parentheses was not seen (ds = 0), generic or not;
- a length-bounded loop past ``[MaxIters(n)]`` in a generic with a ``where`` clause, or in a
  namespaced function, gave wrong gradients silently.

Gradients are checked against closed forms. The generated kernels, ``.fwds``, ``jvp`` and
``hvp`` of specialisations were right already; they are kept here as guards.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import double_math, generated, lint, lint_atomics, lint_calls, lint_custom, loop_bounds
from pydiff.errors import GradientFlowWarning
from pydiff.lint_flow import promotions
from pydiff.lint_nodiff import no_diff_tensors
from pydiff.modcheck import check_module
from pydiff.lint_nodiff import generic_base, own_name


def _run_child(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    # a child process: a lost refusal or wrapper would segfault the test run
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_names():
    assert generic_base("A::f<vector<float, 3>>") == "A::f" and generic_base("f") == "f"
    assert generic_base("S<2>::f") == "S::f" and generic_base("S<vector<float, 2>>.f<1>") == "S::f"
    assert own_name("A::B::f<2>") == "f" and own_name("f<A::T>") == "f"
    traps = lint.TrapMap({"f": ["finding"]})
    assert traps.get("A::f<2>") == ["finding"] and traps.get("A::f") == ["finding"]
    assert traps.get("S<2>::f") == ["finding"] and traps.get("S<2>.f") == ["finding"]
    assert traps.get("A::g") is None and traps.get("g<2>", []) == []


# --------------------------------------------------------------------------------------------
# no_diff parameters

NO_DIFF = """import slangpy;
[Differentiable]
void gscaled<let M : int>(int idx, no_diff IDiffTensor<float, 1> s, IDiffTensor<float, 1> x,
                          IWDiffTensor<float, 1> y)
{ y[idx] = M * s[idx] * x[idx] * x[idx]; }
[Differentiable]
void gwhere<T>(int idx, no_diff IDiffTensor<float, 1> s, IDiffTensor<float, 1> x,
               IWDiffTensor<float, 1> y)
    where T : __BuiltinFloatingPointType
{ y[idx] = s[idx] * x[idx] * x[idx]; }
[Differentiable]
void gnested<T : IArray<float>>(int idx, no_diff IDiffTensor<float, 1> s,
                                IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ y[idx] = s[idx] * x[idx] * x[idx]; }
"""


STRUCT = """import slangpy;
struct S<let M : int> {
    [Differentiable]
    static void sc(int idx, no_diff IDiffTensor<float, 1> s, IDiffTensor<float, 1> x,
                   IWDiffTensor<float, 1> y)
    { y[idx] = M * s[idx] * x[idx] * x[idx]; }
    [Differentiable] static float3 pf(float s, float3 v) { return s * v; }
}
"""


@pytest.mark.parametrize("name", ["S<2>::sc", "S<2>.sc"])
@pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")
def test_a_no_diff_tensor_of_a_generic_struct_method(device, name):
    """Before: s.grad = 2 x^2, no warning (the method was looked up as 'S<2>::sc')."""
    m = pydiff.load_module_from_source("s36_gen36_struct", STRUCT, device=device)
    f = getattr(m, name)
    n = 8
    ss = np.linspace(1.0, 2.0, n, dtype=np.float32)
    xs = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    s = pydiff.tensor(ss, device=device, requires_grad=True)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device)
    with pytest.warns(GradientFlowWarning, match="'s' is no_diff"):
        f(spy.grid((n,)), s, x, y)
        f.bwds(spy.grid((n,)), s, x, y.with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), 4.0 * ss * xs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(s.grad.numpy(), 0.0)


@pytest.mark.parametrize("name", ["S<2>::pf", "S<2>.pf"])
@pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")
def test_a_trap_in_a_generic_struct_method_is_refused(device, name):
    """Before: ran, ds = 0 (closed form: 3 per element)."""
    m = pydiff.load_module_from_source("s36_gen36_struct", STRUCT, device=device)
    f = getattr(m, name)
    s = pydiff.tensor(np.array([0.5, 2.0], np.float32), device=device, requires_grad=True)
    v = pydiff.tensor(np.ones((2, 3), np.float32), device=device, requires_grad=True)
    y = f(s, v, _result="tensor")
    with pytest.raises(pydiff.ShaderTrapError, match="promoted"):
        f.bwds(s, v, _result=y.with_grads(ones=True))


def test_no_diff_scan_reads_where_clauses_and_nested_generics():
    assert no_diff_tensors(NO_DIFF) == {"gscaled": {"s"}, "gwhere": {"s"}, "gnested": {"s"}}


@pytest.mark.parametrize(
    "name, m_value",
    [("gscaled<2>", 2), ("gscaled<3>", 3), ("gwhere<float>", 1), ("gnested<float[2]>", 1)],
)
@pytest.mark.parametrize("taped", [False, True])
def test_a_no_diff_tensor_of_a_specialisation_gets_no_gradient(device, name, m_value, taped):
    """Before: s.grad = M x^2 (the loads added into its buffer), no warning."""
    m = pydiff.load_module_from_source("s36_gen36_nodiff", NO_DIFF, device=device)
    f = getattr(m, name)
    n = 16
    ss = np.linspace(1.0, 2.0, n, dtype=np.float32)
    xs = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    s = pydiff.tensor(ss, device=device, requires_grad=True)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device)
    with pytest.warns(GradientFlowWarning, match="'s' is no_diff"):
        if taped:
            with pydiff.Tape() as tape:
                f(spy.grid((n,)), s, x, y)
            tape.backward(y, grad=pydiff.tensor(np.ones(n, np.float32), device=device))
        else:
            f(spy.grid((n,)), s, x, y)
            f.bwds(spy.grid((n,)), s, x, y.with_grads(ones=True))
    np.testing.assert_allclose(y.numpy(), m_value * ss * xs * xs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * m_value * ss * xs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(s.grad.numpy(), 0.0)


# --------------------------------------------------------------------------------------------
# hand-written backward reading an inout's primal

CUSTOM = """
void gsc_bwd<T : __BuiltinFloatingPointType>(inout DifferentialPair<T> s,
    inout DifferentialPair<T> y)
{
    T yv = y.p; T g = reinterpret<T>(y.d);  // reads the inout's primal
    s = diffPair(s.p, reinterpret<T.Differential>(g * yv * yv));
    y = diffPair(yv, reinterpret<T.Differential>(g * T(2.0) * yv * s.p));
}
[BackwardDerivative(gsc_bwd)]
void gsc<T : __BuiltinFloatingPointType>(T s, inout T y) { y = y * y * s; }
namespace ns {
void sc_bwd(inout DifferentialPair<float> s, inout DifferentialPair<float> y)
{
    float yv = y.p; float g = y.d;
    s = diffPair(s.p, g * yv * yv);
    y = diffPair(yv, g * 2.0 * yv * s.p);
}
[BackwardDerivative(sc_bwd)]
void sc(float s, inout float y) { y = y * y * s; }
}
"""


@pytest.mark.parametrize("name", ["gsc<float>", "ns::sc", "gsc"])
def test_custom_backward_reading_an_inout_primal_of_a_specialisation(device, name, tmp_path):
    """Before: gsc<float>.bwds and ns::sc.bwds segfaulted (rc -11): the plain inout wrapper
    was used, as the hand-written backward was looked up by the name 'gsc<float>'/'ns::sc'."""
    path = tmp_path / "cb.slang"
    path.write_text(CUSTOM)
    done = _run_child(
        f"""
        import json, warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        dev = pydiff.create_device({device.type!r})
        m = pydiff.load_module({str(path)!r}, device=dev)
        f = getattr(m, {name!r})
        s = pydiff.tensor(np.array([0.5, 0.2, -0.4], np.float32), device=dev, requires_grad=True)
        y = pydiff.tensor(np.array([0.3, -1.1, 1.7], np.float32), device=dev, requires_grad=True)
        f(s, y)
        y.grad.copy_from_numpy(np.ones(3, np.float32))
        f.bwds(s, y)
        print("GRADS" + json.dumps([s.grad.numpy().tolist(), y.grad.numpy().tolist()]))
        """
    )
    assert done.returncode == 0, f"process died ({done.returncode}): {done.stderr[-1500:]}"
    s0, y0 = np.array([0.5, 0.2, -0.4]), np.array([0.3, -1.1, 1.7])
    grads = np.array(eval(done.stdout.split("GRADS", 1)[1].strip()))  # noqa: S307 (our json)
    np.testing.assert_allclose(grads[0], y0 * y0, rtol=1e-5, atol=1e-6)  # ds = y^2
    np.testing.assert_allclose(grads[1], 2 * y0 * s0, rtol=1e-5, atol=1e-6)  # dy = 2 y s


# --------------------------------------------------------------------------------------------
# deterministic mode

ATOMICS = """
void splat_bwd(inout DifferentialPair<float> x, RWStructuredBuffer<float> total, float d)
{ InterlockedAdd(total[0], d); x = diffPair(x.p, d); }
[Differentiable][BackwardDerivative(splat_bwd)]
float splat(float x, RWStructuredBuffer<float> total) { return x; }
[Differentiable]
float guses<let M : int>(float x, RWStructuredBuffer<float> total) { return M * splat(x, total); }
[Differentiable]
float gwhere<T>(float x, RWStructuredBuffer<float> total, T k) where T : __BuiltinFloatingPointType
{ return 3.0 * splat(x, total); }
namespace ns {
[Differentiable]
float uses(float x, RWStructuredBuffer<float> total) { return 3.0 * splat(x, total); }
}
"""


def test_float_atomics_scan_reads_where_clauses():
    assert set(lint_atomics.float_atomic_functions(ATOMICS)) == {
        "splat_bwd",
        "splat",
        "guses",
        "gwhere",
        "uses",
    }


@pytest.mark.parametrize("name", ["guses<3>", "ns::uses", "gwhere<float>"])
def test_deterministic_mode_warns_for_specialisations_and_namespaces(device, name):
    """Before: no NondeterminismWarning (the scan's findings were looked up by 'guses<3>',
    'ns::uses'; 'gwhere' was not found at all)."""
    m = pydiff.load_module_from_source("s36_gen36_atomics", ATOMICS, device=device)
    f = getattr(m, name)
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    total = spy.Tensor.zeros(device.native, (1,), "float").storage
    args = (x, total, 0.5) if name.startswith("gwhere") else (x, total)
    y = pydiff.empty((2,), device=device).with_grads(ones=True)
    with pydiff.deterministic():
        with pytest.warns(pydiff.NondeterminismWarning, match=r"InterlockedAdd' in splat_bwd"):
            f.bwds(*args, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 3.0])


# --------------------------------------------------------------------------------------------
# traps of namespaced functions; promotion inside parentheses

PROMOTE = """import slangpy;
namespace ns {
[Differentiable] float3 pf(float s, float3 v) { return s * v; }
[Differentiable] float3 gpf<let M : int>(float s, float3 v) { return M * (s * v); }
[Differentiable] float3 ok(float s, float3 v) { return float3(s) * v; }
}
[Differentiable] float3 paren(float s, float3 v) { return 2.0 * (s * v); }
[Differentiable] float3 gparen<let M : int>(float s, float3 v) { return M * (float3(s) * v); }
"""


def test_the_promotion_inside_parentheses_is_found():
    params = ["float s", "float3 v", "float t"]
    assert [m[1][:8] for m in promotions(params, "{ return 2.0 * (s * v); }")] == ["'s * v':"]
    assert promotions(params, "{ return (s) * v; }")
    for right in ("(s + t) * v", "g(t, s) * v", "(2.0 * s) * v", "(-s * v)", "(t * s * v)"):
        assert promotions(params, f"{{ return {right}; }}") == [], right


@pytest.mark.parametrize("name", ["ns::pf", "ns::gpf<2>", "paren"])
@pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")
def test_promotion_traps_are_refused(device, name):
    """Before: each ran and gave ds = 0 (closed form: 3 M per element, M = 1 or 2)."""
    m = pydiff.load_module_from_source("s36_gen36_promote", PROMOTE, device=device)
    f = getattr(m, name)
    s = pydiff.tensor(np.array([0.5, 2.0], np.float32), device=device, requires_grad=True)
    v = pydiff.tensor(np.ones((2, 3), np.float32), device=device, requires_grad=True)
    y = f(s, v, _result="tensor")
    with pytest.raises(pydiff.ShaderTrapError, match="promoted"):
        f.bwds(s, v, _result=y.with_grads(ones=True))


@pytest.mark.parametrize("name, m_value", [("ns::ok", 1), ("gparen<2>", 2)])
@pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")
def test_the_rewrites_are_right(device, name, m_value):
    m = pydiff.load_module_from_source("s36_gen36_promote", PROMOTE, device=device)
    f = getattr(m, name)
    vs = np.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]], np.float32)
    s = pydiff.tensor(np.array([0.5, 2.0], np.float32), device=device, requires_grad=True)
    v = pydiff.tensor(vs, device=device, requires_grad=True)
    y = f(s, v, _result="tensor")
    f.bwds(s, v, _result=y.with_grads(ones=True))
    np.testing.assert_allclose(s.grad.numpy(), m_value * vs.sum(axis=1), rtol=1e-6)
    np.testing.assert_allclose(v.grad.numpy(), m_value * np.array([[0.5] * 3, [2.0] * 3]))


# --------------------------------------------------------------------------------------------
# length-bounded loops

LOOPS = """import slangpy;
[Differentiable]
float lw<T>(float a, DiffTensor<float, 1> x, T k) where T : __BuiltinFloatingPointType
{
    float acc = 0.0;
    int n = x.shape[0];
    [MaxIters(8)]
    for (int i = 0; i < n; i++) acc += a * x[i] * x[i];
    return acc;
}
namespace ns {
[Differentiable]
float lb(float a, DiffTensor<float, 1> x)
{
    float acc = 0.0;
    [MaxIters(8)]
    for (int i = 0; i < x.shape[0]; i++) acc += a * x[i] * x[i];
    return acc;
}
}
"""


def test_loop_scan_reads_where_clauses():
    assert set(loop_bounds.scan(LOOPS)) == {"lw", "lb"}


@pytest.mark.parametrize("name", ["lw<float>", "ns::lb"])
def test_length_bounded_loop_is_checked(device, name):
    """Before: at 12 inputs x.grad came out with its last 4 entries wrong (Slang kept 8
    iterations), silently."""
    m = pydiff.load_module_from_source("s36_gen36_loops", LOOPS, device=device)
    f = getattr(m, name)
    a = np.linspace(0.5, 2.0, 4)
    for k, refused in [(8, False), (12, True)]:
        xs = np.linspace(-1.0, 1.0, k)
        at = pydiff.tensor(a.astype(np.float32), device=device)
        x = pydiff.tensor(xs.astype(np.float32), device=device, requires_grad=True)
        args = (at, x, 1.0) if name.startswith("lw") else (at, x)
        y = f(*args, _result="tensor")
        np.testing.assert_allclose(y.numpy(), a * np.sum(xs * xs), rtol=1e-5)
        if refused:
            with pytest.raises(ValueError, match=r"runs 12 times.*MaxIters\(8\)"):
                f.bwds(*args, _result=y.with_grads(ones=True))
        else:
            f.bwds(*args, _result=y.with_grads(ones=True))
            np.testing.assert_allclose(x.grad.numpy(), 2 * a.sum() * xs, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# guards: generated kernels, .fwds, jvp and hvp of specialisations (right before too)

GUARDS = """import slangpy;
[Differentiable] float gq<let M : int>(float x, float y) { return M * x * x * y; }
[Differentiable] T gt<T : __BuiltinFloatingPointType>(T x, T y) { return x * x * y; }
[Differentiable] float3 gv<let M : int>(float3 x, float y) { return M * x * x * y; }
[Differentiable] void gg<let M : int>(int2 id, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y)
{ y[id] = M * x[id] * x[id]; }
"""


pytestmark_guards = pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")  # gg's int2


@pytest.fixture
def _all_generated(monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    generated.reset_stats()


@pytest.mark.parametrize("name, m_value", [("gq<2>", 2), ("gq<3>", 3), ("gt<float>", 1)])
@pytestmark_guards
def test_generated_scalar_kernels_of_specialisations(device, _all_generated, name, m_value):
    m = pydiff.load_module_from_source("s36_gen36_guards", GUARDS, device=device)
    f = getattr(m, name)
    rng = np.random.default_rng(1)
    xs, ys = (rng.uniform(-2, 2, 64).astype(np.float32) for _ in range(2))
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.tensor(ys, device=device, requires_grad=True)
    out = f(x, y, _result="tensor")
    f.bwds(x, y, _result=out.with_grads(ones=True))
    _, dv = f.fwds(pydiff.tensor(xs, device=device).with_tangent(np.ones(64, np.float32)), y)
    np.testing.assert_allclose(out.numpy(), m_value * xs * xs * ys, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), 2 * m_value * xs * ys, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.grad.numpy(), m_value * xs * xs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv.numpy(), 2 * m_value * xs * ys, rtol=1e-5, atol=1e-5)
    if device.type == "vulkan":
        stats = generated.stats()
        assert stats.get("forward") and stats.get("backward") and stats.get("fwds"), stats


@pytestmark_guards
def test_generated_vector_and_grid_kernels_of_specialisations(device, _all_generated):
    m = pydiff.load_module_from_source("s36_gen36_guards", GUARDS, device=device)
    rng = np.random.default_rng(2)
    X = rng.uniform(-2, 2, (64, 3)).astype(np.float32)
    ys = rng.uniform(-2, 2, 64).astype(np.float32)
    x = pydiff.tensor(X, device=device, requires_grad=True)
    y = pydiff.tensor(ys, device=device, requires_grad=True)
    gv = getattr(m, "gv<5>")
    out = gv(x, y, _result="tensor")
    gv.bwds(x, y, _result=out.with_grads(ones=True))
    np.testing.assert_allclose(out.numpy().reshape(64, 3), 5 * X * X * ys[:, None], rtol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), 10 * X * ys[:, None], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.grad.numpy(), 5 * (X * X).sum(1), rtol=1e-4, atol=1e-4)
    G = rng.uniform(-2, 2, (8, 8)).astype(np.float32)
    g = pydiff.tensor(G, device=device, requires_grad=True)
    out = pydiff.zeros((8, 8), device=device)
    with pydiff.Tape() as tape:
        getattr(m, "gg<3>")(spy.grid((8, 8)), g, out)
    tape.backward(out, grad=pydiff.tensor(np.ones((8, 8), np.float32), device=device))
    np.testing.assert_allclose(out.numpy(), 3 * G * G, rtol=1e-6)
    np.testing.assert_allclose(g.grad.numpy(), 6 * G, rtol=1e-6)


@pytestmark_guards
def test_jvp_and_hvp_of_specialisations(device):
    m = pydiff.load_module_from_source("s36_gen36_guards", GUARDS, device=device)
    f = getattr(m, "gq<2>")
    xs = np.array([-1.5, 0.5, 2.0], np.float32)
    ys = np.array([0.7, -1.2, 0.3], np.float32)
    ux, uy = np.array([1, 0.5, -1], np.float32), np.array([0.3, 1, 2], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        primals = (pydiff.tensor(xs, device=device), pydiff.tensor(ys, device=device))
        u = (pydiff.tensor(ux, device=device), pydiff.tensor(uy, device=device))
        _, tan = pydiff.jvp(lambda a, b: f(a, b, _result="tensor"), primals, u)
        h = pydiff.hvp(lambda a, b: pydiff.ops.sum(f(a, b, _result="tensor")), primals, u)
    np.testing.assert_allclose(tan.numpy(), 2 * (2 * xs * ys * ux + xs * xs * uy), rtol=1e-5)
    np.testing.assert_allclose(h[0].numpy(), 2 * (2 * ys * ux + 2 * xs * uy), rtol=1e-5)
    np.testing.assert_allclose(h[1].numpy(), 2 * 2 * xs * ux, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# `where` clauses in the scans of hand-written backwards and non-differentiable helpers

WHERE = """
void gsw_bwd<T>(inout DifferentialPair<T> s, inout DifferentialPair<T> y)
    where T : __BuiltinFloatingPointType
{
    T yv = y.p; T g = reinterpret<T>(y.d);
    s = diffPair(s.p, reinterpret<T.Differential>(g * yv * yv));
    y = diffPair(yv, reinterpret<T.Differential>(g * T(2.0) * yv * s.p));
}
[BackwardDerivative(gsw_bwd)]
void gsw<T>(T s, inout T y) where T : __BuiltinFloatingPointType { y = y * y * s; }
[Differentiable]
float callsw(float s, float y0) { float y = y0; gsw<float>(s, y); return y; }

void stp<T>(inout T t, T a) where T : __BuiltinFloatingPointType { t = t * a; }
[Differentiable]
float callstp(float a, float x) { float t = x; stp<float>(t, a); return t; }
[Differentiable]
void dstp<T>(inout T t, T a) where T : __BuiltinFloatingPointType { t = t * a; }
[Differentiable]
float calldstp(float a, float x) { float t = x; dstp<float>(t, a); return t; }
"""


def test_where_clauses_in_the_custom_and_helper_scans():
    assert lint_custom.inout_primal_reads(WHERE) == {"gsw": "y"}
    found = lint_custom.scan_source(WHERE, "w")  # (s44: gsw has no forward derivative)
    assert [(f.function, f.kind) for f in found if f.kind == "custom-bwd-no-forward"] == [
        ("gsw", "custom-bwd-no-forward")
    ]
    assert [(f.function, f.kind) for f in found if f.kind != "custom-bwd-no-forward"] == [
        ("callsw", "custom-bwd-inout-primal")
    ]
    writers = lint_calls.non_differentiable_writers(WHERE)
    assert list(writers) == ["stp"]
    found = lint_calls.scan_source(WHERE, "w", writers)
    assert [(f.function, f.kind) for f in found] == [("callstp", "non-differentiable-helper")]


@pytest.mark.parametrize(
    "name, outcome",
    [("callsw", "REFUSED"), ("callstp", "REFUSED"), ("calldstp", "GRADS"), ("gsw<float>", "GRADS")],
)
def test_where_generics_are_refused_or_right(device, name, outcome, tmp_path):
    """Before: callsw.bwds and gsw<float>.bwds segfaulted (rc -11); callstp gave
    da = 0, dx = 1 (closed form: da = x, dx = a), silently."""
    path = tmp_path / "w.slang"
    path.write_text(WHERE)
    done = _run_child(
        f"""
        import json, warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        dev = pydiff.create_device({device.type!r})
        m = pydiff.load_module({str(path)!r}, device=dev)
        f = getattr(m, {name!r})
        a = pydiff.tensor(np.array([0.5, 2.0], np.float32), device=dev, requires_grad=True)
        x = pydiff.tensor(np.array([1.5, -1.0], np.float32), device=dev, requires_grad=True)
        try:
            if {name!r} == "gsw<float>":
                f(a, x)
                x.grad.copy_from_numpy(np.ones(2, np.float32))
                f.bwds(a, x)
            else:
                y = f(a, x, _result="tensor")
                f.bwds(a, x, _result=y.with_grads(ones=True))
            print("GRADS" + json.dumps([a.grad.numpy().tolist(), x.grad.numpy().tolist()]))
        except pydiff.ShaderTrapError as e:
            print("REFUSED", e)
        """
    )
    assert done.returncode == 0, f"process died ({done.returncode}): {done.stderr[-1500:]}"
    assert outcome in done.stdout, done.stdout[-1500:]
    if outcome == "GRADS":
        a0, x0 = np.array([0.5, 2.0]), np.array([1.5, -1.0])
        grads = np.array(eval(done.stdout.split("GRADS", 1)[1].strip()))  # noqa: S307
        if name == "gsw<float>":  # y = x^2 a (x is the inout): da = x^2, dx = 2 x a
            want = [x0 * x0, 2 * x0 * a0]
        else:  # t = x a: da = x, dx = a
            want = [x0, a0]
        np.testing.assert_allclose(grads, want, rtol=1e-5, atol=1e-6)
    else:
        assert "w.slang:" in done.stdout


UNSET = """
void u_bwd<T>(inout DifferentialPair<T> a, inout DifferentialPair<T> b, T.Differential d)
    where T : __BuiltinFloatingPointType
{ a = diffPair(a.p, d); }
[BackwardDerivative(u_bwd)]
T u<T>(T a, T b) where T : __BuiltinFloatingPointType { return a + b; }
"""


@pytest.mark.parametrize("name", ["u<float>", "u"])
@pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")
def test_unset_derivative_of_a_where_generic_is_refused(device, name):
    """Before: b.grad came out NaN (u_bwd never sets it), no error."""
    found = lint_custom.scan_source(UNSET, "u")
    found = [f for f in found if f.kind != "custom-bwd-no-forward"]  # (s44: forward mode's)
    assert [(f.function, f.kind) for f in found] == [("u", "custom-bwd-unset-derivative")]
    m = pydiff.load_module_from_source("s36_gen36_unset", UNSET, device=device)
    f = getattr(m, name)
    a = pydiff.tensor(np.array([1.0, 2.0], np.float32), device=device, requires_grad=True)
    b = pydiff.tensor(np.array([1.0, 2.0], np.float32), device=device, requires_grad=True)
    y = f(a, b, _result="tensor")
    with pytest.raises(pydiff.ShaderTrapError, match="never sets the derivative of 'b'"):
        f.bwds(a, b, _result=y.with_grads(ones=True))


CHECKED = """
[Differentiable] float plain(float x) { return x * x; }
[Differentiable] float gm<let M : int>(float x) { return M * x; }
[Differentiable] float gnest<T : IArray<float>>(T x) { return x[0] * x[0]; }
"""


def test_pydiff_check_names_every_generic_it_skips(device, tmp_path):
    """Before: gnest (a constraint with generic arguments) was left out of the report, as if
    the file had no such function."""
    path = tmp_path / "checked.slang"
    path.write_text(CHECKED)
    rows = {(r.function, r.status) for r in check_module(path, device=device, points=2)}
    assert {("gm", "SKIPPED"), ("gnest", "SKIPPED")} <= rows
    assert ("plain", "PASS") in rows


DUPLICATE = CUSTOM + "[Differentiable] void sc(float s, inout float y) { y = y * s; }\n"


@pytest.mark.parametrize("name", ["ns::sc", "sc"])
def test_an_inout_primal_backward_behind_a_duplicated_name_is_refused(device, name, tmp_path):
    """Before: ns::sc.bwds segfaulted when a global sc was defined beside it (the name
    defined twice, pydiff could not tell which had the backward and used the plain wrapper).
    Now both are refused (the global one too: pydiff cannot tell them apart)."""
    path = tmp_path / "dup.slang"
    path.write_text(DUPLICATE)
    done = _run_child(
        f"""
        import warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        dev = pydiff.create_device({device.type!r})
        m = pydiff.load_module({str(path)!r}, device=dev)
        f = getattr(m, {name!r})
        s = pydiff.tensor(np.array([0.5, 0.2], np.float32), device=dev, requires_grad=True)
        y = pydiff.tensor(np.array([0.3, -1.1], np.float32), device=dev, requires_grad=True)
        f(s, y)
        y.grad.copy_from_numpy(np.ones(2, np.float32))
        try:
            f.bwds(s, y)
            print("RAN")
        except TypeError as e:
            print("REFUSED", e)
        """
    )
    assert done.returncode == 0, f"process died ({done.returncode}): {done.stderr[-1500:]}"
    assert "REFUSED" in done.stdout and "defined more than once" in done.stdout, done.stdout


DOUBLES = """
[Differentiable] T tsin<T : __BuiltinFloatingPointType>(T x) { return sin(x) * T(2.0); }
[Differentiable] double gcall(double x) { return tsin<double>(x); }
[Differentiable] float fcall(float x) { return tsin<float>(x); }
[Differentiable]
vector<T, N> vsin<T : __BuiltinFloatingPointType, let N : int>(vector<T, N> x) { return sin(x); }
"""


@pytest.mark.parametrize(
    "name, dtype, scale",
    [
        ("tsin<double>", "double", 2.0),
        ("vsin<double, 2>", "double2", 1.0),
        ("gcall", "double", 2.0),
        ("tsin<float>", "float", 2.0),
        ("fcall", "float", 2.0),
    ],
)
@pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")
def test_a_generic_specialised_to_double_is_checked_for_the_device(device, name, dtype, scale):
    """Before, on lavapipe: tsin<double>, and gcall calling it, gave 8.5e-315 where 2 sin(x)
    is right, silently (the
    double scan saw only 'sin(x)' of a 'T x'); now refused where the device computes the
    intrinsic wrong on doubles, and right (against NumPy) where it does not."""
    m = pydiff.load_module_from_source("s36_gen36_doubles", DOUBLES, device=device)
    f = getattr(m, name)
    xs = np.array([[0.3, 1.2]]) if dtype.endswith("2") else np.array([0.3, 1.2])
    x = pydiff.tensor(xs, dtype=dtype, device=device)
    if dtype.startswith("double") and "sin" in double_math.broken_intrinsics(device):
        with pytest.raises(pydiff.ShaderTrapError, match=r"sin\(\) of a double"):
            f(x, _result="tensor")
    else:
        y = f(x, _result="tensor")
        np.testing.assert_allclose(y.numpy().ravel(), scale * np.sin(xs).ravel(), rtol=1e-6)
