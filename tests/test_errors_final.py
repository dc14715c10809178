"""Issue 15, final: clear errors and a generic inout backward.

Generic functions with ``inout`` parameters differentiate through a generic wrapper; host
arrays for fixed-size array parameters are converted (or refused naming the parameter);
tensors of a dtype SlangPy cannot take are refused naming the parameter and both types; a
number seed beyond a half result's range, a written argument smaller than the call, and an
identity Function without a backward each get a right answer or a clear error. Every
gradient is checked against a closed form or a float64 central difference in NumPy.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff
from pydiff.custom_backward import generic_header, inout_wrapper_source

SRC = """
[Differentiable] void ginout<T : __BuiltinFloatingPointType>(T s, inout T y) { y = y * y * s; }
[Differentiable] void gvec<T : __BuiltinFloatingPointType, let N : int>(
    vector<T, N> s, inout vector<T, N> y) { y = y * y * s; }
[Differentiable] U gtwo<T : __BuiltinFloatingPointType, U : __BuiltinFloatingPointType>(
    U a, inout T y) { y = y * y * y; return a * a; }
[Differentiable] T gwhere<T>(T a, inout T y) where T : __BuiltinFloatingPointType
{ y = sin(y) * a; return a * a; }
[Differentiable] float call_gwhere(float a) { float y = a; return gwhere<float>(a, y) + y; }
[Differentiable] void plain_io(float s, inout float y) { y = y * y * s; }
void gsc_bwd<T : __BuiltinFloatingPointType>(inout DifferentialPair<T> s,
    inout DifferentialPair<T> y)
{
    T yv = y.p; T g = reinterpret<T>(y.d);  // reads the inout's primal
    s = diffPair(s.p, reinterpret<T.Differential>(g * yv * yv));
    y = diffPair(yv, reinterpret<T.Differential>(g * T(2.0) * yv * s.p));
}
[BackwardDerivative(gsc_bwd)]
void gsc<T : __BuiltinFloatingPointType>(T s, inout T y) { y = y * y * s; }

