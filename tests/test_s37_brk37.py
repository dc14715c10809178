"""Breaker round 37 (brk37): sources the double-intrinsic scan missed, each a silent wrong
value on lavapipe (sin of a double gave 0) — a generic struct named with ``double``, a struct's
generic static method called with ``.``, a ``double`` struct field and a method returning a
double (an associated type aliasing ``double``) passed to an inferred generic, Slang's older
``__generic<T>`` syntax, ``this`` in an ``extension double`` — and generics
that compute in float (``x.toFloat()``, ``__realCast<float>``), refused wrongly. Each call either
is refused with ShaderTrapError (on a device computing the intrinsic wrong on doubles) or
matches NumPy's float64 values."""

from __future__ import annotations

import gc
import tracemalloc
import warnings

import numpy as np
import pytest

import pydiff
from pydiff import double_math, nn, ops, optim
from pydiff.errors import ShaderTrapError
from pydiff.lint_double import double_calls

X = np.array([0.5, 1.0, 2.0], np.float32)
SIN = np.sin(X.astype(np.float64))
TSIN = "T tsin<T : __BuiltinFloatingPointType>(T x) { return sin(x); }\n"
GENERIC_STRUCT = "struct S<T : __BuiltinFloatingPointType> { T v; T s() { return sin(v); } };\n"
STATIC = "struct S2 { static T s<T : __BuiltinFloatingPointType>(T v) { return sin(v); } };\n"
DOUBLES = {  # sources whose f(x) computes sin on a double: refused, or sin(x) in float64
    "generic_struct": GENERIC_STRUCT
    + "float f(float x) { S<double> s; s.v = x; return float(s.s()); }",
    "generic_struct_alias": GENERIC_STRUCT
    + "typealias SD = S<double>;\nfloat f(float x) { SD s; s.v = x; return float(s.s()); }",
    "static_dot": STATIC + "float f(float x) { double d = x; return float(S2.s(d)); }",
    "double_field": TSIN
    + "struct P { double v; };\nfloat f(float x) { P p; p.v = x; return float(tsin(p.v)); }",
    "double_field_direct": "struct P { double v; };\n"
    "float f(float x) { P p; p.v = x; return float(sin(p.v)); }",
    "associated_type": "interface IS { associatedtype V; V get(); }\n"
    "struct D : IS { typealias V = double; double v; V get() { return v; } };\n"
    + TSIN
    + "float f(float x) { D dd; dd.v = x; return float(tsin(dd.get())); }",
    "old_generic_syntax": "__generic<T : __BuiltinFloatingPointType> T osin(T x) "
    "{ return sin(x); }\nfloat f(float x) { double d = x; return float(osin(d)); }",
    "double_extension": "extension double { double mysin() { return sin(this); } }\n"
    "float f(float x) { double d = x; return float(d.mysin()); }",
    # an explicit specialisation's callers: g was refused, f (calling g) gave 0
    "explicit_callers": TSIN + "double g(double x) { return tsin<double>(x); }\n"
    "float f(float x) { return float(g(double(x))); }",
    "explicit_in_float_helper": TSIN
    + "float g(float x) { return float(tsin<double>(double(x))); }\n"
    "float f(float x) { return g(x); }",
}
FLOATS = {  # sources computing sin in float: never refused, sin(x) within float precision
    "generic_struct_float": GENERIC_STRUCT
    + "float f(float x) { S<float> s; s.v = x; return s.s(); }",
    "static_float": STATIC + "float f(float x) { return S2.s(x); }",
    "float_field": TSIN + "struct P { float v; };\n"
    "float f(float x) { P p; p.v = x; return 0.5 * (tsin(p.v) + sin(p.v)); }",
    "to_float": "T g<T : __BuiltinFloatingPointType>(T x) { return T(sin(x.toFloat())); }\n"
    "float f(float x) { double d = x; return float(g(d)); }",
    "real_cast": "T g<T : __BuiltinFloatingPointType>(T x) "
    "{ return __realCast<T>(sin(__realCast<float>(x))); }\n"
    "float f(float x) { double d = x; return float(g(d)); }",
    "ifloat_to_float": "T g<T : IFloat>(T x) { let y = x.toFloat(); return T(sin(y)); }\n"
    "float f(float x) { double d = x; return float(g(d)); }",
    "old_generic_float": "__generic<T : __BuiltinFloatingPointType> T osin(T x) "
    "{ return sin(x); }\nfloat f(float x) { return osin(x); }",
    "float_extension": "extension float { float mysin() { return sin(this); } }\n"
    "float f(float x) { return x.mysin(); }",
    "explicit_float": TSIN + "float g(float x) { return tsin<float>(x); }\n"
    "float f(float x) { return g(x); }",
    "swizzle_not_a_field": "struct P { double x; };\n"
    "float f(float x) { float3 v = float3(x, x, x); return sin(v.x); }",
}


