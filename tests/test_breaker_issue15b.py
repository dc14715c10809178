"""Adversarial checks of issue 15's classes 1, 2, 3/4/11, 5/6/15/17, 8 and broadcast coverage
(second breaker). References are closed forms or float64 central finite differences, never
pydiff. Cases that fail today are strict xfails; anything that may crash runs in a
subprocess."""

from __future__ import annotations

import itertools
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

_names = itertools.count()


def fresh(device, source: str):
    return pydiff.load_module_from_source(f"breaker15b_{next(_names)}", source, device=device)


def run_isolated(device, code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYDIFF_DEVICE=device.type)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def same(g, r):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    return bool(np.all((g == r) | (np.isnan(g) & np.isnan(r))))


SOURCE = """
import slangpy;
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float times(float a, float b) { return a * b; }
[Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
[Differentiable] void two_inout(inout float a, inout float b) { float t = a * b; a = t; b = t + b; }
[Differentiable] void outsq(float x, out float y) { y = x * x; }
[Differentiable] float3 v3(float3 x) { return x * x; }
[Differentiable] half hsq(half x) { return x * x; }
[Differentiable] float ax(float a, float x) { return a * x; }
[Differentiable] half hax(half a, half x) { return a * x; }
[Differentiable] float dot3(float3 a, float3 x) { return dot(a, x); }
[Differentiable] float mat(float2x2 a, float2x2 x)
{ return a[0][0]*x[0][0] + a[0][1]*x[0][1] + a[1][0]*x[1][0] + a[1][1]*x[1][1]; }
[Differentiable] float gax(float a, int id, float scale) { return a * float(id - 1) * scale; }
[Differentiable] T cube<T : __BuiltinFloatingPointType>(T x) { return x * x * x; }
[Differentiable] float via_cube(float x) { return cube<float>(x) + cube(2.0 * x); }
"""

X = np.array([0.5, -1.25, 2.0, 3.0])
X3 = np.arange(1.0, 13.0).reshape(4, 3)


