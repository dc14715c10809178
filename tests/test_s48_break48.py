"""break48: cases a new user met, each against an independent reference (float64 NumPy closed
forms), each failing before its fix.

- Overloads of one name merged their ``no_diff`` markings (lint_nodiff keyed parameters by
  the function's name): ``f(idx, x, no_diff y, s)`` beside ``f(idx, x, y)`` made the second
  overload's ``y`` no_diff too, and its ``.bwds`` gave ``x.grad`` = 0 where 2x is right,
  with a GradientFlowWarning claiming ``y`` is no_diff. Each overload now takes the markings
  of the definition with its own parameters (``lint_nodiff.marked_params``).
- Definitions of as many parameters that mark ``no_diff`` differently (overloads of one
  arity, which SlangPy picks between by type; both branches of an ``#if`` the scan cannot
  decide): which one runs is unknown, so ``.bwds`` (and a tape's backward through the call)
  is refused by name (``ShaderTrapError``, file and line) where the other's marking
  silently dropped the gradient (test_s34_break34's xfail).
- A tensor of the wrong dtype at a ``double``/``int64_t``/``uint64_t`` parameter was told to
  convert with ``pydiff.tensor(x.numpy().astype(np.float64))``, which makes a float (int)
  tensor again: the same TypeError. The advice now names ``dtype=`` and works.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff.errors import GradientFlowWarning

OVERLOADS = """import slangpy;
[Differentiable]
void f(int idx, IDiffTensor<float, 1> x, no_diff IWDiffTensor<float, 1> y, float s)
{ float v = x[idx]; y[idx] = v * s; }
[Differentiable]
void f(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = v * v; }
"""


@pytest.fixture
def xs():
    return np.linspace(-1.0, 1.0, 64, dtype=np.float32)


def test_an_overload_keeps_its_own_no_diff_markings(device, xs):
    m = pydiff.load_module_from_source("s48_overloads", OVERLOADS, device=device)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros((64,), device=device).with_grads(ones=True)
    m.f(spy.grid((64,)), x, y)
    np.testing.assert_allclose(y.numpy(), xs.astype(np.float64) ** 2, rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFlowWarning)  # (y is not no_diff here)
        m.f.bwds(spy.grid((64,)), x, y)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * xs.astype(np.float64), rtol=1e-6, atol=1e-7)


def test_the_no_diff_overload_still_gives_no_gradient_through_its_output(device, xs):
    m = pydiff.load_module_from_source("s48_overloads_b", OVERLOADS, device=device)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros((64,), device=device).with_grads(ones=True)
    m.f(spy.grid((64,)), x, y, 3.0)
    np.testing.assert_allclose(y.numpy(), 3.0 * xs.astype(np.float64), rtol=1e-6)
    with pytest.warns(GradientFlowWarning, match="'y' is no_diff"):
        m.f.bwds(spy.grid((64,)), x, y, 3.0)
    np.testing.assert_array_equal(x.grad.numpy(), 0.0)  # y = 3x stored no_diff: nothing to x


def test_an_overload_on_a_tape_gets_its_gradient(device, xs):
    m = pydiff.load_module_from_source("s48_overloads_c", OVERLOADS, device=device)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = pydiff.zeros((64,), device=device, requires_grad=True)
        m.f(spy.grid((64,)), x, y)
    tape.backward(y, grad=pydiff.ones((64,), device=device))
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * xs.astype(np.float64), rtol=1e-6, atol=1e-7)


UNDECIDED = """import slangpy;
#ifdef S48_NEVER_DEFINED
[Differentiable]
void f(int idx, IDiffTensor<float, 1> x, no_diff IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = v * v; }
#else
[Differentiable]
void f(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = v * v; }
#endif
[Differentiable] float sq(float x) { return x * x; }
"""


def test_an_undecided_no_diff_is_refused_on_a_tape_too(device, xs):
    m = pydiff.load_module_from_source("s48_undecided", UNDECIDED, device=device)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = pydiff.zeros((64,), device=device, requires_grad=True)
        m.f(spy.grid((64,)), x, y)  # (the forward call is fine: no_diff changes no value)
    np.testing.assert_allclose(y.numpy(), xs.astype(np.float64) ** 2, rtol=1e-6)
    with pytest.raises(pydiff.ShaderTrapError, match=r"<s48_undecided>:4: in f\(\).*'y'"):
        tape.backward(y, grad=pydiff.ones((64,), device=device))
    np.testing.assert_array_equal(x.grad.numpy(), 0.0)
    # the module's other functions are untouched
    x.zero_grad()
    s = m.sq(x, _result="tensor").with_grads(ones=True)
    m.sq.bwds(x, _result=s)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * xs.astype(np.float64), rtol=1e-6)


SAME_ARITY = """import slangpy;
[Differentiable]
void f(int i, IDiffTensor<float, 1> x, no_diff IWDiffTensor<float, 1> y)
{ float v = x[i]; y[i] = v * 3.0; }
[Differentiable]
void f(int i, IDiffTensor<half, 1> x, IWDiffTensor<half, 1> y)
{ half v = x[i]; y[i] = v * v; }
"""


def test_same_arity_overloads_marking_no_diff_differently_are_refused(device):
    # SlangPy picks the half overload by the tensors' types; pydiff read the float one's
    # no_diff y for it: x.grad = 0 where 2x is right, with a GradientFlowWarning saying y is
    # no_diff. Which overload runs is SlangPy's choice: refused by name.
    m = pydiff.load_module_from_source("s48_same_arity", SAME_ARITY, device=device)
    xs = np.linspace(-1.0, 1.0, 12).astype(np.float16)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    y = pydiff.zeros((12,), dtype="half", device=device).with_grads(ones=True)
    m.f(spy.grid((12,)), x, y)
    np.testing.assert_allclose(y.numpy(), xs.astype(np.float64) ** 2, atol=1e-3)
    with pytest.raises(pydiff.ShaderTrapError, match=r"'y' are no_diff.*overloads"):
        m.f.bwds(spy.grid((12,)), x, y)
    np.testing.assert_array_equal(x.grad.numpy(), 0.0)


CASTS = """
double twice_d(double x) { return 2.0 * x; }
int64_t twice_l(int64_t k) { return 2 * k; }
uint64_t twice_u(uint64_t k) { return 2 * k; }
"""


@pytest.mark.parametrize(
    "name, given",
    [("twice_d", np.float32), ("twice_l", np.int32), ("twice_u", np.int32), ("twice_d", np.int32)],
)
def test_the_conversion_advice_works_as_written(device, name, given):
    m = pydiff.load_module_from_source("s48_casts", CASTS, device=device)
    values = np.array([1, 3, 5, 2**20], dtype=given)
    x = pydiff.tensor(values, device=device)
    with pytest.raises(TypeError, match=r"Convert it first") as err:
        getattr(m, name)(x, _result="tensor")
    advice = re.search(r"e\.g\. (pydiff\.tensor\(.*\))$", str(err.value)).group(1)
    converted = eval(advice, {"pydiff": pydiff, "np": np, "x": x})  # what the message says
    out = getattr(m, name)(converted, _result="tensor")
    np.testing.assert_array_equal(out.numpy(), 2 * values.astype(np.float64))


# Overloads of one arity: the call goes to the one that takes the tensors' element types (as
# SlangPy picks), and pydiff's bookkeeping follows it. Before break48 the first overload of the
# arity was taken: the half one's signature (x only read) for a call SlangPy ran on the float
# inout overload, so x's version never moved.
INOUT_OVERLOADS = """
[Differentiable] void k(float a, inout float x) { x = a * x * x; }
[Differentiable] half k(half a, half x) { return a * x; }
[Differentiable] float cube(float x) { return x * x * x; }
"""
XF = np.array([0.5, 1.0, 1.5, 2.0], np.float32)


def test_an_inout_overload_write_is_seen_by_a_tape(device):
    m = pydiff.load_module_from_source("s48_inout_overloads", INOUT_OVERLOADS, device=device)
    x = pydiff.tensor(XF, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.cube(x)
    m.k(2.0, x)  # off the tape: x = 2 x^2 in place
    np.testing.assert_allclose(x.numpy(), 2.0 * XF.astype(np.float64) ** 2)
    # (before: x.grad = 3 (2 x^2)^2, the gradient at the overwritten values, silently)
    with pytest.raises(pydiff.StaleInputError, match=r"'x'.*overwritten by s48_inout_overloads\.k"):
        tape.backward(y, grad=pydiff.ones((4,), device=device))
    y = m.cube(x, _result="tensor").with_grads(ones=True)
    m.k(2.0, x)
    with pytest.raises(ValueError, match=r"parameter 'x'"):
        m.cube.bwds(x, _result=y)


def test_an_inout_overload_gets_its_gradients(device):
    m = pydiff.load_module_from_source("s48_inout_overloads_b", INOUT_OVERLOADS, device=device)
    xs = XF.astype(np.float64)
    a = pydiff.tensor(np.full(4, 2.0, np.float32), device=device, requires_grad=True)
    x = pydiff.tensor(XF, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        m.k(a, x)
    tape.backward(x, grad=pydiff.ones((4,), device=device))
    np.testing.assert_allclose(x.grad.numpy(), 4.0 * xs, rtol=1e-6)  # d(a x^2)/dx = 2 a x
    np.testing.assert_allclose(a.grad.numpy(), xs**2, rtol=1e-6)


VALUE_OVERLOADS = """
[Differentiable] float k(float a, float x) { return a * x; }
[Differentiable] void k(half a, inout half x) { x = a * x * x; }
"""


def test_the_float_overload_runs_for_float_tensors(device):
    # (before: the half inout overload's wrapper was called: SlangPy's raw TypeError)
    m = pydiff.load_module_from_source("s48_value_overloads", VALUE_OVERLOADS, device=device)
    a = pydiff.tensor(np.full(4, 2.0, np.float32), device=device, requires_grad=True)
    x = pydiff.tensor(XF, device=device, requires_grad=True)
    r = m.k(a, x, _result="tensor").with_grads(ones=True)
    np.testing.assert_allclose(r.numpy(), 2.0 * XF.astype(np.float64))
    m.k.bwds(a, x, _result=r)
    np.testing.assert_allclose(x.grad.numpy(), 2.0)
    np.testing.assert_allclose(a.grad.numpy(), XF.astype(np.float64))


def test_overloads_fitting_alike_that_write_differently_are_refused(device):
    src = """
[Differentiable] void w(half a, inout float x) { x = float(a) * x; }
[Differentiable] float w(float a, float x) { return a * x; }
"""
    m = pydiff.load_module_from_source("s48_unclear_overloads", src, device=device)
    x = pydiff.tensor(XF, device=device)
    with pytest.raises(TypeError, match=r"differ in whether the call writes parameter 1 \('x'\)"):
        m.w(2.0, x)
    np.testing.assert_array_equal(x.numpy(), XF)  # nothing ran
