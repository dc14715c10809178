"""Calls refused (or warned) before anything runs, on the generated path and SlangPy's alike:
two written parameters on one storage (a wrong gradient otherwise), slices and transposes
made off a tape given to `.bwds` (a gradient silently lost otherwise), `_result`s and host
numbers SlangPy would report with raw errors, numbers that round to the largest float, and
a STRICT refusal that must leave RESET buffers as they were. Expected values are closed
forms."""

import decimal
import fractions
import warnings

import numpy as np
import pytest

import pydiff
from pydiff import generated

SOURCE = """
[Differentiable] void two_out(float x, out float y, out float z) { y = x * 2.0; z = x * 3.0; }
[Differentiable] float r_out(float x, out float y) { y = x * 2.0; return x * 3.0; }
[Differentiable] void two_inout(inout float a, inout float b) { a = a * 2.0; b = b * 3.0; }
[Differentiable] float f(float a, float x) { return a * x * x; }
[Differentiable] half h(half x) { return x; }
[Differentiable] int k(int i) { return i + 1; }
struct S : IDifferentiable { float a; };
[Differentiable] S mk(float x) { S s; s.a = x; return s; }
"""
X = np.array([1.0, 2.0, -3.0])


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("call_refusals", SOURCE, device=device)


@pytest.fixture(params=["generated", "slangpy"])
def path(request, monkeypatch):
    """Both call paths: every covered call through a generated kernel, or none."""
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    monkeypatch.setenv("PYDIFF_GENERATED", "1" if request.param == "generated" else "0")
    return request.param


def _t(device, values, **kw):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, **kw)


# ------------------------------------------------- two written parameters on one storage


def test_two_outs_on_one_tensor_refused(device, m, path):
    x, y = _t(device, X, requires_grad=True), pydiff.zeros((3,), device=device)
    y.requires_grad_()
    for second in (lambda: y, lambda: y.reshape((3,)), lambda: y.reshape((3, 1)).reshape(3)):
        with pytest.raises(ValueError, match="parameter 'y' and parameter 'z'"):
            m.two_out(x, y, second())
        np.testing.assert_array_equal(y.numpy(), np.zeros(3))  # nothing ran
        y.grad.fill(1.0)
        with pytest.raises(ValueError, match="parameter 'y' and parameter 'z'"):
            m.two_out.bwds(x, y, second())
        np.testing.assert_array_equal(x.grad.numpy(), np.zeros(3))
    with pytest.raises(ValueError, match="parameter 'y' and parameter 'z'"), pydiff.Tape():
        m.two_out(x, y, y)
    # Separate tensors: d(2x + 3x)/dx with both upstreams 1 is 5 (closed form).
    z = pydiff.zeros((3,), device=device, requires_grad=True)
    m.two_out(x, y, z)
    y.grad.fill(1.0)
    z.grad.fill(1.0)
    m.two_out.bwds(x, y, z)
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 5.0))


def test_out_and_result_on_one_tensor_refused(device, m, path):
    x, y = _t(device, X, requires_grad=True), pydiff.zeros((3,), device=device)
    y.requires_grad_()
    with pytest.raises(ValueError, match="parameter 'y' and _result"):
        m.r_out(x, y, _result=y)
    with pytest.raises(ValueError, match="parameter 'y' and _result"):
        m.r_out.bwds(x, y, _result=y.reshape((3,)))
    a = _t(device, X, requires_grad=True)
    with pytest.raises(ValueError, match="parameter 'a' and parameter 'b'"):
        m.two_inout(a, a)
    np.testing.assert_array_equal(a.numpy(), X.astype(np.float32))


def test_forward_plan_declines_two_outs_on_one_tensor(device, m):
    """A layout run before with separate tensors has a plan; the same layout with one
    tensor twice must still be refused (the plan declines to the full path)."""
    x = _t(device, X[:2])
    y, z = pydiff.zeros((2,), device=device), pydiff.zeros((2,), device=device)
    for _ in range(3):
        m.two_out(x, y, z)
    np.testing.assert_allclose(z.numpy(), 3 * X[:2])
    with pytest.raises(ValueError, match="parameter 'y' and parameter 'z'"):
        m.two_out(x, y, y)


# ------------------------------------------------- copies made off a tape given to .bwds


