"""The generated-kernel path against SlangPy's path as an adversarial user drives it (s41,
genbreak): the same call on both paths (``run_both_paths``), each checked against float64
closed forms or central finite differences, and against the other bitwise.

Bugs found here (each test below failed before its fix):

- a tensor passed to several parameters (``m.f(x, x, x)``): its partials were added into
  the shared gradient buffer first parameter first, SlangPy's path adds them last parameter
  first (the backward of its loads runs in reverse): other bits, e.g. 1e-8 against 0;
- a user module's overload of ``asfloat(uint4)`` / ``select(bool4, float4, float4)`` was
  picked inside the generated kernels (they import the user's module): ``m.f(2.0, x)``
  gave 14 everywhere, its gradient 7;
- a mutable ``static`` variable (thread state) carried from one element to the next in the
  generated kernels (several elements per thread): 4, 7, 10, 13 where 4, 6, 8, 10 is right;
- a function using SlangPy's call id (``CallShapeInfo::get_call_id()``): the generated
  kernel's pipeline failed to link at dispatch, a raw RuntimeError out of ``m.f(2.0, x)``.

The compact differential cases at the end passed already; they stay as guards.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pydiff
from generated_paths import run_both_paths
from pydiff import generated_helpers
from pydiff.lint_statics import thread_state
from pydiff.module_session import RESERVED_NAMES

SOURCE = """
import slangpy;
[Differentiable] float f(float a, float x, float b) { return a * x * x + sin(x) * b; }
[Differentiable] float lin_f(float a, float x, float b) { return a * 1e-8 + x + b * -1.0; }
[Differentiable] float lin_h(float a, float x, float b) { return a + x * -1.0 + b * 1e-8; }
[Differentiable] float2 lin_v(float2 p, float2 q, float2 r)
{ return p * 1e-8 + q + r * -1.0; }
[Differentiable] float d3(float a, float b, float c, float x)
{ return c * x + a * x * x * x + b * sin(x); }
[Differentiable] float2 v(float2 p, float s) { return float2(p.x * p.y * s, sin(p.x) + s * s); }
[Differentiable] float w(float3 p, float4 q) { return dot(p, q.xyz) * q.w; }
"""


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s41_genbreak", SOURCE, device=device)


def _same(gen: list, ref: list) -> None:
    for u, v in zip(gen, ref):
        np.testing.assert_array_equal(u, v)
        assert np.array_equal(np.signbit(u), np.signbit(v))


# --------------------------------------------------------------------------------------------
# a tensor passed to several parameters: one gradient buffer, partials added in SlangPy's order


@pytest.mark.parametrize("name, want", [("lin_f", 1e-8), ("lin_h", 0.0)])
def test_shared_gradient_buffer_adds_in_slangpy_order(device, m, forced, name, want):
    # d/da, d/dx, d/db added into x.grad: ((0 + d_b) + d_x) + d_a on SlangPy's path
    fn = getattr(m, name)

    def run():
        x = pydiff.tensor(np.ones(8, np.float32), device=device, requires_grad=True)
        y = fn(x, x, x)
        fn.bwds(x, x, x, _result=y.with_grads(grad_in=pydiff.ones(8, device=device)))
        return [x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward"] == 1
    np.testing.assert_array_equal(ref[0], np.float32(want))  # SlangPy's bits
    _same(gen, ref)


def test_shared_vector_gradient_buffer_adds_in_slangpy_order(device, m, forced):
    def run():
        p = pydiff.tensor(np.ones((8, 2), np.float32), device=device, dtype="float2")
        p.requires_grad_()
        y = m.lin_v(p, p, p)
        up = pydiff.tensor(np.ones((8, 2), np.float32), device=device, dtype="float2")
        m.lin_v.bwds(p, p, p, _result=y.with_grads(grad_in=up))
        return [p.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward: vector"] == 1
    np.testing.assert_array_equal(ref[0], np.float32(1e-8))
    _same(gen, ref)


@pytest.mark.parametrize("pattern", ["aaax", "axax", "xaax"])
def test_shared_buffer_into_earlier_gradients_whatever_the_body(device, m, forced, pattern):
    # the order is the parameters' (reversed), not the body's: c's term comes first there
    rng = np.random.default_rng(7)
    n = 1029
    vals = {k: rng.uniform(-3, 3, n).astype(np.float32) for k in "ax"}
    before = rng.uniform(-50, 50, n).astype(np.float32)

    def run():
        ts = {k: pydiff.tensor(v, device=device, requires_grad=True) for k, v in vals.items()}
        for t in ts.values():
            t.grad.copy_from_numpy(before)
        args = [ts[c] for c in pattern]
        y = m.d3(*args)
        m.d3.bwds(*args, _result=y.with_grads(grad_in=pydiff.full((n,), 1.5, device=device)))
        return [ts["a"].grad.numpy(), ts["x"].grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["backward"] == 1
    _same(gen, ref)  # before: hundreds of elements an ulp apart
    a, b, c, x = (vals[k].astype(np.float64) for k in pattern)
    partial = {"a": x**3, "b": np.sin(x), "c": x, "x": c + 3 * a * x * x + b * np.cos(x)}
    want = {
        k: before + 1.5 * sum(partial[p] for p, q in zip("abcx", pattern) if q == k) for k in "ax"
    }
    np.testing.assert_allclose(gen[0], want["a"], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gen[1], want["x"], rtol=1e-5, atol=1e-4)


def test_shared_buffer_on_a_tape_and_accumulated(device, m, forced):
    xs = np.linspace(-1, 1, 300, dtype=np.float32)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = m.f(x, x, x)
        tape.backward(y, grad=np.ones(300, np.float32))
        first = x.grad.numpy()
        m.f.bwds(x, x, x, _result=y.with_grads(grad_in=pydiff.ones(300, device=device)))
        return [y.numpy(), first, x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    # Both backwards generated: tape.backward's fused with its held forward where the fused
    # path is on (generated_hold: counted as "forward+backward fused"), the .bwds plain.
    assert counts["backward"] + counts.get("forward+backward fused", 0) == 2, counts
    _same(gen, ref)
    x = xs.astype(np.float64)
    want = x * x + 2 * x * x + np.cos(x) * x + np.sin(x)
    np.testing.assert_allclose(gen[1], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gen[2], 2 * want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# the user's module's overloads of the core module's functions: the kernels' helpers not theirs

OVERLOADS = """
import slangpy;
float4 select(bool4 c, float4 a, float4 b) { return float4(7.0); }
float4 asfloat(uint4 u) { return float4(7.0); }
uint4 asuint(float4 v) { return uint4(0); }
float asfloat(uint u) { return 7.0; }
uint asuint(float v) { return 0; }
[Differentiable] float f(float a, float x) { return a * x; }
[Differentiable] float d3(float a, float b, float c, float x)
{ return c * x + a * x * x * x + b * sin(x); }
[Differentiable] float2 v(float2 p, float s) { return p * s; }
"""


def test_helper_module_names_are_reserved(device):
    assert set(generated_helpers.SOURCES) <= RESERVED_NAMES
    with pytest.raises(ValueError, match="shadow"):
        pydiff.load_module_from_source(
            "pydiff_gen_helpers", "float g(float x) { return x; }", device=device
        )


def test_user_overloads_of_core_functions_do_not_reach_the_kernels(device, forced):
    m = pydiff.load_module_from_source("s41_overloads", OVERLOADS, device=device)
    xs = np.arange(10, dtype=np.float32) - 3
    ps = np.stack([xs, 2 * xs], -1)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = m.f(2.0, x)
        m.f.bwds(2.0, x, _result=y.with_grads(grad_in=pydiff.ones(10, device=device)))
        t = pydiff.tensor(xs, device=device).with_tangent(np.ones(10, np.float32))
        _, dy = m.f.fwds(2.0, t)
        p = pydiff.tensor(ps, device=device, dtype="float2", requires_grad=True)
        w = m.v(p, 3.0)
        up = pydiff.tensor(np.ones((10, 2), np.float32), device=device, dtype="float2")
        m.v.bwds(p, 3.0, _result=w.with_grads(grad_in=up))
        return [y.numpy(), x.grad.numpy(), dy.numpy(), w.numpy(), p.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward"] == 2 and counts["backward"] == 2 and counts["fwds"] == 1
    np.testing.assert_array_equal(gen[0], 2 * xs)  # was 14 everywhere
    np.testing.assert_array_equal(gen[1], np.full(10, 2.0, np.float32))  # was 7
    np.testing.assert_array_equal(gen[2], np.full(10, 2.0, np.float32))
    np.testing.assert_array_equal(gen[3].reshape(10, 2), 3 * ps)
    np.testing.assert_array_equal(gen[4].reshape(10, 2), np.full((10, 2), 3.0, np.float32))
    _same(gen, ref)


# --------------------------------------------------------------------------------------------
# mutable static variables: a thread's state, which several elements per thread would carry

STATICS = """
import slangpy;
static float g_count = 3.0;
[Differentiable] float h(float a, float x) { g_count = g_count + 1.0; return a * x + g_count; }
[Differentiable] float2 hv(float2 p, float s) { g_count = g_count + 1.0; return p * s + g_count; }
"""


def test_mutable_statics_keep_slangpy_path(device, forced):
    m = pydiff.load_module_from_source("s41_statics", STATICS, device=device)
    xs = np.arange(10, dtype=np.float32)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = m.h(2.0, x)
        m.h.bwds(2.0, x, _result=y.with_grads(grad_in=pydiff.ones(10, device=device)))
        _, dy = m.h.fwds(
            2.0, pydiff.tensor(xs, device=device).with_tangent(np.ones(10, np.float32))
        )
        p = pydiff.tensor(np.stack([xs, xs], -1), device=device, dtype="float2")
        return [y.numpy(), x.grad.numpy(), dy.numpy(), m.hv(p, 2.0).numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    np.testing.assert_array_equal(gen[0], 2 * xs + 4)  # was 4, 7, 10, 13, ... (state carried)
    np.testing.assert_array_equal(gen[1], np.full(10, 2.0, np.float32))
    np.testing.assert_array_equal(gen[3].reshape(10, 2), np.stack([2 * xs + 4] * 2, -1))
    _same(gen, ref)
    assert counts.get("forward", 0) == 0 and counts.get("fwds", 0) == 0
    assert counts["declined: thread state in the module: 'g_count'"] >= 4


def test_mutable_statics_scan():
    src = """// static float commented;