@pytest.fixture(scope="module")
def m(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fresh(device, SOURCE)


# --------------------------------------------------------------------------------------
# class 5: a float _result (or out tensor) that cannot hold the function's float3 values


def test_float_result_without_vector_axis_for_float3_function_refused(device, m):
    x = pydiff.tensor(X3, dtype="float3", device=device)
    with pytest.raises((ValueError, TypeError), match="_result"):
        m.v3(x, _result=pydiff.zeros((4,), device=device))


def test_float_result_with_wrong_trailing_axis_for_float3_function_refused(device, m):
    x = pydiff.tensor(X3, dtype="float3", device=device)
    with pytest.raises((ValueError, TypeError), match="_result"):
        m.v3(x, _result=pydiff.zeros((4, 2), device=device))


def test_float_result_with_vector_axis_for_float3_function_is_right(device, m):
    x = pydiff.tensor(X3, dtype="float3", device=device)
    y = pydiff.zeros((4, 3), device=device)
    m.v3(x, _result=y)
    np.testing.assert_array_equal(y.numpy(), X3**2)


def test_bwds_float_result_for_float3_function_right_or_refused(device, m):
    x = pydiff.tensor(X3, dtype="float3", device=device, requires_grad=True)
    u = np.array([1.0, 2.0, 3.0, 4.0])
    y = pydiff.zeros((4,), device=device).with_grads()
    y.grad.copy_from_numpy(u)
    try:
        m.v3.bwds(x, _result=y)
    except (ValueError, TypeError):
        return
    # a float per row can only mean one upstream per float3 element: d<u, |x|^2>/dx
    np.testing.assert_allclose(x.grad.numpy(), 2 * X3 * u[:, None], rtol=1e-6)


def test_numpy_result_without_vector_axis_error_names_the_vector(device, m):
    x = pydiff.tensor(X3, dtype="float3", device=device)
    with pytest.raises((ValueError, TypeError)) as info:
        m.v3(x, _result=np.zeros(4, np.float32))
    assert "float3" in str(info.value) or "vector" in str(info.value)


def test_out_tensor_smaller_than_call_refused(device, m):
    x = pydiff.tensor(X, device=device)
    y = pydiff.zeros((1,), device=device)
    with pytest.raises(ValueError, match="'y'"):
        m.outsq(x, y)


@pytest.mark.parametrize(
    "result_shape, dtype, exc",
    [
        ((1,), "float", ValueError),
        ((2, 1), "float", ValueError),
        ((1, 4), "float", ValueError),
        ((2, 4), "int", TypeError),
        ((2, 4), "uint", TypeError),
    ],
)
def test_result_smaller_or_integer_refused(device, m, result_shape, dtype, exc):
    a = pydiff.tensor(np.ones((2, 4)), device=device)
    b = pydiff.tensor(X, device=device, requires_grad=True)
    with pytest.raises(exc, match="_result"):
        m.times(a, b, _result=pydiff.zeros(result_shape, dtype=dtype, device=device))


def test_larger_result_than_call_is_right(device, m):
    y = pydiff.zeros((2, 4), device=device)
    m.sq(pydiff.tensor(X, device=device), _result=y)
    np.testing.assert_array_equal(y.numpy(), np.stack([X**2, X**2]))


# --------------------------------------------------------------------------------------
# class 17 / 15: positional result and number seeds


def test_positional_result_and_seeds(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    y = pydiff.zeros((4,), device=device).with_grads(ones=True)
    m.sq.bwds(x, y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)
    x = pydiff.tensor(X, device=device, requires_grad=True)
    m.sq.bwds(x, 2)  # an int seed
    np.testing.assert_allclose(x.grad.numpy(), 4 * X, rtol=1e-6)
    with pytest.raises(TypeError, match="twice"):
        m.sq.bwds(x, y, _result=y)


def test_half_number_seed_positional_and_overflow(device, m):
    h = pydiff.tensor(X, dtype="half", device=device, requires_grad=True)
    m.hsq.bwds(h, 3.0)
    np.testing.assert_array_equal(h.grad.numpy(), np.float16(6 * X))
    h = pydiff.tensor(X, dtype="half", device=device, requires_grad=True)
    with pytest.raises(ValueError, match=r"_result.*half"):
        m.hsq.bwds(h, _result=1e6)  # not a half: the seed itself would round to inf
    with pytest.raises(TypeError, match="_result"):
        m.hsq(pydiff.tensor(X, dtype="half", device=device), _result=1.0)


# --------------------------------------------------------------------------------------
# class 1: .bwds after in-place calls


def test_inout_bwds_through_detached_alias_refused(device, m):
    s = pydiff.tensor(X, device=device, requires_grad=True)
    v = pydiff.tensor(X[::-1].copy(), device=device, requires_grad=True)
    m.scale_inout(s, v.detach())  # written through an alias without gradient buffers
    v.grad.fill(1.0)
    with pytest.raises(ValueError, match="'v'"):
        m.scale_inout.bwds(s, v)


def test_inout_bwds_through_with_grads_alias_uses_value_read(device, m):
    V = X[::-1].copy()
    s = pydiff.tensor(X, device=device, requires_grad=True)
    v = pydiff.tensor(V, device=device, requires_grad=True)
    m.scale_inout(s, v)
    u = pydiff.tensor(np.full(4, 2.0), device=device)
    g = pydiff.zeros((4,), device=device)
    m.scale_inout.bwds(s, v.with_grads(grad_in=u, grad_out=g))
    np.testing.assert_allclose(s.grad.numpy(), 2 * V, rtol=1e-6)
    np.testing.assert_allclose(g.numpy(), 2 * X, rtol=1e-6)


def test_two_inout_parameters_explicit_bwds(device, m):
    A, B = X, X[::-1].copy()
    a = pydiff.tensor(A, device=device, requires_grad=True)
    b = pydiff.tensor(B, device=device, requires_grad=True)
    m.two_inout(a, b)
    a.grad.fill(1.0)
    b.grad.fill(1.0)
    m.two_inout.bwds(a, b)  # L = a' + b' = 2ab + b
    np.testing.assert_allclose(a.grad.numpy(), 2 * B, rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), 2 * A + 1, rtol=1e-6)


def test_tape_then_explicit_bwds_of_inout(device, m):
    V = X[::-1].copy()
    s = pydiff.tensor(X, device=device, requires_grad=True)
    v = pydiff.tensor(V, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        m.scale_inout(s, v)
        y = m.sq(v, _result="tensor")
    tape.backward(y, grad=np.ones(4))
    np.testing.assert_allclose(s.grad.numpy(), 2 * V * V * X, rtol=1e-6)
    s.zero_grad()
    v.grad.fill(1.0)
    m.scale_inout.bwds(s, v)  # still at the value the call read
    np.testing.assert_allclose(s.grad.numpy(), V, rtol=1e-6)


# --------------------------------------------------------------------------------------
# class 2 and coverage: IEEE sums for float, half, float3, float2x2 and spy.grid


SUMS = {
    "inf": [1.0, np.inf, 2.0],
    "both": [-np.inf, 1.0, np.inf],
    "nan": [1.0, np.nan, 3.0],
    "overflow": [3e38, 3e38, 1.0],
    "cancel": [3e38, 3e38, -3e38, -3e38],
}


def _ieee(v, dtype=np.float32):
    with np.errstate(all="ignore"):
        return dtype(np.sum(np.array(v, np.float64)))


@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("case", list(SUMS))
def test_ieee_broadcast_sums_vector_matrix(device, m, det, case):
    v = SUMS[case]
    r = _ieee(v)
    with pydiff.deterministic() if det else _nothing():
        a = pydiff.tensor(np.ones((1, 3)), dtype="float3", device=device, requires_grad=True)
        m.dot3.bwds(a, pydiff.tensor(np.stack([v, v, v], 1), dtype="float3", device=device), 1.0)
        assert same(a.grad.numpy()[0], [r, r, r])
        a = pydiff.tensor(np.ones((1, 2, 2)), dtype="float2x2", device=device, requires_grad=True)
        xm = np.array(v)[:, None, None] * np.ones((1, 2, 2))
        m.mat.bwds(a, pydiff.tensor(xm, dtype="float2x2", device=device), 1.0)
        assert same(a.grad.numpy()[0].ravel(), [r] * 4)
        a = pydiff.tensor(np.ones((1, 1)), device=device, requires_grad=True)
        m.ax.bwds(a, pydiff.tensor(np.array([v, v]), device=device), 1.0)
        assert same(a.grad.numpy()[0, 0], _ieee(v + v))


@pytest.mark.parametrize("det", [False, True])
def test_ieee_half_and_grid_sums(device, m, det):
    with pydiff.deterministic() if det else _nothing():
        for v in (
            [1.0, np.inf],
            [-np.inf, np.inf],
            [np.nan, 1.0],
            [60000.0, 60000.0],
            [60000.0, 60000.0, -60000.0, -60000.0],
        ):
            a = pydiff.tensor([1.0], dtype="half", device=device, requires_grad=True)
            m.hax.bwds(a, pydiff.tensor(v, dtype="half", device=device), _result=1.0)
            assert same(a.grad.numpy(), [_ieee(v, np.float16)])
        a = pydiff.tensor([1.0], device=device, requires_grad=True)
        m.gax.bwds(a, spy.grid((5,)), 1e38, _result=1.0)  # -1e38 .. 3e38: 5e38 -> inf
        assert same(a.grad.numpy(), [np.inf])
        a = pydiff.tensor([1.0], device=device, requires_grad=True)
        m.gax.bwds(a, spy.grid((1000,)), 1.0, _result=1.0)
        assert a.grad.numpy()[0] == sum(i - 1 for i in range(1000))


@pytest.mark.parametrize("where", [(0, 199_999), (100_000, 100_001)])
def test_ieee_opposite_infinities_in_different_chunks(device, m, where):
    v = np.full(200_000, 1.5, np.float32)
    v[where[0]], v[where[1]] = np.inf, -np.inf
    a = pydiff.tensor([1.0], device=device, requires_grad=True)
    m.ax.bwds(a, pydiff.tensor(v, device=device), _result=1.0)
    assert np.isnan(a.grad.numpy()[0])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------------------
# class 8: threads


def test_threads_broadcast_inout_and_tapes(device, m):
    errors = []

    def work(k):
        rng = np.random.default_rng(k)
        try:
            for _ in range(8):
                xs = rng.standard_normal(2048).astype(np.float32)
                a = pydiff.tensor([1.0], device=device, requires_grad=True)
                m.ax.bwds(a, pydiff.tensor(xs, device=device), _result=1.0)
                if abs(a.grad.numpy()[0] - xs.astype(np.float64).sum()) > 1e-3:
                    errors.append(("broadcast", k))
                S = rng.standard_normal(16)
                V = rng.standard_normal(16)
                s = pydiff.tensor(S, device=device, requires_grad=True)
                v = pydiff.tensor(V, device=device, requires_grad=True)
                m.scale_inout(s, v)
                v.grad.fill(1.0)
                m.scale_inout.bwds(s, v)
                if not np.allclose(s.grad.numpy(), V, rtol=1e-5):
                    errors.append(("inout", k))
                x = pydiff.tensor(xs[:8], device=device, requires_grad=True)
                with pydiff.Tape() as tape:
                    y = m.sq(x, _result="tensor")
                if len(tape) != 1:
                    errors.append(("tape length", k, len(tape)))
                tape.backward(y, grad=np.ones(8))
                if not np.allclose(x.grad.numpy(), 2 * xs[:8], rtol=1e-6):
                    errors.append(("tape", k))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(("exception", k, repr(exc)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --------------------------------------------------------------------------------------
# class 3: generic differentiable functions


def test_generic_function_tensor_result_tape_and_half(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    m.cube.bwds(x, _result=pydiff.zeros((4,), device=device).with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), 3 * X**2, rtol=1e-6)
    x = pydiff.tensor(X, device=device, requires_grad=True)
    m.via_cube.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), 3 * X**2 + 24 * X**2, rtol=1e-6)
    h = pydiff.tensor(X, dtype="half", device=device, requires_grad=True)
    m.cube.bwds(h, _result=pydiff.zeros((4,), dtype="half", device=device).with_grads(ones=True))
    np.testing.assert_allclose(h.grad.numpy(), 3 * X**2, rtol=2e-3)


def test_generic_function_number_seed(device, m):
    x = pydiff.tensor(X, device=device, requires_grad=True)
    m.cube.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), 3 * X**2, rtol=1e-6)


