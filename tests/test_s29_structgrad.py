"""s29 structgrad: tensors in struct (dict) arguments of ``.bwds`` and tapes.

1. A ``DiffTensor`` field gets its gradient (its own buffers, its zeroing policy), whether or
   not the struct is IDifferentiable, as raw SlangPy gives it; a written ``RWDiffTensor`` field
   that wants a gradient is refused, naming the field.
2. Off a tape, ``.bwds`` after a call that wrote (``out``/``_result``) into a tensor also passed
   as a struct field: refused where the gradient buffers are shared, differentiated at the
   values the call read where pydiff kept them, refused where it did not (as at top level).
3. Wrong values in struct fields: named TypeErrors, not Slang compiler errors.
4. A struct-valued tensor's repr shows its fields' values, not raw bytes.

Every gradient is checked against float64 closed forms (and raw SlangPy once).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated, ops

T = np.array([0.5, -1.0, 2.0])
S_VALUE = 2.0

FIELD_SRC = """
import slangpy;
struct S { DiffTensor<float, 1> t; float s; };
struct SD : IDifferentiable { DiffTensor<float, 1> t; float s; };
struct Outer { S inner; float k; };
struct W { RWDiffTensor<float, 1> t; float s; };
[Differentiable] float f(int idx, S p) { return p.t[idx] * p.t[idx] * p.s; }
[Differentiable] float fd(int idx, SD p) { return p.t[idx] * p.t[idx] * p.s; }
[Differentiable] float nested(int idx, Outer o) { return o.inner.t[idx] * o.inner.t[idx] * o.k; }
[Differentiable] float w(int idx, W p) { float v = p.t[idx]; p.t[idx] = 2.0 * v; return v * p.s; }
struct F { float a; float b; };
[Differentiable] float plain(F p, float x) { return p.a * x; }
"""


@pytest.fixture(scope="module")
def fields(device):
    return pydiff.load_module_from_source("s29_structgrad_fields", FIELD_SRC, device=device)


@pytest.fixture(params=["auto", "generated"])
def path(request, monkeypatch):
    """Both call paths: pydiff's generated kernels forced for every call they cover (struct
    calls are not covered: SlangPy's path runs them), or the default threshold."""
    if request.param == "generated":
        monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
        monkeypatch.setenv("PYDIFF_GENERATED_MIN_ELEMENTS", "1")
    return request.param


def _want(scale=1.0):
    return scale * 2.0 * S_VALUE * T  # d/dt sum_i t_i^2 s = 2 s t


def _no_flow_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, pydiff.GradientFlowWarning)]