[Differentiable] float arrsum(float a[3]) { return a[0] + 2.0 * a[1] + 3.0 * a[2]; }
[Differentiable] float arrw(float a[3], float w) { return w * (a[0] - a[1] * a[2]); }
[Differentiable] float arr2(float2 a[3]) { return a[0].x + 2.0 * a[1].y + 3.0 * a[2].x; }
float iarr(int a[4]) { return float(a[0] + 2 * a[3]); }
[Differentiable] float tk(int k, float x) { return float(k) * x; }
[Differentiable] float fx(float x) { return x * 2.0; }
[Differentiable] float hx(half x) { return float(x) * 2.0; }
[Differentiable] half hsq(half x) { return x * x * half(3.0); }
[Differentiable] float fsq(float x) { return x * x; }
[Differentiable] float tt(float w, float x) { return w * x; }
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float times(float a, float b) { return a * b; }
[Differentiable] float3 v3(float x) { return float3(x, 2.0 * x, 3.0 * x); }
"""

X0 = np.array([0.3, -1.1, 1.7], np.float32)
S0 = np.array([0.5, 0.2, -0.4], np.float32)
U = np.array([1.0, -2.0, 0.5], np.float32)


def f64(a):
    return np.asarray(a, np.float64)


def close(got, exp, rtol=1e-5, atol=1e-6):
    got, exp = f64(got), f64(exp)
    assert got.shape == exp.shape, (got.shape, exp.shape)
    np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol)


def central(f, x, h=1e-6):
    return (f(x + h) - f(x - h)) / (2 * h)


@pytest.fixture(scope="module")
def m(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pydiff.load_module_from_source("errors_final", SRC, device=device)


def T(data, device, **kw):
    return pydiff.tensor(data, device=device, **kw)


# --- 7: generic functions with inout parameters ------------------------------------------------


@pytest.mark.parametrize("s0", [S0, np.array([2.0, -3.0, 0.25], np.float32)])
def test_generic_inout_scalar_closed_form(m, device, s0):
    s, y = T(s0, device, requires_grad=True), T(X0, device, requires_grad=True)
    m.ginout(s, y)
    close(y.numpy(), f64(X0) ** 2 * f64(s0))
    y.grad.copy_from_numpy(U)
    m.ginout.bwds(s, y)
    close(s.grad.numpy(), U * f64(X0) ** 2)
    close(y.grad.numpy(), U * 2 * f64(X0) * f64(s0))


def test_generic_inout_hand_written_backward_reading_the_primal(m, device):
    s, y = T(S0, device, requires_grad=True), T(X0, device, requires_grad=True)
    m.gsc(s, y)
    y.grad.copy_from_numpy(U)
    m.gsc.bwds(s, y)
    close(s.grad.numpy(), U * f64(X0) ** 2)
    close(y.grad.numpy(), U * 2 * f64(X0) * f64(S0))


def test_generic_inout_half(m, device):
    s0, y0 = np.array([0.5, 2.0], np.float16), np.array([2.0, -1.0], np.float16)
    s, y = T(s0, device, requires_grad=True), T(y0, device, requires_grad=True)
    m.ginout(s, y)
    y.grad.copy_from_numpy(np.ones(2, np.float16))
    m.ginout.bwds(s, y)
    close(s.grad.numpy(), f64(y0) ** 2, rtol=1e-3)
    close(y.grad.numpy(), 2 * f64(y0) * f64(s0), rtol=1e-3)


@pytest.mark.parametrize("n", [2, 3])
def test_generic_inout_value_parameter(m, device, n):
    rng = np.random.default_rng(n)
    S = rng.uniform(-1, 1, (4, n)).astype(np.float32)
    Y = rng.uniform(-1, 1, (4, n)).astype(np.float32)
    G = rng.uniform(-1, 1, (4, n)).astype(np.float32)
    s = T(S, device, dtype=f"float{n}", requires_grad=True)
    y = T(Y, device, dtype=f"float{n}", requires_grad=True)
    m.gvec(s, y)
    y.grad.copy_from_numpy(G)
    m.gvec.bwds(s, y)
    close(s.grad.numpy(), G * f64(Y) ** 2)
    close(y.grad.numpy(), G * 2 * f64(Y) * f64(S))


def test_generic_inout_two_type_parameters_and_result(m, device):
    a, y = T(S0, device, requires_grad=True), T(X0, device, requires_grad=True)
    r = m.gtwo(a, y, _result="tensor")
    close(r.numpy(), f64(S0) ** 2)
    y.grad.copy_from_numpy(U)
    m.gtwo.bwds(a, y, _result=r.with_grads(ones=True))
    close(y.grad.numpy(), U * 3 * f64(X0) ** 2)
    close(a.grad.numpy(), 2 * f64(S0))


def test_generic_inout_where_clause_against_finite_differences(m, device):
    a, y = T(S0, device, requires_grad=True), T(X0, device, requires_grad=True)
    r = m.gwhere(a, y, _result="tensor")
    y.grad.copy_from_numpy(U)
    m.gwhere.bwds(a, y, _result=r.with_grads(ones=True))

    def loss(av, yv):  # upstream U on the new y, 1 on the result
        return U * (np.sin(yv) * av) + av * av

    A, Y = f64(S0), f64(X0)
    close(a.grad.numpy(), central(lambda t: loss(t, Y), A), rtol=1e-5, atol=1e-5)
    close(y.grad.numpy(), central(lambda t: loss(A, t), Y), rtol=1e-5, atol=1e-5)
    # called from a non-generic caller (the generic's own backward through Slang)
    x = T(X0, device, requires_grad=True)
    m.call_gwhere.bwds(x, _result=1.0)
    close(x.grad.numpy(), central(lambda t: t * t + np.sin(t) * t, f64(X0)), atol=1e-5)


def test_generic_inout_on_tape(m, device):
    s, y0 = T(S0, device, requires_grad=True), T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.times(y0, 1.0, _result="tensor")
        m.ginout(s, y)
        z = m.times(y, y, _result="tensor")
    tape.backward(z, grad=np.ones(3))
    X, Sv = f64(X0), f64(S0)
    close(s.grad.numpy(), 2 * (X**2 * Sv) * X**2, rtol=1e-5)
    close(y0.grad.numpy(), 2 * (X**2 * Sv) * 2 * X * Sv, rtol=1e-5)


def test_generic_wrapper_source(m):
    assert generic_header(m.plain_io) == ("", "", "")
    assert "<" not in inout_wrapper_source(m.plain_io).split("(")[0]
    assert generic_header(m.gvec) == (
        "<T : __BuiltinFloatingPointType, let N : int>",
        "<T, N>",
        "",
    )
    assert generic_header(m.gwhere)[2] == " where T : __BuiltinFloatingPointType"
    src = inout_wrapper_source(m.gtwo)
    assert "gtwo<T, U>(a, y)" in src and "gtwo__pydiff_inout<T :" in src


def test_generic_inout_in_an_included_file(device, tmp_path):
    (tmp_path / "gdef.slang").write_text(
        "[Differentiable] void ginc<T : __BuiltinFloatingPointType>(T s, inout T y)"
        " { y = y * y * s; }\n"
    )
    (tmp_path / "main.slang").write_text(
        '#include "gdef.slang"\n[Differentiable] float other(float x) { return x; }\n'
    )
    mod = pydiff.load_module(str(tmp_path / "main.slang"), device=device)
    s, y = T(S0, device, requires_grad=True), T(X0, device, requires_grad=True)
    mod.ginc(s, y)
    y.grad.copy_from_numpy(U)
    mod.ginc.bwds(s, y)
    close(s.grad.numpy(), U * f64(X0) ** 2)
    close(y.grad.numpy(), U * 2 * f64(X0) * f64(S0))


def test_generic_inout_declaration_not_found_is_refused(device, tmp_path):
    (tmp_path / "gdef2.slang").write_text(
        "[Differentiable] void gnf<T : __BuiltinFloatingPointType>(T s, inout T y) { y = y * s; }\n"
    )
    (tmp_path / "main2.slang").write_text('#include "gdef2.slang"\n')
    mod = pydiff.load_module(str(tmp_path / "main2.slang"), device=device, lint=False)
    s, y = T(S0, device, requires_grad=True), T(X0, device, requires_grad=True)
    with pytest.raises(TypeError, match=r"gnf.bwds: 'gnf' is generic .* gnf<\.\.\.>"):
        mod.gnf.bwds(s, y)


# --- 8: host arrays for array parameters ------------------------------------------------------


def _arrsum(a):
    a = f64(a)
    return a[..., 0] + 2 * a[..., 1] + 3 * a[..., 2]


@pytest.mark.parametrize(
    "a",
    [
        np.array([[1.0, 2.0, 3.0], [0.5, 0.0, 0.0]]),  # float64
        np.arange(12, dtype=np.int64).reshape(4, 3),
        np.linspace(-1, 1, 12).reshape(3, 4)[:, ::-1][:, :3],  # strided float64
        np.asfortranarray(np.linspace(-2, 2, 9).reshape(3, 3)),
    ],
)
def test_array_parameter_converts_host_arrays(m, device, a):
    close(m.arrsum(a, _result="numpy"), _arrsum(a.astype(np.float32)))


def test_array_parameter_single_array_and_list(m, device):
    assert m.arrsum(np.array([1.0, 2.0, 3.0])) == pytest.approx(14.0)
    assert m.arrsum([1.0, 2.0, 3.0]) == pytest.approx(14.0)
    A = np.arange(6.0).reshape(3, 2)
    assert m.arr2(A) == pytest.approx(A[0, 0] + 2 * A[1, 1] + 3 * A[2, 0])
    B = np.arange(12.0).reshape(2, 3, 2)
    close(m.arr2(B, _result="numpy"), B[:, 0, 0] + 2 * B[:, 1, 1] + 3 * B[:, 2, 0])


def test_array_parameter_int_elements(m, device):
    A = np.arange(8.0).reshape(2, 4)
    close(m.iarr(A, _result="numpy"), A[:, 0] + 2 * A[:, 3])
    with pytest.raises(ValueError, match=r"parameter 'a' \(int\[4\]\).*float64.*0\.5"):
        m.iarr(A + 0.5, _result="numpy")


@pytest.mark.parametrize("shape", [(2, 4), (4,), (3, 2)])
def test_array_parameter_wrong_length_refused(m, device, shape):
    with pytest.raises(ValueError, match=rf"parameter 'a' .*shape \({shape[0]}"):
        m.arrsum(np.ones(shape), _result="numpy")
    with pytest.raises(ValueError, match=r"parameter 'a' \(float\[3\]\) got a float tensor"):
        m.arrsum(T(np.ones(shape, np.float32), device), _result="numpy")


def test_array_parameter_number_refused(m, device):
    with pytest.raises(TypeError, match=r"parameter 'a' .*number 1\.0.*3 elements"):
        m.arrsum(1.0)


def test_array_parameter_float64_in_bwds(m, device):
    a = np.array([[1.0, 2.0, 3.0], [0.5, -1.5, 2.0]])
    w = T(np.array([2.0], np.float32), device, requires_grad=True)
    m.arrw.bwds(a, w, _result=1.0)
    close(w.grad.numpy(), [np.sum(a[:, 0] - a[:, 1] * a[:, 2])])
    x = T(a.astype(np.float32), device, requires_grad=True)
    m.arrw.bwds(x, 2.0, _result=1.0)
    exp = np.stack([np.full(2, 2.0), -2 * a[:, 2], -2 * a[:, 1]], axis=1)
    close(x.grad.numpy(), exp)


# --- 9: tensors of a dtype the parameter cannot take -------------------------------------------


@pytest.mark.parametrize(
    "fn, data, dtype, param, want",
    [
        ("tk", np.array([2.5, 1.0], np.float32), None, "k", "int"),
        ("fx", np.array([2, 1], np.int32), None, "x", "float"),
        ("fx", np.array([2, 1], np.float16), None, "x", "float"),
        ("hx", np.array([2, 1], np.float32), None, "x", "half"),
        ("fx", np.ones((2, 3), np.float32), "float3", "x", "float"),
        ("arrsum", np.ones((2, 3), np.int32), None, "a", "float"),
    ],
)
def test_tensor_of_wrong_dtype_refused(m, device, fn, data, dtype, param, want):
    t = T(data, device, **({"dtype": dtype} if dtype else {}))
    args = (t, np.array([1.0, 1.0])) if fn == "tk" else (t,)
    with pytest.raises(TypeError) as info:
        getattr(m, fn)(*args, _result="numpy")
    text = str(info.value)
    assert f"parameter '{param}'" in text and f"dtype {t.dtype}" in text, text
    assert f"takes a {want} tensor" in text or f"takes an {want} tensor" in text, text
    assert "could not be resolved" not in text


def test_tensor_of_right_dtype_still_works(m, device):
    close(m.tk(T(np.array([2, 1], np.int32), device), 1.5, _result="numpy"), [3.0, 1.5])
    close(m.arrsum(T(np.eye(3, dtype=np.float32), device), _result="numpy"), [1.0, 2.0, 3.0])
    x = T(np.arange(3, dtype=np.float32), device, requires_grad=True)
    m.arrsum.bwds(x.reshape((1, 3)), _result=1.0)
    close(x.grad.numpy(), [1.0, 2.0, 3.0])


# --- minor -------------------------------------------------------------------------------------


def test_race_message_names_the_shapes_right(m, device):
    w = T(np.ones((4, 1), np.float32), device, requires_grad=True)
    small = pydiff.zeros((1, 4), device=device).with_grads(ones=True)
    with pytest.raises(ValueError) as info:
        m.tt.bwds(w, 2.0, _result=small)
    text = str(info.value)
    assert "_result has shape (1, 4)" in text and "broadcast to shape (4, 1)" in text, text
    assert "run over (4, 4)" in text and "Pass one of shape (4, 1)" in text, text
    assert "call shape (4, 4)" not in text, text
    y = T(X0, device, requires_grad=True)
    with pytest.raises(ValueError) as info:
        m.sq(y.reshape((3, 1)), _result=y)
    text = str(info.value)
    assert "broadcast to shape (3, 1)" in text and "run over (3, 3)" in text, text
    assert "Pass one of shape (3, 1)" in text, text


def test_race_message_for_vector_result_keeps_element_axes(m, device):
    x = T(np.ones(5, np.float32), device)
    with pytest.raises(ValueError, match=r"broadcast to shape \(5,\).*Pass one of shape \(5, 3\)"):
        m.v3(x, _result=np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"has shape \(1,\), .*Pass one of shape \(5,\),"):
        m.v3(x, _result=pydiff.zeros((1,), dtype="float3", device=device))
    close(m.v3(x, _result="numpy"), np.tile([1.0, 2.0, 3.0], (5, 1)))


@pytest.mark.parametrize("seed", [70000.0, -70000, 1e6])
def test_half_seed_beyond_range_refused(m, device, seed):
    x = T(np.ones(3, np.float16), device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning either
        with pytest.raises(ValueError, match=r"_result=.*half.*65504"):
            m.hsq.bwds(x, _result=seed)
    m.hsq.bwds(x, _result=100.0)
    close(x.grad.numpy(), np.full(3, 600.0))


def test_float_seed_beyond_range_refused_and_forward_number_result(m, device):
    x = T(X0, device, requires_grad=True)
    with pytest.raises(ValueError, match=r"_result=1e\+39.*float"):
        m.fsq.bwds(x, _result=1e39)
    m.fsq.bwds(x, _result=70000.0)
    close(x.grad.numpy(), 140000.0 * f64(X0), rtol=1e-6)
    with pytest.raises(TypeError, match="only seeds the result's gradient in .bwds"):
        m.hsq(T(np.ones(3, np.float16), device), _result=70000.0)


class _Ident(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        return x


class _View(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        return x.reshape((3, 1))


class _Pair(pydiff.Function):
    @staticmethod
    def forward(ctx, x, y):
        return y, x


def test_identity_function_as_tape_output(m, device):
    x = T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = _Ident.apply(x)
    tape.backward(y, grad=U)
    close(x.grad.numpy(), U)
    x = T(X0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = _View.apply(_Ident.apply(x))
    assert y.shape == (3, 1)
    tape.backward(y, grad=U.reshape(3, 1))
    close(x.grad.numpy(), U)


def test_identity_function_outputs_feeding_calls(m, device):
    x, w = T(X0, device, requires_grad=True), T(S0, device, requires_grad=True)
    with pydiff.Tape() as tape:
        a, b = _Pair.apply(x, w)
        z = m.times(a, b, _result="tensor")
        z2 = m.times(z, _Ident.apply(z), _result="tensor")
    tape.backward(z2, grad=np.ones(3))
    Z = f64(X0) * f64(S0)
    close(x.grad.numpy(), 2 * Z * f64(S0))
    close(w.grad.numpy(), 2 * Z * f64(X0))


def test_identity_function_without_tape_or_grad(m, device):
    x = T(X0, device)
    assert _Ident.apply(x) is x
    with pydiff.Tape() as tape:
        y = _Ident.apply(x)
    assert y is x
    with pytest.raises(RuntimeError, match="not produced by any call recorded"):
        tape.backward(y, grad=U)
    assert pydiff.gradcheck(_Ident, (T(X0, device, requires_grad=True),))