def test_generic_function_gradcheck(device, m):
    x = pydiff.tensor(np.array([0.5, 1.0, 2.0]), device=device, requires_grad=True)
    pydiff.gradcheck(m.cube, (x,))


# --------------------------------------------------------------------------------------
# classes 4 / 11: loop traps the scanner does not see (imported modules, macros)


HELPER = """
module helper15b;
[Differentiable] public float inner_and(float x)
{ float y = x; int k = 0; [MaxIters(20)] while (y < 10.0 && k < 10) { y = y * 1.5 + 0.1; k++;
  } return y; }
[Differentiable] public float inner_break(float x)
{ float y = 0.5 * x; [MaxIters(50)] while (y < 100.0) { y = 1.5 * y + x; if (y > 5.0) break;
  } return y; }
"""


def _break_fd(x):
    """float64 reference of inner_break at x (no kink at 1, 2, 3), by central differences."""

    def f(x):
        y = 0.5 * x
        while y < 100.0:
            y = 1.5 * y + x
            if y > 5.0:
                break
        return y

    h = 1e-6
    return np.array([(f(v + h) - f(v - h)) / (2 * h) for v in x])


def test_while_and_in_imported_module_refused_not_crash(device, tmp_path):
    (tmp_path / "helper15b.slang").write_text(HELPER)
    (tmp_path / "main15b.slang").write_text(
        "import helper15b;\n[Differentiable] float f(float x) { return inner_and(x) * 2.0; }\n"
    )
    proc = run_isolated(
        device,
        f"""
        import warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        m = pydiff.load_module({str(tmp_path / "main15b.slang")!r})
        x = pydiff.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        try:
            m.f.bwds(x, _result=1.0)
        except pydiff.ShaderTrapError:
            print("REFUSED")
    """,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED" in proc.stdout


def test_while_break_in_imported_module_right_or_refused(device, tmp_path):
    (tmp_path / "helper15b.slang").write_text(HELPER)
    (tmp_path / "main15b_b.slang").write_text(
        "import helper15b;\n[Differentiable] float g(float x) { return inner_break(x); }\n"
    )
    proc = run_isolated(
        device,
        f"""
        import warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        m = pydiff.load_module({str(tmp_path / "main15b_b.slang")!r})
        x = pydiff.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        try:
            m.g.bwds(x, _result=1.0)
        except pydiff.ShaderTrapError:
            print("REFUSED")
        else:
            print("GRAD", *x.grad.numpy().tolist())
    """,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    if "REFUSED" not in proc.stdout:
        grad = np.array([float(v) for v in proc.stdout.split("GRAD")[1].split()])
        np.testing.assert_allclose(grad, _break_fd([1.0, 2.0, 3.0]), rtol=1e-4)


def test_while_and_through_macro_refused_not_crash(device):
    proc = run_isolated(
        device,
        """
        import warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        m = pydiff.load_module_from_source("macro_and_15b", '''
        #define COND (y < 10.0 && k < 10)
        [Differentiable] float f(float x)
        { float y = x; int k = 0; [MaxIters(20)] while (COND) { y = y * 1.5 + 0.1; k++;
          } return y; }
        ''')
        x = pydiff.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        try:
            m.f.bwds(x, _result=1.0)
        except pydiff.ShaderTrapError:
            print("REFUSED")
    """,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED" in proc.stdout


def test_while_break_through_macro_right_or_refused(device):
    m = fresh(
        device,
        """
    #define BRK break
    [Differentiable] float f(float x)
    { float y = 0.5 * x; [MaxIters(50)] while (y < 100.0) { y = 1.5 * y + x; if (y > 5.0) BRK;
      } return y; }
    """,
    )
    x = pydiff.tensor(np.array([1.0, 2.0, 3.0]), device=device, requires_grad=True)
    try:
        m.f.bwds(x, _result=1.0)
    except pydiff.ShaderTrapError:
        return
    np.testing.assert_allclose(x.grad.numpy(), _break_fd([1.0, 2.0, 3.0]), rtol=1e-4)


def test_while_and_in_struct_method_refused_not_crash(device):
    proc = run_isolated(
        device,
        """
        import warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        m = pydiff.load_module_from_source("method_and_15b", '''
        struct P : IDifferentiable { float a;
          [Differentiable] float run(float x)
          { float y = x * a; int k = 0;
            [MaxIters(20)] while (y < 10.0 && k < 10) { y = y * 1.5 + 0.1; k++; } return y; } };
        [Differentiable] float f(float x) { P p; p.a = 1.0; return p.run(x); }
        ''')
        x = pydiff.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        try:
            m.f.bwds(x, _result=1.0)
        except pydiff.ShaderTrapError:
            print("REFUSED")
    """,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED" in proc.stdout