def test_bwds_on_slice_made_off_tape_warns(device, m, path):
    base = np.arange(6.0).reshape(2, 3)
    for k, make in enumerate((lambda x: x[:, 1:], lambda x: x.T)):
        x = _t(device, base, requires_grad=True)
        # A call site of its own per path (a warning is said once per line of user code).
        site = compile("m.f.bwds(2.0, s, _result=1.0)", f"<bwds {path} {k}>", "exec")
        with pytest.warns(pydiff.GradientFlowWarning, match="parameter 'x'.*off a tape"):
            exec(site, {"m": m, "s": make(x)})
        np.testing.assert_array_equal(x.grad.numpy(), np.zeros((2, 3)))
        # .detach() says no gradient is wanted: quiet.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m.f.bwds(2.0, make(x).detach(), _result=1.0)
    # On a tape the slice carries the gradient back: d(2 s^2)/ds = 4 s (closed form).
    x = _t(device, base, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.f(2.0, x[:, 1:], _result="tensor")
    tape.backward(y, grad=np.ones((2, 2)))
    expected = np.zeros((2, 3))
    expected[:, 1:] = 4 * base[:, 1:]
    np.testing.assert_allclose(x.grad.numpy(), expected)


# ------------------------------------------------- .fwds _result, raw-error arguments


def test_fwds_result_tensor_or_array_refused(device, m):
    x = _t(device, X).with_tangent(np.ones(3))
    for bad in (pydiff.zeros((3,), device=device), np.zeros(3, np.float32)):
        with pytest.raises(TypeError, match=r"call_refusals\.f\.fwds: _result is a"):
            m.f.fwds(2.0, x, _result=bad)
    with pytest.raises(ValueError, match="use 'tensor' or 'numpy'"):
        m.f.fwds(2.0, x, _result="bogus")


def test_unusual_scalars(device, m, path):
    x = _t(device, X)
    for bad in (1 + 2j, np.complex64(1.0), "1.5", b"1"):
        with pytest.raises(TypeError, match=r"call_refusals\.f: parameter 'a' \(float\)"):
            m.f(bad, x, _result="numpy")
    for exact in (np.longdouble(1.5), decimal.Decimal("1.5"), fractions.Fraction(3, 2)):
        np.testing.assert_allclose(m.f(exact, x, _result="numpy"), 1.5 * X * X, rtol=1e-6)
    with pytest.raises(ValueError, match="parameter 'a'.*would become inf"):
        m.f(decimal.Decimal("1e400"), x)
    with pytest.raises(ValueError, match="parameter 'i'.*truncate"):
        m.k(fractions.Fraction(3, 2))


def test_wrong_result_types_refused(device, m, path):
    x = _t(device, np.ones(4))
    bad = pydiff.zeros((4,), dtype="float2", device=device)
    with pytest.raises(ValueError, match=r"call_refusals\.f: _result has dtype float2"):
        m.f(2.0, x, _result=bad)
    with pytest.raises(TypeError, match=r"call_refusals\.mk: _result='numpy'.*returns S"):
        m.mk(np.ones(3, np.float32), _result="numpy")


# ------------------------------------------------- numbers at the top of float and half


def test_numbers_rounding_to_the_largest_float_accepted(device, m, path):
    top = float(np.finfo(np.float32).max)
    x = _t(device, [1.0])
    # 3.4028235e38 (FLT_MAX's repr) rounds to FLT_MAX; 2^128 (1 - 2^-25) is the tie to inf.
    np.testing.assert_array_equal(m.f(3.4028235e38, x, _result="numpy"), [top])
    edge = 2.0**128 * (1 - 2.0**-25)
    np.testing.assert_array_equal(m.f(np.nextafter(edge, 0), x, _result="numpy"), [top])
    for v in (edge, -edge, 2**128):
        with pytest.raises(ValueError, match="would become inf"):
            m.f(v, x)
    np.testing.assert_array_equal(m.h(65519.0, _result="numpy"), 65504.0)
    with pytest.raises(ValueError, match="would become inf"):
        m.h(65520.0)


# ------------------------------------------------- a refused .bwds changes no gradient


def test_strict_refusal_leaves_reset_buffers(device, m, path):
    n = 8
    xs = np.linspace(-1, 1, n)
    x = _t(device, xs, requires_grad=True)
    a = _t(device, [2.0], requires_grad=True)
    a.zero_policy = pydiff.ZeroPolicy.RESET
    x.zero_policy = pydiff.ZeroPolicy.STRICT
    y = m.f(a, x, _result="tensor").with_grads(ones=True)
    m.f.bwds(a, x, _result=y)
    sum_x2 = np.sum(xs.astype(np.float32).astype(np.float64) ** 2)  # d(sum a x^2)/da
    np.testing.assert_allclose(a.grad.numpy(), [sum_x2], rtol=1e-5)
    with pytest.raises(pydiff.StaleGradientError, match="parameter 'x'"):
        m.f.bwds(a, x, _result=y)
    np.testing.assert_allclose(a.grad.numpy(), [sum_x2], rtol=1e-5)  # not zeroed
