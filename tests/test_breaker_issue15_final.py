"""Issue 15, final breaker pass: a new user's shaders and inputs against independent references.

Every gradient is compared with a closed form or a float64 central finite difference in NumPy.
Cases that fail today are `xfail(strict=True)`; cases that could take the process down run in
a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff

SRC = """
import slangpy;
import pydiff;

[Differentiable] void cub_io(float a, inout float v) { v = a * v * v * v; }
[Differentiable] void rw_sq(int i, IRWDiffTensor<float, 1> t, float k) { t[i] = k * t[i] * t[i]; }
[Differentiable] float quad(float x) { return x * x * 0.5 + x; }
[Differentiable] float wx(float w, float x) { return w * x; }
[Differentiable] float3 wx3(float3 w, float3 x) { return w * x; }
[Differentiable] half wxh(half w, half x) { return w * x; }
[Differentiable] float gid(int2 id, float w, float x) { return w * x; }
[Differentiable] float cubic(float x, float k) { return k * x * x * x; }
[Differentiable] half hsq(half x) { return x * x * half(3.0); }
[Differentiable] float tk(int k, float x) { return float(k) * x; }
[Differentiable] float arrsum(float a[3]) { return a[0] + 2.0 * a[1] + 3.0 * a[2]; }
[Differentiable] float times(float a, float b) { return a * b; }
[Differentiable] void sc_io(float s, inout float v) { v = v * s + v * v; }

[Differentiable] T quart<T : __BuiltinFloatingPointType>(T x) { return x * x * x * x - x; }
[Differentiable] T mix2<T : __BuiltinFloatingPointType>(T a, T b)
{ return a * exp(b) + sin(a * b); }
[Differentiable] vector<T, N> vcube<T : __BuiltinFloatingPointType, let N : int>(vector<T, N> v)
{ return v * v * v; }
[Differentiable] T icube<T : IFloat>(T x) { return x * x * x; }
[Differentiable] void gout<T : __BuiltinFloatingPointType>(T x, out T y) { y = x * x * x; }
[Differentiable] void ginout<T : __BuiltinFloatingPointType>(T s, inout T y) { y = y * y * s; }

struct P : IDifferentiable { float a; float b; };
struct Q { float a; float b; };
struct N : IDifferentiable { P inner; float c; };
[Differentiable] float sp(P p, float x) { return p.a * x + p.b * x * x; }
[Differentiable] float sq(Q q, float x) { return q.a * x + q.b * x * x; }
[Differentiable] float sn(N n, float x) { return n.inner.a * x + n.inner.b * n.c; }

struct S : IDifferentiable
{ float v; [Differentiable] [mutating] void step(float a) { v = 1.5 * v + a; } };
[Differentiable] float loop_method(float a)
{ S s; s.v = a; [MaxIters(100)] while (s.v < 100.0) { s.step(a); if (s.v > 5.0) break; }
  return s.v; }
[Differentiable] float loop_return(float a)
{ float t = a; [MaxIters(100)] while (t < 100.0) { t = 1.5 * t + a; if (t > 5.0) return t; }
  return t; }
[Differentiable] float loop_break(float a)
{ float t = a; [MaxIters(100)] while (t < 100.0) { t = 1.5 * t + a; if (t > 5.0) break; }
  return t; }

// break loop inside a generic, called with explicit type arguments
[Differentiable] T gbreak<T : __BuiltinFloatingPointType>(T a)
{ T t = a; [MaxIters(100)] while (t < T(100.0)) { t = T(1.5) * t + a; if (t > T(5.0)) break; }
  return t; }
[Differentiable] float call_gbreak(float a) { return gbreak<float>(a); }

// non-differentiable helpers that write a differentiable value through out/inout
void step_nd(inout float t, float a) { t = 1.5 * t + a; }
void make_nd(out float t, float a) { t = 2.5 * a; }
struct R : IDifferentiable { float v; [mutating] void step(float a) { v = 1.5 * v + a; } };
[Differentiable] float use_inout_nd(float a) { float t = a; step_nd(t, a); return t; }
[Differentiable] float use_out_nd(float a) { float t; make_nd(t, a); return t; }
[Differentiable] float use_method_nd(float a) { R r; r.v = a; r.step(a); return r.v; }