def _load(device, name: str, source: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pydiff.load_module_from_source(f"s37_brk_{name}", source, device)


@pytest.mark.parametrize("name", list(DOUBLES))
def test_double_sources_are_refused_or_right(device, name):
    m = _load(device, name, DOUBLES[name])
    x = pydiff.tensor(X, device=device)
    if "sin" in double_math.broken_intrinsics(device):
        with pytest.raises(ShaderTrapError, match="sin\\(\\) of a double"):
            m.f(x)
        return
    np.testing.assert_allclose(m.f(x).numpy(), SIN, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(FLOATS))
def test_float_sources_run_and_are_right(device, name):
    assert "f" not in double_calls(FLOATS[name])
    m = _load(device, name, FLOATS[name])
    got = m.f(pydiff.tensor(X, device=device)).numpy()
    np.testing.assert_allclose(got, SIN, rtol=1e-6, atol=1e-6)


def test_double_sources_are_seen_by_the_scan():
    for name, source in DOUBLES.items():
        calls = double_calls(source).get("f", [])
        assert any(c[1] == "sin" for c in calls), name


def test_differentiable_generic_struct_bwds_refused_or_right(device):
    source = (
        "struct Q<T : __BuiltinFloatingPointType> { [Differentiable] static T e(T v) "
        "{ return exp(v); } };\n"
        "[Differentiable] float f(float x) { return float(Q<double>.e(double(x))); }"
    )
    m = _load(device, "bwds_struct", source)
    x = pydiff.tensor(X, device=device, requires_grad=True)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    if "exp" in double_math.broken_intrinsics(device):
        with pytest.raises(ShaderTrapError, match="exp\\(\\) of a double"):
            m.f.bwds(x, _result=y)
        return
    m.f.bwds(x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), np.exp(X.astype(np.float64)), rtol=1e-5)


# --- the pool's per-size cursor (buffer_pool) ------------------------------------------------


def _pool_bytes() -> int:
    """Python memory allocated in buffer_pool.py and still alive."""
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*buffer_pool.py")])
    return sum(s.size for s in snap.statistics("filename"))


def test_cursors_of_released_sizes_do_not_pile_up(device):
    # A size reused once gets a cursor; empty_cache (the pool's prune) releases its buffers:
    # the cursors must go with them, or tensors of ever new sizes (varying batch sizes,
    # point clouds) grow the pool's memory without bound (1.3 MB over 24k sizes, before).
    tracemalloc.start()
    try:
        for rnd in range(3):
            for n in range(1 + rnd * 8000, 8001 + rnd * 8000):
                pydiff.empty((4 * n,), device=device)  # freed at once
                pydiff.empty((4 * n,), device=device)  # reusing its buffer
            pydiff.empty_cache(device)
        assert _pool_bytes() < 200_000
    finally:
        tracemalloc.stop()


def test_results_right_across_prunes_in_a_loop(device):
    # the cursor past the list's end after a prune shrank it; results kept and dropped
    m = _load(
        device, "pool_loop", "[Differentiable] float f(float a, float x) { return a * x * x; }"
    )
    xs = np.linspace(-2, 2, 37).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    kept = []
    for i in range(700):
        y = m.f(float(i % 11), x)
        if i % 13 == 0:
            kept.append((y, i % 11))
        if i % 97 == 50:
            pydiff.empty_cache(device)
    want = xs.astype(np.float64) ** 2
    for y, a in kept:
        np.testing.assert_allclose(y.numpy(), a * want, rtol=1e-6, atol=1e-6)
    assert device.pool.sizes()["buffers"] <= 32 + 256 + 4


def test_released_steps_reuse_bound_objects_with_free_buffers_left_in_the_pool(device):
    # Earlier work left free buffers of the step's sizes in the pool: a cursor kept across
    # submissions rotated each step through them (new buffers every step: 116 new bound shader
    # objects in 40 steps, each ~15 us and 11 KB, the shared cache churning); from the list's
    # start after each submission, a step finds the buffers of the step before.
    rng = np.random.default_rng(7)
    xb = pydiff.tensor(rng.standard_normal((32, 8)).astype(np.float32), device=device)
    yb = pydiff.tensor(rng.integers(0, 4, 32).astype(np.int32), device=device)
    l1 = nn.Linear(8, 16, seed=0, activation="relu", device=device)
    l2 = nn.Linear(16, 4, seed=1, device=device)
    opt = optim.AdamW(l1.parameters() + l2.parameters(), lr=1e-3)
    leftovers = [pydiff.empty((n,), device=device) for n in (512, 128, 64, 32, 16, 4, 1)
                 for _ in range(12)]  # fmt: skip
    del leftovers

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(l2(l1(xb)), yb)
        tape.backward(loss, retain_graph=False)
        opt.step()

    for _ in range(20):
        step()
    before = device.kernels.sizes()["objects"]
    for _ in range(40):
        step()
    assert device.kernels.sizes()["objects"] - before == 0


def test_imported_double_helpers_are_refused_or_right(device, tmp_path):
    # the double scan read the module's own text only: a helper of an imported file calling
    # sin on a double (or a generic of it called with one) gave 0 on lavapipe, unseen
    (tmp_path / "h37brk.slang").write_text(
        "T tsin<T : __BuiltinFloatingPointType>(T x) { return sin(x); }\n"
        "double dsin(double x) { return sin(x); }\n"
    )
    (tmp_path / "m37brk.slang").write_text(
        "import h37brk;\n"
        "float f(float x) { double d = x; return float(tsin(d)); }\n"
        "float g(float x) { return float(dsin(double(x))); }\n"
        "float k(float x) { return tsin(x); }\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pydiff.load_module(tmp_path / "m37brk.slang", device=device)
    x = pydiff.tensor(X, device=device)
    np.testing.assert_allclose(m.k(x).numpy(), SIN, rtol=1e-6, atol=1e-6)  # floats: right
    for name, line in (("f", 1), ("g", 2)):
        if "sin" in double_math.broken_intrinsics(device):
            with pytest.raises(ShaderTrapError, match=rf"h37brk\.slang:{line}: in {name}\(\)"):
                getattr(m, name)(x)
        else:
            np.testing.assert_allclose(getattr(m, name)(x).numpy(), SIN, rtol=1e-6, atol=1e-7)
