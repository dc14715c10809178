"""Fixes of the s27 breaker round: error messages that name the API the user called, and
refusals of calls pydiff cannot make right."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff


# --- 1. host values a cast would change: the message names the entry point -------------------


@pytest.mark.parametrize(
    "entry, make, error, message",
    [
        (
            "Tensor.astype",
            lambda d: pydiff.tensor([1.0, np.nan], device=d).astype("int"),
            ValueError,
            "nan is not a whole number",
        ),
        (
            "Tensor.astype",
            lambda d: pydiff.tensor([-1.0], device=d).astype("uint"),
            ValueError,
            "do not fit uint32",
        ),
        (
            "Tensor.fill",
            lambda d: pydiff.zeros((3,), dtype="int", device=d).fill(2.5),
            ValueError,
            "2.5 is not a whole number",
        ),
        (
            "Tensor.fill",
            lambda d: pydiff.zeros((3,), dtype="uint", device=d).fill(-1),
            ValueError,
            "do not fit uint32",
        ),
        (
            "Tensor.fill",
            lambda d: pydiff.zeros((3,), device=d).fill(1 + 2j),
            TypeError,
            "complex values",
        ),
        (
            "Tensor.fill",
            lambda d: pydiff.zeros((3,), device=d).fill("a"),
            TypeError,
            "text, not numbers",
        ),
        (
            "pydiff.linspace",
            lambda d: pydiff.linspace(0, 1, 5, dtype="int", device=d),
            ValueError,
            "0.25 is not a whole number",
        ),
        (
            "pydiff.arange",
            lambda d: pydiff.arange(-3, 3, dtype="uint", device=d),
            ValueError,
            "do not fit uint32",
        ),
        (
            "pydiff.full: fill_value",
            lambda d: pydiff.full((2,), 2**40, dtype="int", device=d),
            ValueError,
            "do not fit int32",
        ),
        (
            "pydiff.full: fill_value",
            lambda d: pydiff.full((2,), float("nan"), dtype="int", device=d),
            ValueError,
            "nan is not a whole number",
        ),
        (
            "pydiff.tensor: data",
            lambda d: pydiff.tensor(np.array([2**40]), dtype="int", device=d),
            ValueError,
            "do not fit int32",
        ),
        (
            "pydiff.tensor: data",
            lambda d: pydiff.tensor([-1], dtype="uint", device=d),
            ValueError,
            "do not fit uint32",
        ),
        (
            "pydiff.tensor: data",
            lambda d: pydiff.tensor([1 + 2j], dtype="float", device=d),
            TypeError,
            "complex values",
        ),
        (
            "copy_from_numpy",
            lambda d: pydiff.zeros((1,), dtype="int", device=d).copy_from_numpy(np.array([0.5])),
            ValueError,
            "0.5 is not a whole number",
        ),
    ],
)
def test_host_cast_errors_name_the_api_called(device, entry, make, error, message):
    with pytest.raises(error) as info:
        make(device)
    text = str(info.value)
    assert text.startswith(f"{entry}: "), text
    assert message in text
    if entry != "copy_from_numpy":
        assert "copy_from_numpy" not in text


def test_full_with_a_complex_fill_value_is_refused_not_truncated(device):
    # np.full(..., dtype=float64) dropped the imaginary part with only a ComplexWarning
    with pytest.raises(TypeError, match="pydiff.full: fill_value: complex values"):
        pydiff.full((2,), 1 + 2j, device=device)
    np.testing.assert_array_equal(pydiff.full((2,), 3, device=device).numpy(), [3.0, 3.0])


@pytest.mark.parametrize("make", [pydiff.rand, pydiff.randn])
def test_random_values_into_an_integer_dtype_are_refused_by_name(device, make):
    name = make.__name__
    with pytest.raises(TypeError, match=f"pydiff.{name}: dtype='int', but random values are"):
        make(3, dtype="int", device=device)
    assert make(3, seed=1, dtype="half", device=device).dtype == "half"


# --- 2. (value, tangent) pairs as struct fields in .fwds -------------------------------------

STRUCT_SOURCE = """
struct Inner : IDifferentiable { float s; float t; };
struct Outer : IDifferentiable { Inner inner; float w; int k; };
struct Plain { float a; float b; };
[Differentiable] float so(Outer o, float x)
{ return o.w * sin(o.inner.s * x) + o.inner.t * o.inner.t * float(o.k); }
[Differentiable] float sp(Plain q, float x) { return q.a * x * x + q.b; }
"""


def _so64(s, t, w, x, k=3):
    return w * np.sin(s * x) + t * t * k


def _central(f, point, direction, h=1e-6):
    up = f(*(p + h * d for p, d in zip(point, direction)))
    down = f(*(p - h * d for p, d in zip(point, direction)))
    return (up - down) / (2 * h)


@pytest.fixture
def structs(device):
    return pydiff.load_module_from_source("s27_struct_pairs", STRUCT_SOURCE, device=device)


def test_fwds_takes_value_tangent_pairs_in_struct_fields(device, structs):
    S = np.array([0.5, -1.2, 2.0])
    US = np.array([1.0, -0.5, 0.25])
    X = np.array([0.3, 1.1, -0.7])
    t, ut, w, uw, ux = 0.8, -0.4, 1.5, 0.6, 0.9
    s = pydiff.tensor(S, device=device)
    y, dy = structs.so.fwds(
        {"inner": {"s": (s, US), "t": (t, ut)}, "w": (w, uw), "k": 3},
        (pydiff.tensor(X, device=device), np.full(3, ux)),
    )
    point = (S, np.full(3, t), np.full(3, w), X)
    direction = (US, np.full(3, ut), np.full(3, uw), np.full(3, ux))
    np.testing.assert_allclose(y.numpy(), _so64(*point), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dy.numpy(), _central(_so64, point, direction), rtol=1e-4, atol=1e-5)
    assert s.tangent is None  # the pair's tangent went with a view, not onto the user's tensor
    # numbers only: one value and its tangent
    y, dy = structs.so.fwds({"inner": {"s": 0.5, "t": (t, 1.0)}, "w": w, "k": 3}, 0.3)
    want = _central(lambda tt: _so64(0.5, tt, w, 0.3), (t,), (1.0,))
    assert y == pytest.approx(_so64(0.5, t, w, 0.3), rel=1e-6)
    assert dy == pytest.approx(want, rel=1e-5)


def test_struct_field_pairs_where_no_derivative_flows_warn_and_use_the_value(device, structs):
    from pydiff.errors import GradientFlowWarning

    with pytest.warns(GradientFlowWarning, match="'o.k'"):
        y, dy = structs.so.fwds({"inner": {"s": 0.5, "t": 0.8}, "w": 1.5, "k": (3, 1)}, 0.3)
    assert y == pytest.approx(_so64(0.5, 0.8, 1.5, 0.3), rel=1e-6)
    assert dy == 0.0
    with pytest.warns(GradientFlowWarning, match="not IDifferentiable"):
        y, dy = structs.sp.fwds({"a": (2.0, 1.0), "b": 1.0}, 3.0)
    assert (y, dy) == (pytest.approx(19.0), 0.0)


def test_struct_field_pairs_that_cannot_be_split_are_refused_by_field(device, structs):
    inner = {"s": 0.5, "t": 0.8}
    with pytest.raises(TypeError, match="parameter 'o' \\(Outer\\) at field 'inner' is given a"):
        structs.so.fwds({"inner": (inner, inner), "w": 1.5, "k": 3}, 0.3)
    s = pydiff.tensor([0.5, 1.0], device=device)
    with pytest.raises(ValueError, match="field 'inner.s'.*tangent has shape \\(3,\\)"):
        structs.so.fwds({"inner": {"s": (s, np.ones(3)), "t": 0.8}, "w": 1.5, "k": 3}, 0.3)


# --- 3. generic value parameters (vector<float, N>) through .fwds and hvp --------------------

X3 = np.array([[0.5, -1.2, 2.0], [1.5, 0.25, -0.7]])
U3 = np.array([[1.0, -0.5, 0.25], [0.3, 2.0, -1.0]])


def _vgen64(x):
    return np.sin(x) * x


def test_fwds_specialises_a_generic_vector_size(device, load):
    m = load("generic_sizes", device)
    want_y, want_dy = _vgen64(X3), _central(_vgen64, (X3,), (U3,))
    x = pydiff.tensor(X3, dtype="float3", device=device).with_tangent(U3)
    for given in (x, (X3, U3), (X3.astype(np.float32), U3)):
        y, dy = m.vgen.fwds(given)
        np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dy.numpy(), want_dy, rtol=1e-4, atol=1e-5)
    y, dy = m.vgen.fwds((X3[0].tolist(), U3[0].tolist()))  # one vector, as lists
    np.testing.assert_allclose(dy, want_dy[0], rtol=1e-4, atol=1e-5)
    import slangpy as spy

    y, dy = m.vgen.fwds((spy.float3(*X3[0]), spy.float3(*U3[0])))
    np.testing.assert_allclose(dy, want_dy[0], rtol=1e-4, atol=1e-5)
    # a generic element type T and size N at once: x0 x2, its tangent u0 x2 + x0 u2
    _, dy = m.vends.fwds(pydiff.tensor(X3, dtype="float3", device=device).with_tangent(U3))
    want = _central(lambda a: a[:, 0] * a[:, 2], (X3,), (U3,))
    np.testing.assert_allclose(dy.numpy(), want, rtol=1e-4, atol=1e-5)


def test_hvp_of_a_function_generic_over_a_vector_size(device, load):
    m = load("generic_sizes", device)
    (h,) = pydiff.hvp(m.vcube, (pydiff.tensor(X3, dtype="float3", device=device),), (U3,))
    np.testing.assert_allclose(h.numpy(), 6 * X3 * U3, rtol=1e-5)  # d2/dx2 sum x^3 = 6x


@pytest.mark.parametrize(
    "given",
    [
        lambda d: 2.0,
        lambda d: (2.0, 1.0),
        lambda d: pydiff.tensor([1.0, 2.0], device=d).with_tangent([1.0, 1.0]),
    ],
)
def test_a_generic_vector_size_no_argument_fixes_is_refused_by_name(device, load, given):
    m = load("generic_sizes", device)
    with pytest.raises(TypeError, match="vgen.fwds: parameter 'x' of vgen .*size N is a generic"):
        m.vgen.fwds(given(device))


def test_hvp_refuses_a_generic_vector_size_by_name(device, load):
    m = load("generic_sizes", device)
    with pytest.raises(TypeError, match="hvp of .*vcube: parameter 'x' .*size N is a generic"):
        pydiff.hvp(m.vcube, (pydiff.tensor([1.0, 2.0], device=device),), (np.ones(2),))


# --- 4. a float result written into a half _result where the result gets gradients ------------

NARROW_SOURCE = """
[Differentiable] float sq(float x) { return x * x * 1.5; }
[Differentiable] float3 sq3(float3 x) { return x * x; }
[Differentiable] half hsq(half x) { return x * x; }
"""
XN = np.array([1.2345678, -2.0, 0.3])


@pytest.fixture
def narrow(device):
    return pydiff.load_module_from_source("s27_narrow", NARROW_SOURCE, device=device)


def test_bwds_refuses_a_half_result_for_a_float_function(device, narrow):
    x = pydiff.tensor(XN, device=device, requires_grad=True)
    y = pydiff.zeros((3,), dtype="half", device=device).with_grads(ones=True)
    with pytest.raises(TypeError, match="s27_narrow.sq.bwds: _result is a half tensor but the "):
        narrow.sq.bwds(x, _result=y)
    with pytest.raises(TypeError, match="sq.bwds: _result is a half tensor"):
        narrow.sq.bwds(x, y)  # the result given positionally
    x3 = pydiff.tensor(np.ones((3, 3)), dtype="float3", device=device, requires_grad=True)
    if device.type == "cuda":  # half3 gradients are refused there (docs/devices.md)
        with pytest.raises(TypeError, match="gradients of 'half3' tensors on CUDA are refused"):
            pydiff.zeros((3,), dtype="half3", device=device).with_grads(ones=True)
    else:
        y3 = pydiff.zeros((3,), dtype="half3", device=device).with_grads(ones=True)
        with pytest.raises(TypeError, match="_result is a half3 tensor but the function returns"):
            narrow.sq3.bwds(x3, _result=y3)
    assert not x.grad.numpy().any() and not x3.grad.numpy().any()  # nothing ran
    # a half function into a float result (no rounding) and half into half stay allowed
    h = pydiff.tensor(XN, dtype="half", device=device, requires_grad=True)
    narrow.hsq.bwds(h, _result=pydiff.zeros((3,), device=device).with_grads(ones=True))
    np.testing.assert_allclose(h.grad.numpy(), 2 * XN.astype(np.float16), rtol=2e-3)


def test_a_tape_refuses_a_half_result_of_a_float_function_that_gets_gradients(device, narrow):
    x = pydiff.tensor(XN, device=device, requires_grad=True)
    with pydiff.Tape():
        with pytest.raises(TypeError, match="sq on a tape: _result is a half tensor"):
            narrow.sq(x, _result=pydiff.zeros((3,), dtype="half", device=device))
        # nothing wants a gradient: nothing to lose, the call narrows as off a tape
        c = pydiff.tensor(XN, device=device)
        narrow.sq(c, _result=pydiff.zeros((3,), dtype="half", device=device))
    # the way the message gives: a float result, then astype, which the tape records
    with pydiff.Tape() as tape:
        y = narrow.sq(x, _result="tensor").astype("half")
        loss = y.sum()
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 3.0 * XN, rtol=1e-6)  # d(1.5 x^2)


def test_a_forward_call_off_a_tape_narrows_into_a_half_result(device, narrow):
    x = pydiff.tensor(XN, device=device, requires_grad=True)
    y = narrow.sq(x, _result=pydiff.zeros((3,), dtype="half", device=device))
    want = (1.5 * XN.astype(np.float32) ** 2).astype(np.float16)
    np.testing.assert_allclose(y.numpy(), want, rtol=2**-10)


# --- 5. a backward from a tensor no call on the tape made says what did make it ---------------


@pytest.fixture
def sq(device):
    m = pydiff.load_module_from_source(
        "s27_unrecorded", "[Differentiable] float sq(float x) { return x * x; }", device=device
    )
    return m.sq


def _refusal(run) -> str:
    with pytest.raises(RuntimeError, match="not produced by") as info:
        run()
    return str(info.value)


def test_backward_from_a_result_of_another_tape_says_so(device, sq):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pydiff.Tape():
        y = sq(x, _result="tensor")
    with pydiff.Tape() as other:
        sq(x, _result="tensor")
    text = _refusal(lambda: other.backward(y, grad=np.ones(2)))
    assert "produced by a call recorded on another pydiff.Tape" in text
    y.backward(grad=np.ones(2))  # the way the message gives
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0])


def test_backward_from_a_call_with_no_input_requiring_a_gradient_says_so(device, sq):
    c = pydiff.tensor([1.0, 2.0], device=device)
    with pydiff.Tape() as tape:
        y = sq(c, _result="tensor")
        total = (c * 2.0).sum()
    text = _refusal(lambda: tape.backward(y, grad=np.ones(2)))
    assert "s27_unrecorded.sq computed it while a tape was recording" in text
    assert "none of the call's inputs requires a gradient" in text
    assert "requires_grad=True" in text
    text = _refusal(lambda: tape.backward(total))
    assert "_Sum computed it while a tape was recording" in text
    text = _refusal(lambda: tape.backward(y.reshape((2, 1)), grad=np.ones((2, 1))))
    assert "computed it while a tape was recording" in text  # a view of it


def test_backward_from_copies_and_calls_made_off_a_tape_says_so(device, sq):
    x = pydiff.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = sq(x, _result="tensor")
    text = _refusal(lambda: tape.backward(y[1:], grad=np.ones(2)))
    assert "_Take computed it off a tape" in text
    text = _refusal(lambda: tape.backward(y.clone(), grad=np.ones(3)))
    assert "a copy (clone() or copy_ off a tape)" in text
    off = sq(x, _result="tensor")
    text = _refusal(lambda: tape.backward(off, grad=np.ones(3)))
    assert "computed off a tape (no pydiff.Tape was recording)" in text
    text = _refusal(lambda: off.sum().backward())
    assert text.startswith("backward(): this tensor was not produced by a call recorded")
    assert "computed by _Sum.forward off a tape" in text
    text = _refusal(lambda: tape.backward(x, grad=np.ones(3)))
    assert "its values were written by a host write" in text and "a leaf" in text