# --- 1. DiffTensor fields ---------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["f", "fd"])
def test_difftensor_field_gets_its_gradient_through_bwds(fields, path, fn):
    t = pydiff.tensor(T, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(fields, fn).bwds(spy.grid((3,)), {"t": t, "s": S_VALUE}, _result=1.0)
    np.testing.assert_allclose(t.grad.numpy(), _want(), rtol=1e-6)
    assert _no_flow_warnings(caught) == []


def test_difftensor_field_gets_its_gradient_on_a_tape(fields, path):
    t = pydiff.tensor(T, requires_grad=True)
    with pydiff.Tape() as tape:
        y = fields.f(spy.grid((3,)), {"t": t, "s": S_VALUE}, _result="tensor")
        loss = ops.sum(y * y)  # d/dt sum (t^2 s)^2 = 4 s^2 t^3
    tape.backward(loss)
    np.testing.assert_allclose(t.grad.numpy(), 4 * S_VALUE**2 * T**3, rtol=1e-5)


def test_difftensor_field_in_a_nested_struct(fields, path):
    t = pydiff.tensor(T, requires_grad=True)
    fields.nested.bwds(spy.grid((3,)), {"inner": {"t": t, "s": 0.0}, "k": S_VALUE}, _result=1.0)
    np.testing.assert_allclose(t.grad.numpy(), _want(), rtol=1e-6)


def test_difftensor_field_matches_raw_slangpy(fields):
    t = pydiff.tensor(T, requires_grad=True)
    fields.f.bwds(spy.grid((3,)), {"t": t, "s": S_VALUE}, _result=1.0)
    dev = t.native.device
    raw = spy.Module.load_from_source(dev, "s29_structgrad_raw", FIELD_SRC)
    tt = spy.Tensor.from_numpy(dev, T.astype(np.float32)).with_grads(zero=True)
    res = spy.Tensor.from_numpy(dev, np.zeros(3, np.float32)).with_grads()
    res.grad.copy_from_numpy(np.ones(3, np.float32))
    raw.f.bwds(spy.grid((3,)), {"t": tt, "s": S_VALUE}, _result=res)
    np.testing.assert_allclose(t.grad.numpy(), tt.grad.to_numpy(), rtol=1e-6)


def test_difftensor_field_follows_the_zeroing_policies(fields):
    t = pydiff.tensor(T, requires_grad=True)
    call = lambda: fields.f.bwds(spy.grid((3,)), {"t": t, "s": S_VALUE}, _result=1.0)  # noqa: E731
    call()
    call()  # accumulate: added
    np.testing.assert_allclose(t.grad.numpy(), _want(2.0), rtol=1e-6)
    with pydiff.zero_policy("reset"):
        call()  # reset: set
    np.testing.assert_allclose(t.grad.numpy(), _want(), rtol=1e-6)
    with pydiff.zero_policy("strict"):
        with pytest.raises(pydiff.StaleGradientError, match=r"parameter 'p', field 't'"):
            call()
    np.testing.assert_allclose(t.grad.numpy(), _want(), rtol=1e-6)


def test_difftensor_field_without_gradient_is_bound_to_scratch(fields):
    t = pydiff.tensor(T)  # no gradient wanted: nothing to add into, no error
    fields.f.bwds(spy.grid((3,)), {"t": t, "s": S_VALUE}, _result=1.0)
    assert t.grad is None
    np.testing.assert_allclose(t.numpy(), T, rtol=1e-7)


def test_written_difftensor_field_wanting_a_gradient_is_refused(fields):
    t = pydiff.tensor(T, requires_grad=True)
    with pytest.raises(ValueError, match=r"w\.bwds: parameter 'p', field 't'.*own"):
        fields.w.bwds(spy.grid((3,)), {"t": t, "s": S_VALUE}, _result=1.0)
    np.testing.assert_allclose(t.numpy(), T, rtol=1e-7)  # and nothing was written


def test_float_field_of_a_plain_struct_still_warns_with_advice_that_applies(fields):
    a = pydiff.tensor(T, requires_grad=True)
    x = pydiff.tensor(T)
    with pytest.warns(pydiff.GradientFlowWarning, match=r"'p\.a'.*struct F : IDifferentiable"):
        fields.plain.bwds({"a": a, "b": 0.0}, x, _result=pydiff.ones((3,)).with_grads(ones=True))


def test_deterministic_mode_names_the_difftensor_field(fields):
    t = pydiff.tensor(T, requires_grad=True)
    with pydiff.deterministic():
        with pytest.warns(pydiff.NondeterminismWarning, match=r"field 'o\.inner\.t'"):
            fields.nested.bwds(spy.grid((3,)), {"inner": {"t": t, "s": 0.0}, "k": 1.0}, _result=1.0)


# --- 2. a tensor written by the call and passed as a struct field, off a tape ------------------

ALIAS_SRC = """
struct In : IDifferentiable { float a; };
struct P : IDifferentiable { In inner; float b; };
[Differentiable] void g_out(P p, float x, out float o) { o = p.inner.a * p.inner.a * x; }
[Differentiable] float g(P p, float x) { return p.inner.a * p.inner.a * x; }
"""
A = np.array([1.5, -0.5, 2.0])
X = np.array([0.5, -1.0, 2.0])


@pytest.fixture(scope="module")
def alias(device):
    return pydiff.load_module_from_source("s29_structgrad_alias", ALIAS_SRC, device=device)


def _p(a):
    return {"inner": {"a": a}, "b": 0.0}


@pytest.mark.parametrize("how", ["out", "_result"])
def test_bwds_refuses_upstream_shared_with_a_struct_field(alias, path, how):
    a = pydiff.tensor(A, requires_grad=True)
    x = pydiff.tensor(X, requires_grad=True)
    if how == "out":
        alias.g_out(_p(a), x, a)
        call = lambda: alias.g_out.bwds(_p(a), x, a)  # noqa: E731
    else:
        alias.g(_p(a), x, _result=a)
        call = lambda: alias.g.bwds(_p(a), x, _result=a)  # noqa: E731
    a.grad.copy_from_numpy(np.ones(3))
    with pytest.raises(ValueError, match=r"gradient buffer of parameter 'p', field 'inner\.a'"):
        call()
    np.testing.assert_allclose(x.grad.numpy(), 0.0)


def test_bwds_differentiates_a_struct_field_at_the_values_read(alias, path):
    a = pydiff.tensor(A, requires_grad=True)  # gradient buffers at the call: a copy is kept
    x = pydiff.tensor(X, requires_grad=True)
    alias.g(_p(a), x, _result=a)
    np.testing.assert_allclose(a.numpy(), A * A * X, rtol=1e-6)
    y = pydiff.zeros((3,)).with_grads(ones=True)  # an upstream of its own
    alias.g.bwds(_p(a), x, _result=y)
    np.testing.assert_allclose(a.grad.numpy(), 2 * A * X, rtol=1e-6)  # at A, not A^2 X
    np.testing.assert_allclose(x.grad.numpy(), A * A, rtol=1e-6)


def test_bwds_refuses_a_struct_field_overwritten_without_a_copy(alias):
    a = pydiff.tensor(A)  # no gradient buffers at the call: nothing kept
    x = pydiff.tensor(X, requires_grad=True)
    alias.g(_p(a), x, _result=a)
    a.requires_grad_(True)
    y = pydiff.zeros((3,)).with_grads(ones=True)
    with pytest.raises(ValueError, match=r"parameter 'p\.inner\.a' \(float\) was overwritten"):
        alias.g.bwds(_p(a), x, _result=y)


# --- 3. wrong values in struct fields -----------------------------------------------------------

ERR_SRC = """
struct In : IDifferentiable { float c; int k; };
struct P : IDifferentiable { float a; half h; In inner; };
[Differentiable] float g(P p, float x)
{ return p.a * x + float(p.h) + p.inner.c * float(p.inner.k); }
import slangpy;
struct TS { DiffTensor<float, 1> t; };
float ts(int i, TS p) { return p.t[i]; }
"""


@pytest.fixture(scope="module")
def errs(device):
    return pydiff.load_module_from_source("s29_structgrad_errs", ERR_SRC, device=device)


def _ok(**kw):
    return {"a": 1.0, "h": 0.5, "inner": {"c": 1.0, "k": 1}, **kw}


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(h="float"), r"g: parameter 'p\.h' \(half\) got a tensor of dtype float"),
        (dict(a="int"), r"g: parameter 'p\.a' \(float\) got a tensor of dtype int"),
        (dict(a=None), r"g: parameter 'p', field 'a' \(float\) got None"),
        (dict(inner=2.0), r"g: parameter 'p', field 'inner' \(In\) is a struct, but got a float"),
        (dict(inner="float"), r"field 'inner' \(In\) is a struct, but got a float tensor"),
    ],
)
def test_wrong_field_values_are_named_type_errors(errs, device, fields, match):
    made = {
        k: pydiff.tensor(np.arange(3), dtype=v, device=device) if v in ("float", "int") else v
        for k, v in fields.items()
    }
    x = pydiff.tensor(X, device=device)
    with pytest.raises(TypeError, match=match):
        errs.g(_ok(**made), x)


def test_a_number_for_a_whole_struct_is_a_named_type_error(errs, device):
    with pytest.raises(TypeError, match=r"parameter 'p' \(P\) is a struct, but got 3\.0"):
        errs.g(3.0, pydiff.tensor(X, device=device))


def test_a_tensor_field_of_the_wrong_dtype_is_a_named_type_error(errs, device):
    t = pydiff.tensor(np.arange(3), dtype="int", device=device)
    with pytest.raises(TypeError, match=r"field 't' \(DiffTensor<float, ?1>\) takes a tensor"):
        errs.ts(spy.grid((3,)), {"t": t})


# --- 4. repr of a struct-valued tensor ---------------------------------------------------------


def test_struct_tensor_repr_shows_field_values(device):
    m = pydiff.load_module_from_source(
        "s29_structgrad_repr",
        "struct Q { float a; int b; };\n"
        "Q mk(float a) { Q q; q.a = a; q.b = int(2 * a); return q; }",
        device=device,
    )
    y = m.mk(pydiff.tensor([1.0, 2.0, 3.0], device=device), _result="tensor")
    text = repr(y)
    assert "(1., 2)" in text and "(3., 6)" in text and "dtype=Q" in text, text