static float helper(float x) { static float inner = 0; return x; }
struct S { static const int N = 3; static float count; static S make() { S s; return s; } };
const static float k = 1;
static vector<float, 3> v = float3(1, 2, 3);
static float arr[4] = {1, 2, 3, 4};
internal static let L = 2;
static T gen<T>(T x) { return x; }
"""
    assert thread_state(src) == ["inner", "count", "v", "arr"]
    assert thread_state("static const float K = 2.0;\nstatic float f(float x);") == []
    assert thread_state("float f() { return CallShapeInfo::get_call_id().shape[0]; }") == [
        "CallShapeInfo"
    ]
    assert thread_state("implementing slangpy;\nstatic int[4] call_id;") == []  # SlangPy's


CALL_ID = """
import slangpy;
[Differentiable] float f(float a, float x)
{ return a * x + float(CallShapeInfo::get_call_id().shape[0]); }
"""


def test_call_id_keeps_slangpy_path(device, forced):
    # before: the generated kernel's pipeline failed to link at dispatch ("unresolved
    # external symbol": SlangPy's call id is set by SlangPy's kernels only), a raw RuntimeError
    m = pydiff.load_module_from_source("s41_call_id", CALL_ID, device=device)

    def run():
        x = pydiff.tensor(np.ones(10, np.float32), device=device, requires_grad=True)
        y = m.f(2.0, x)
        m.f.bwds(2.0, x, _result=y.with_grads(grad_in=pydiff.ones(10, device=device)))
        return [y.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    np.testing.assert_array_equal(gen[0], 2 + np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(gen[1], np.full(10, 2.0, np.float32))
    _same(gen, ref)
    assert counts["declined: thread state in the module: 'CallShapeInfo'"] == 2


# --------------------------------------------------------------------------------------------
# compact differential cases (passed before): the same call on both paths, against float64

SIZES = [1, 2, 3, 5, 255, 256, 257, 1023, 1025, 4097]
KINDS = ("num", "full", "one", "zd")  # a number, the call's shape, (1,), ()
MODES = ("fwd", "fwd_result", "bwds", "tape", "fwds")
_FIXTURES = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _f64(a, x, b):
    return a * x * x + np.sin(x) * b


def _value(kind, n, rng):
    if kind == "num":
        return float(rng.uniform(-1, 1))
    return rng.uniform(-1, 1, {"full": (n,), "one": (1,), "zd": ()}[kind]).astype(np.float32)


def _f_call(device, m, n, kinds, mode, seed):
    """One call of ``f`` in ``mode``: what it gave, and the float64 values it should give."""
    rng = np.random.default_rng(seed)
    vals = [_value(k, n, rng) for k in kinds]
    up = rng.standard_normal(n).astype(np.float32)
    tans = [_value(k, n, rng) for k in kinds]
    v64 = [np.asarray(v, np.float64) for v in vals]
    args = [
        v if k == "num" else pydiff.tensor(v, device=device, requires_grad=mode in ("bwds", "tape"))
        for v, k in zip(vals, kinds)
    ]
    want = [np.broadcast_to(_f64(*v64), (n,))]
    if mode == "fwd":
        got = [m.f(*args).numpy()]
    elif mode == "fwd_result":
        y = pydiff.zeros((n,), device=device)
        m.f(*args, _result=y)
        got = [y.numpy()]
    elif mode == "fwds":
        pairs = [
            (a, t) if k == "num" else pydiff.tensor(v, device=device).with_tangent(t)
            for a, v, t, k in zip(args, vals, tans, kinds)
        ]
        y, dy = m.f.fwds(*pairs)
        got = [y.numpy(), dy.numpy()]
        a, x, b = v64
        ta, tx, tb = (np.asarray(t, np.float64) for t in tans)
        want.append(
            np.broadcast_to(ta * x * x + tx * (2 * a * x + np.cos(x) * b) + tb * np.sin(x), (n,))
        )
    else:
        if mode == "bwds":
            y = m.f(*args, _result="tensor")
            m.f.bwds(*args, _result=y.with_grads(grad_in=pydiff.tensor(up, device=device)))
        else:
            with pydiff.Tape() as tape:
                y = m.f(*args, _result="tensor")
            tape.backward(y, grad=up)
        got = [y.numpy()]
        a, x, b = v64
        u = up.astype(np.float64)
        partials = (u * x * x, u * (2 * a * x + np.cos(x) * b), u * np.sin(x))
        for t, k, g, v in zip(args, kinds, partials, vals):
            if k != "num":
                got.append(t.grad.numpy())
                g = np.broadcast_to(g, (n,))
                want.append(g if k == "full" else np.full(np.shape(v), g.sum()))
    return got, want


@settings(max_examples=14, **_FIXTURES)
@given(
    n=st.sampled_from(SIZES),
    kinds=st.tuples(*[st.sampled_from(KINDS)] * 3).filter(lambda k: "full" in k),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 1 << 16),
)
def test_float_calls_on_both_paths(device, m, forced, n, kinds, mode, seed):
    gen, ref, counts = run_both_paths(forced, lambda: _f_call(device, m, n, kinds, mode, seed))
    assert not any(k.endswith("_fallback") for k in counts), counts
    _same(gen[0], ref[0])
    scale = np.sqrt(n) * 4
    for got, want in zip(gen[0], gen[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


def _v_call(device, m, n, layout, s_kind, mode, seed):
    rng = np.random.default_rng(seed)
    ps = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    sv = _value(s_kind, n, rng)
    dtype = "float2" if layout == "vec" else "float"
    rg = mode != "fwd"
    p = pydiff.tensor(ps, device=device, dtype=dtype, requires_grad=rg)
    s = sv if s_kind == "num" else pydiff.tensor(sv, device=device, requires_grad=rg)
    p64, s64 = ps.astype(np.float64), np.broadcast_to(np.asarray(sv, np.float64), (n,))
    want = [np.stack([p64[:, 0] * p64[:, 1] * s64, np.sin(p64[:, 0]) + s64 * s64], -1)]
    if mode == "fwd":
        return [m.v(p, s).numpy().reshape(n, 2)], want
    up = rng.standard_normal((n, 2)).astype(np.float32)
    y = m.v(p, s)
    m.v.bwds(p, s, _result=y.with_grads(grad_in=pydiff.tensor(up, device=device, dtype="float2")))
    u = up.astype(np.float64)
    gp = np.stack(
        [u[:, 0] * p64[:, 1] * s64 + u[:, 1] * np.cos(p64[:, 0]), u[:, 0] * p64[:, 0] * s64], -1
    )
    gs = u[:, 0] * p64[:, 0] * p64[:, 1] + u[:, 1] * 2 * s64
    got = [y.numpy().reshape(n, 2), p.grad.numpy().reshape(n, 2)]
    want.append(gp)
    if s_kind != "num":
        got.append(s.grad.numpy())
        want.append(gs if s_kind == "full" else np.full(np.shape(sv), gs.sum()))
    return got, want


@settings(max_examples=10, **_FIXTURES)
@given(
    n=st.sampled_from(SIZES),
    layout=st.sampled_from(["vec", "flat"]),
    s_kind=st.sampled_from(KINDS),
    mode=st.sampled_from(["fwd", "bwds"]),
    seed=st.integers(0, 1 << 16),
)
def test_vector_calls_on_both_paths(device, m, forced, n, layout, s_kind, mode, seed):
    gen, ref, counts = run_both_paths(
        forced, lambda: _v_call(device, m, n, layout, s_kind, mode, seed)
    )
    assert counts.get("forward: vector") == 1, counts
    _same(gen[0], ref[0])
    for got, want in zip(gen[0], gen[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(n) * 4)