// identities Slang folds away before the scalar->vector promotion
[Differentiable] float3 pr_mul1(float s, float3 v) { return s * 1.0 * v; }
[Differentiable] float3 pr_add0(float s, float3 v) { return (s + 0.0) * v; }
[Differentiable] float3 pr_plus(float s, float3 v) { return (+s) * v; }
[Differentiable] float3 pr_vadd(float s, float3 v) { return v + (s * 1.0); }
[Differentiable] float3 pr_ok(float s, float3 v) { return sin(s) * v; }
"""

X0 = np.array([0.3, -1.1, 1.7], np.float32)
U = np.array([1.0, -2.0, 0.5], np.float32)


def f64(a):
    return np.asarray(a, np.float64)


def close(got, exp, rtol=1e-5, atol=1e-6):
    got, exp = f64(got), f64(exp)
    assert got.shape == exp.shape, (got.shape, exp.shape)
    np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol, equal_nan=True)


def central(f, x, h=1e-6):
    return (f(x + h) - f(x - h)) / (2 * h)


@pytest.fixture(scope="module")
def m(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pydiff.load_module_from_source("breaker15final", SRC, device=device)


def T(data, device, **kw):
    return pydiff.tensor(data, device=device, **kw)


# --- class 1: explicit .bwds after an in-place call -----------------------------------------


def test_inout_bwds_after_call_uses_value_read(m, device):
    a0 = np.array([0.5, 1.5, -2.0], np.float32)
    v0 = np.array([1.1, -0.7, 0.3], np.float32)
    a, v = T(a0, device, requires_grad=True), T(v0, device, requires_grad=True)
    m.cub_io(a, v)
    close(v.numpy(), f64(a0) * f64(v0) ** 3, rtol=1e-6)
    v.grad.copy_from_numpy(U)
    m.cub_io.bwds(a, v)
    close(a.grad.numpy(), U * f64(v0) ** 3)
    close(v.grad.numpy(), U * 3 * f64(a0) * f64(v0) ** 2)


def test_inout_called_twice_bwds_at_second_read(m, device):
    a0 = np.array([0.5, 1.5, -2.0], np.float32)
    a = T(a0, device, requires_grad=True)
    v = T(np.array([1.1, -0.7, 0.3], np.float32), device, requires_grad=True)
    m.cub_io(a, v)
    v1 = f64(v.numpy())
    m.cub_io(a, v)
    v.grad.copy_from_numpy(U)
    m.cub_io.bwds(a, v)
    close(a.grad.numpy(), U * v1**3, rtol=1e-5)
    close(v.grad.numpy(), U * 3 * f64(a0) * v1**2, rtol=1e-5)


def test_inout_broadcast_parameter_after_call(m, device):
    v0 = np.array([1.1, -0.7, 0.3], np.float32)
    a, v = (
        T(np.array([0.5], np.float32), device, requires_grad=True),
        T(v0, device, requires_grad=True),
    )
    m.cub_io(a, v)
    v.grad.copy_from_numpy(U)
    m.cub_io.bwds(a, v)
    close(a.grad.numpy(), [np.sum(U * f64(v0) ** 3)])
    close(v.grad.numpy(), U * 1.5 * f64(v0) ** 2)


def test_inout_without_grad_buffers_at_call_is_refused(m, device):
    a = T(np.array([0.5, 1.5, -2.0], np.float32), device, requires_grad=True)
    v = T(np.array([1.1, -0.7, 0.3], np.float32), device)
    m.cub_io(a, v)
    v.requires_grad_()
    v.grad.copy_from_numpy(U)
    with pytest.raises(ValueError, match="'v'"):
        m.cub_io.bwds(a, v)


def test_irw_tensor_bwds_after_call(m, device):
    t0 = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
    t = T(t0, device, requires_grad=True)
    m.rw_sq(spy.grid((4,)), t, 1.5)
    t.grad.copy_from_numpy(np.array([1.0, 2.0, -1.0, 0.5], np.float32))
    m.rw_sq.bwds(spy.grid((4,)), t, 1.5)
    close(t.grad.numpy(), np.array([1.0, 2.0, -1.0, 0.5]) * 3.0 * f64(t0))


def test_result_into_own_input_then_bwds_with_other_result(m, device):
    x0 = np.array([0.5, -1.5, 2.0], np.float32)
    x = T(x0, device, requires_grad=True)
    m.quad(x, _result=x)
    y = pydiff.empty((3,), device=device).with_grads()
    y.grad.copy_from_numpy(U)
    m.quad.bwds(x, _result=y)
    close(x.grad.numpy(), U * (f64(x0) + 1))


# --- class 2: inf / NaN in broadcast sums -----------------------------------------------------

CONTRIBS = {
    "inf": [1, np.inf, 2, 3],
    "inf_and_minus_inf": [1, np.inf, -np.inf, 3],
    "nan": [1, np.nan, 2, 3],
    "cancelling_overflow": [3e38, 3e38, -3e38, -3e38],
    "finite_sum_overflows": [3e38, 3e38, 1, 1],
    "minus_inf": [-np.inf, -np.inf, 5, 5],
}


@pytest.mark.parametrize("det", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("key", list(CONTRIBS))
def test_broadcast_sum_is_ieee(m, device, key, det):
    x0 = np.array(CONTRIBS[key], np.float32)
    w = T(np.array([2.0], np.float32), device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if det:
            with pydiff.deterministic():
                m.wx.bwds(w, T(x0, device), _result=1.0)
        else:
            m.wx.bwds(w, T(x0, device), _result=1.0)
        exp = np.float32(np.sum(f64(x0)))
    close(w.grad.numpy(), [exp])


def test_broadcast_float3_and_grid_with_infinities(m, device):
    X = np.array([[1, np.inf, 2], [3, -np.inf, np.nan], [1, 1, 1]], np.float32)
    w = T(np.ones((1, 3), np.float32), device, dtype="float3", requires_grad=True)
    up = pydiff.empty((3,), dtype="float3", device=device).with_grads(ones=True)
    m.wx3.bwds(w, T(X, device, dtype="float3"), _result=up)
    close(w.grad.numpy(), [[5.0, np.nan, np.nan]])
    g = T(np.ones((1,), np.float32), device, requires_grad=True)
    m.gid.bwds(
        spy.grid((2, 2)), g, T(np.array([[1, np.inf], [2, 3]], np.float32), device), _result=1.0
    )
    close(g.grad.numpy(), [np.inf])


def test_broadcast_half_rounds_once(m, device):
    X = np.array([60000, 60000, -60000, -60000, 1], np.float16)
    w = T(np.ones((1,), np.float16), device, dtype="half", requires_grad=True)
    m.wxh.bwds(w, T(X, device, dtype="half"), _result=1.0)
    close(w.grad.numpy(), [1.0])


# --- class 3: generic functions ---------------------------------------------------------------


def test_generic_direct_and_broadcast(m, device):
    x = T(X0, device, requires_grad=True)
    m.quart.bwds(x, _result=1.0)
    close(x.grad.numpy(), 4 * f64(X0) ** 3 - 1, rtol=1e-5)
    b0 = np.array([0.5, 0.2, -0.4], np.float32)
    a = T(X0[:1], device, requires_grad=True)
    b = T(b0, device, requires_grad=True)
    m.mix2.bwds(a, b, _result=1.0)
    A, B = f64(X0[0]), f64(b0)
    close(a.grad.numpy(), [np.sum(np.exp(B) + np.cos(A * B) * B)], rtol=1e-5)
    close(b.grad.numpy(), A * np.exp(B) + np.cos(A * B) * A, rtol=1e-5)


def test_generic_vector_ifloat_out(m, device):
    V = np.array([[0.3, -1, 2], [1, 1, 0.5]], np.float32)
    v = T(V, device, dtype="float3", requires_grad=True)
    m.vcube.bwds(v, _result=pydiff.empty((2,), dtype="float3", device=device).with_grads(ones=True))
    close(v.grad.numpy(), 3 * f64(V) ** 2)
    x = T(X0, device, requires_grad=True)
    m.icube.bwds(x, _result=1.0)
    close(x.grad.numpy(), 3 * f64(X0) ** 2)
    x = T(X0, device, requires_grad=True)
    y = pydiff.zeros((3,), device=device).with_grads()
    y.grad.copy_from_numpy(U)
    m.gout.bwds(x, y)
    close(x.grad.numpy(), U * 3 * f64(X0) ** 2)


def test_generic_on_tape(m, device):
    x = T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.quart(x, _result="tensor")
        z = m.mix2(y, x, _result="tensor")
    tape.backward(z, grad=U)
    X = f64(X0)
    Y = X**4 - X
    dz = (np.exp(X) + np.cos(Y * X) * X) * (4 * X**3 - 1) + Y * np.exp(X) + np.cos(Y * X) * Y
    close(x.grad.numpy(), U * dz, rtol=1e-5)


def test_generic_inout_bwds(m, device):
    s0 = np.array([0.5, 0.2, -0.4], np.float32)
    s, y = T(s0, device, requires_grad=True), T(X0, device, requires_grad=True)
    m.ginout(s, y)
    y.grad.copy_from_numpy(U)
    m.ginout.bwds(s, y)
    close(s.grad.numpy(), U * f64(X0) ** 2)
    close(y.grad.numpy(), U * 2 * f64(X0) * f64(s0))


# --- class 4: loops with break / return ---------------------------------------------------------


def _ref_break(a):
    t = a
    for _ in range(100):
        if not t < 100:
            break
        t = 1.5 * t + a
        if t > 5:
            break
    return t


PTS = np.array([1.0, 2.2, 3.0, 0.3], np.float32)


def test_loop_break_refused(m, device):
    with pytest.raises(pydiff.ShaderTrapError, match="break"):
        m.loop_break.bwds(T(PTS, device, requires_grad=True), _result=1.0)


@pytest.mark.parametrize("fn", ["loop_method", "loop_return"])
def test_loop_variants_right(m, device, fn):
    a = T(PTS, device, requires_grad=True)
    getattr(m, fn).bwds(a, _result=1.0)
    close(a.grad.numpy(), [central(_ref_break, float(p)) for p in PTS], rtol=1e-4)


def test_loop_break_in_generic_called_with_type_arguments(m, device):
    a = T(PTS, device, requires_grad=True)
    try:
        m.call_gbreak.bwds(a, _result=1.0)
    except pydiff.ShaderTrapError:
        return  # refused: fine
    close(a.grad.numpy(), [central(_ref_break, float(p)) for p in PTS], rtol=1e-4)


# --- class 5 / 15 / 17: _result ---------------------------------------------------------------


def test_result_checks(m, device):
    x = T(X0, device)
    with pytest.raises(ValueError, match="_result"):
        m.cubic(x, 2.0, _result=pydiff.empty((1,), device=device))
    with pytest.raises(TypeError, match="_result"):
        m.cubic(x, 2.0, _result=pydiff.zeros((3,), dtype="int", device=device))
    with pytest.raises(TypeError, match="_result"):
        m.cubic(x, 2.0, _result=np.zeros(3, np.int32))
    r = pydiff.zeros((2, 3), device=device)
    m.cubic(x, 2.0, _result=r)  # larger result: every element written once
    close(r.numpy(), np.tile(2 * f64(X0) ** 3, (2, 1)), rtol=1e-6)


def test_positional_result_and_seeds(m, device):
    x = T(X0, device, requires_grad=True)
    m.cubic.bwds(x, 2.0, pydiff.empty((3,), device=device).with_grads(ones=True))
    close(x.grad.numpy(), 6 * f64(X0) ** 2)
    x = T(X0, device, requires_grad=True)
    m.cubic.bwds(x, 2.0, 0.5)
    close(x.grad.numpy(), 3 * f64(X0) ** 2)
    with pytest.raises(TypeError, match="twice"):
        y = pydiff.empty((3,), device=device).with_grads(ones=True)
        m.cubic.bwds(x, 2.0, y, _result=y)


def test_half_number_seed(m, device):
    xh = X0.astype(np.float16)
    x = T(xh, device, dtype="half", requires_grad=True)
    m.hsq.bwds(x, _result=1.0)
    close(x.grad.numpy(), 6 * f64(xh), rtol=2e-3)


# --- class 6: tape ------------------------------------------------------------------------------


def test_tape_result_into_own_input_refused(m, device):
    x = T(X0, device, requires_grad=True)
    with pytest.raises(ValueError, match="_result"):
        with pydiff.Tape():
            y = m.quad(x, _result="tensor")
            m.quad(y, _result=y)


def test_tape_inout_twice_vs_fd(m, device):
    x0 = np.array([0.5, -1.2, 2.0], np.float32)
    x = T(x0, device, requires_grad=True)
    s = T(np.array([1.5], np.float32), device, requires_grad=True)
    with pydiff.Tape() as tape:
        v = m.times(x, 1.0, _result="tensor")
        m.sc_io(s, v)
        m.sc_io(s, v)
    tape.backward(v, grad=np.ones(3))

    def f(x, s):
        v = x * s + x * x
        return v * s + v * v

    X = f64(x0)
    close(x.grad.numpy(), central(lambda t: f(t, 1.5), X), rtol=1e-4)
    close(s.grad.numpy(), [np.sum(central(lambda t: f(X, t), 1.5))], rtol=1e-4)


def test_tape_host_write_detected(m, device):
    x = T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.quad(x, _result="tensor")
    x.reshape((3, 1)).copy_from_numpy(np.ones((3, 1), np.float32))
    with pytest.raises(RuntimeError, match="overwritten"):
        tape.backward(y, grad=np.ones(3))


@pytest.mark.xfail(
    strict=True,
    reason="documented limit (docs/tape.md, overwrite detection): a write through "
    "Tensor.native, SlangPy's own tensor, bypasses pydiff and its version counter",
)
def test_tape_native_write_detected(m, device):
    x = T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.quad(x, _result="tensor")
    x.native.copy_from_numpy(np.full(3, 3.0, np.float32))
    try:
        tape.backward(y, grad=np.ones(3))
    except RuntimeError:
        return
    close(x.grad.numpy(), f64(X0) + 1)


# --- class 7 / 16: Functions --------------------------------------------------------------------


class _Scale(pydiff.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x

    @staticmethod
    def backward(ctx, g):
        return g.numpy() * ctx.k


class _Ident(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        return x


def test_function_identity_outputs(m, device):
    x = T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = _Scale.apply(_Scale.apply(x, 0.5), 4.0)
        z = m.times(y, x, _result="tensor")
    tape.backward(z, grad=np.ones(3))
    close(x.grad.numpy(), 2.0 * f64(X0) + f64(X0))
    x = T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = _Ident.apply(_Ident.apply(x))
        z = m.times(y, y, _result="tensor")
    tape.backward(z, grad=np.ones(3))
    close(x.grad.numpy(), 2 * f64(X0))
    assert (
        pydiff.gradcheck(
            lambda t: _Scale.apply(t, 0.5),
            (T(X0, device, requires_grad=True),),
            raise_exception=False,
        )
        is False
    )


def test_function_backward_returning_string(m, device):
    class Bad(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return m.quad(x, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            return "oops"

    x = T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = Bad.apply(x)
    with pytest.raises(TypeError, match="Bad.backward"):
        tape.backward(y, grad=np.ones(3))


# --- class 8: threads ---------------------------------------------------------------------------


def test_threads_broadcast_gradients_independent(m, device):
    errors = []

    def work(tid):
        rng = np.random.default_rng(tid)
        try:
            for _ in range(5):
                b0 = (rng.standard_normal(129) * (tid + 1)).astype(np.float32)
                w = T(np.array([0.5], np.float32), device, requires_grad=True)
                m.wx.bwds(w, T(b0, device), _result=1.0)
                if not np.isclose(w.grad.numpy()[0], np.sum(f64(b0)), rtol=1e-5, atol=1e-5):
                    errors.append((tid, w.grad.numpy()[0], np.sum(f64(b0))))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append((tid, repr(exc)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# --- class 9: gradcheck / pydiff check with NaN -------------------------------------------------

NAN_SRC = """
[BackwardDerivative(nb_bwd)] float nb(float x) { return x * 2.0; }
void nb_bwd(inout DifferentialPair<float> x, float d)
{ x = diffPair(x.p, x.p > 1.0 ? d * sqrt(-1.0 - x.p) : d * 2.0); }
"""


def test_gradcheck_and_check_refuse_nan(device, tmp_path):
    m = pydiff.load_module_from_source("breaker15nan", NAN_SRC, device=device)
    x = T(np.array([0.5, 1.5, -0.3], np.float32), device, requires_grad=True)
    assert pydiff.gradcheck(m.nb, (x,), raise_exception=False) is False
    path = tmp_path / "nan.slang"
    path.write_text(NAN_SRC)
    cli = [sys.executable, "-m", "pydiff", "check", "--json", "--device", device.type, str(path)]
    p = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-500:]

    def bare(c):
        raise ValueError(f"bare {c} in JSON")

    out = json.loads(p.stdout, parse_constant=bare)
    assert any(r["status"].startswith("FAIL") for r in out["results"] if r["mode"] == "backward")


# --- class 10: gradients that cannot flow --------------------------------------------------------


def test_struct_gradients_and_warning(m, device):
    X = f64(X0)
    a = T(np.ones(1, np.float32), device, requires_grad=True)
    b = T(np.full(3, 2.0, np.float32), device, requires_grad=True)
    m.sp.bwds({"a": a, "b": b}, T(X0, device), _result=1.0)
    close(a.grad.numpy(), [X.sum()])
    close(b.grad.numpy(), X**2)
    a, b, c = (T(np.full(3, v, np.float32), device, requires_grad=True) for v in (1.0, 2.0, 3.0))
    assert pydiff.gradcheck(m.sn, ({"inner": {"a": a, "b": b}, "c": c}, T(X0, device)))
    qa = T(np.ones(3, np.float32), device, requires_grad=True)
    with pytest.warns(pydiff.GradientFlowWarning, match="q.a"):
        m.sq.bwds({"a": qa, "b": T(np.ones(3, np.float32), device)}, T(X0, device), _result=1.0)


@pytest.mark.parametrize("fn", ["use_inout_nd", "use_out_nd", "use_method_nd"])
def test_non_differentiable_out_inout_helper(m, device, fn):
    a = T(PTS, device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydiff.GradientFlowWarning)
        try:
            getattr(m, fn).bwds(a, _result=1.0)
        except (pydiff.ShaderTrapError, pydiff.GradientFlowWarning):
            return  # refused or warned: fine
    close(a.grad.numpy(), np.full(4, 2.5))


def _promotion_ds(m, device, fn):
    V0 = np.array([[1.0, -2.0, 0.5], [0.3, 0.3, 3.0]], np.float32)
    s0 = np.array([1.5, -0.5], np.float32)
    s = T(s0, device, requires_grad=True)
    v = T(V0, device, dtype="float3", requires_grad=True)
    up = pydiff.empty((2,), dtype="float3", device=device).with_grads(ones=True)
    getattr(m, fn).bwds(s, v, _result=up)
    h = 1e-2

    def F(S):
        return f64(
            getattr(m, fn)(
                T(S.astype(np.float32), device), T(V0, device, dtype="float3"), _result="numpy"
            )
        )

    fd = [
        ((F(s0 + h * np.eye(2)[i]) - F(s0 - h * np.eye(2)[i])) / (2 * h))[i].sum() for i in range(2)
    ]
    close(s.grad.numpy(), fd, rtol=1e-2, atol=1e-3)


def test_promotion_computed_scalar_right(m, device):
    _promotion_ds(m, device, "pr_ok")


@pytest.mark.parametrize("fn", ["pr_mul1", "pr_add0", "pr_plus", "pr_vadd"])
def test_promotion_after_identity_folding(m, device, fn):
    try:
        _promotion_ds(m, device, fn)
    except pydiff.ShaderTrapError:
        return  # refused: fine


# --- class 11: the process dies -----------------------------------------------------------------

CRASH_G = (
    "[Differentiable] T g<T : __BuiltinFloatingPointType>(T a) { T y = a; int k = 0; "
    "[MaxIters(20)] while (y < T(10.0) && k < 10) { y = y * T(1.5) + T(0.1); k++; } return y; }\n"
    "[Differentiable] float f(float a) { return g<float>(a) * 2.0; }\n"
)
CRASH_SPLICE_AND = (
    "[Differentiable] float f(float a) { float y = a; int k = 0; [MaxIters(20)] "
    "while (y < 10.0 &\\\n& k < 10) { y = y * 1.5 + 0.1; k++; } return y; }\n"
)
CRASH_SPLICE_WHILE = (
    "[Differentiable] float f(float a) { float y = a; int k = 0; [MaxIters(20)] "
    "whi\\\nle (y < 10.0 && k < 10) { y = y * 1.5 + 0.1; k++; } return y; }\n"
)
CRASH_OK = (
    "[Differentiable] float f(float a) { float y = a; int k = 0; [MaxIters(20)] "
    "while (y < 10.0 && k < 10) { y = y * 1.5 + 0.1; k++; } return y; }\n"
)


def _bwds_in_subprocess(device, src):
    code = textwrap.dedent(
        f"""
        import warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        dev = pydiff.create_device({device.type!r})
        m = pydiff.load_module_from_source("crash", {src!r}, device=dev)
        a = pydiff.tensor(np.array([0.5, 1.3], np.float32), device=dev, requires_grad=True)
        try:
            m.f.bwds(a, _result=1.0)
            print("GRAD", a.grad.numpy().tolist())
        except pydiff.ShaderTrapError as exc:
            print("REFUSED", str(exc).splitlines()[1])
        """
    )
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env
    )


def _check_survived(p):
    assert p.returncode == 0, f"process died (rc {p.returncode}): {p.stderr[-400:]}"
    assert "REFUSED" in p.stdout, p.stdout


def test_crash_while_and_refused_in_subprocess(device):
    _check_survived(_bwds_in_subprocess(device, CRASH_OK))


def test_crash_generic_explicit_type_arguments(device):
    _check_survived(_bwds_in_subprocess(device, CRASH_G))


@pytest.mark.parametrize("src", [CRASH_SPLICE_AND, CRASH_SPLICE_WHILE], ids=["and", "while"])
def test_crash_line_splice(device, src):
    _check_survived(_bwds_in_subprocess(device, src))


# --- class 12: host values ------------------------------------------------------------------------


def test_host_arrays_converted(m, device):
    X = np.linspace(-1.3, 2.1, 12).reshape(3, 4)
    for arr in (X, X.T, np.asfortranarray(X), X[::-1, ::-2]):
        close(m.cubic(arr, 0.5, _result="numpy"), 0.5 * f64(arr.astype(np.float32)) ** 3, rtol=1e-6)
    close(m.cubic(np.arange(5, dtype=np.uint8), 2, _result="numpy"), 2 * np.arange(5.0) ** 3)
    k = T(np.array([2.0], np.float32), device, requires_grad=True)
    xs = np.arange(10.0)[::3]
    m.cubic.bwds(xs, k, _result=1.0)
    close(k.grad.numpy(), [np.sum(xs**3)])
    with pytest.raises(ValueError, match="'k'"):
        m.tk(np.array([2.5]), 1.0)


def test_float64_array_for_array_parameter(m, device):
    a = np.array([[1.0, 2.0, 3.0], [0.5, 0.0, 0.0]])
    try:
        got = m.arrsum(a, _result="numpy")
    except (TypeError, ValueError) as exc:
        assert "'a'" in str(exc) and "float64" in str(exc), str(exc)[:300]
        return
    close(got, [14.0, 0.5])


def test_float_tensor_for_int_parameter(m, device):
    with pytest.raises((TypeError, ValueError), match="'k'"):
        m.tk(T(np.array([2.5, 1.0], np.float32), device), np.array([1.0, 1.0]))


# --- class 13 / 14: devices and sizes ------------------------------------------------------------


def test_ops_two_devices_refused(device):
    d2 = pydiff.create_device(device.type, include_paths=[os.path.dirname(__file__)])
    if d2 is device:
        pytest.skip("one device only")
    a = T(np.ones((2, 4), np.float32), device)
    b = T(np.ones((4, 4), np.float32), d2)
    for op in (pydiff.ops.matmul, pydiff.ops.linear):
        with pytest.raises(ValueError, match="#"):
            op(a, b)


def test_huge_broadcast_call_refused(m, device):
    a = pydiff.zeros((2**16, 1), device=device)
    b = pydiff.zeros((1, 2**16), device=device)
    with pytest.raises(pydiff.errors.TensorTooLargeError, match="4,294,967,296"):
        m.times(a, b, _result="tensor")
    with pytest.raises(pydiff.errors.TensorTooLargeError):
        m.gid(spy.grid((2**16, 2**16)), 1.0, 1.0, _result="tensor")
