"""Calls that overwrite what they read through another parameter (issue 15, classes 1 and 6),
arguments a backward must not write, and tensors in struct (dict) arguments. A call that
writes a tensor it also reads through another parameter (an out or inout parameter, an
IRWDiffTensor, `_result`) is refused on a tape; off a tape its `.bwds` differentiates at the
values read (or is refused). References are float64 closed forms."""

import numpy as np
import pytest
import slangpy as spy

import pydiff

SOURCE = """
import slangpy;
struct P : IDifferentiable { float a; float b; }
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float times(float a, float b) { return a * b; }
[Differentiable] void sq_out(float x, out float y) { y = x * x; }
[Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
[Differentiable]
void sq_rw(int i, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> y) { y[i] = x[i] * x[i]; }
[Differentiable]
void count_rw(int i, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> y, RWTensor<float, 1> acc)
{ acc[i] = acc[i] + 1.0; y[i] = x[i] * acc[i]; }
[Differentiable]
void mark_w(int i, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> y, WTensor<float, 1> o)
{ o[i] = 5.0; y[i] = 2.0 * x[i]; }
[Differentiable] float counted(float x, inout int k) { k = k + 1; return x * float(k); }
[Differentiable] float dps(P p, float x) { return p.a * x + p.b * p.b; }
[Differentiable] void fill_p(float x, out P p) { p.a = x * x; p.b = 2.0 * x; }
[Differentiable] void field_out(P p, out float y) { y = p.a * p.b; }
void plain_square(inout float v) { v = v * v; }
"""
X = np.array([0.5, -1.25, 2.0])
S = np.array([3.0, -0.5, 1.5])
B = np.array([0.3, -1.0, 2.0])


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("inplace_aliasing", SOURCE, device=device)


def leaf(device, values=X):
    return pydiff.tensor(values, device=device, requires_grad=True)


# --- on a tape: a call may not overwrite its input through another parameter -------------


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda m, y: m.sq_out(y, y), ("'y'", "'x'")),
        (lambda m, y: m.scale_inout(y, y), ("'v'", "'s'")),
        (lambda m, y: m.sq_rw(spy.grid((3,)), y, y), ("'y'", "'x'")),
        (lambda m, y: m.sq(y, _result=y), ("_result", "'x'")),
        (lambda m, y: m.field_out({"a": y, "b": y}, y), ("'y'", "'p'")),
    ],
    ids=["out", "inout", "irw_tensor", "result", "struct_field"],
)
def test_tape_refuses_a_call_writing_its_own_input(device, m, call, names):
    w = leaf(device)
    with pydiff.Tape():
        y = m.sq(w, _result="tensor")  # X^2, wants a gradient
        with pytest.raises(ValueError, match="may not overwrite its own input") as info:
            call(m, y)
    for name in names:
        assert name in str(info.value)
    np.testing.assert_allclose(y.numpy(), X**2, rtol=1e-6)  # refused before it ran


def test_tape_allows_aliasing_when_no_gradient_is_wanted(device, m):
    y = pydiff.tensor(X, device=device)  # constants: nothing is recorded
    with pydiff.Tape():
        m.sq_out(y, y)
        m.scale_inout(y, y)
    np.testing.assert_allclose(y.numpy(), X**4, rtol=1e-5)


def test_the_way_out_gives_the_right_gradient(device, m):
    w = leaf(device)
    with pydiff.Tape() as tape:
        y = m.sq(w, _result="tensor")  # w^2
        z = pydiff.zeros((3,), device=device)
        m.sq_out(y, z)  # w^4
    tape.backward(z, grad=np.ones(3))
    np.testing.assert_allclose(w.grad.numpy(), 4 * X**3, rtol=1e-5)


# --- off a tape: .bwds after such a call differentiates at the values read ----------------


def test_bwds_after_writing_an_input_through_result(device, m):
    x = leaf(device)
    m.sq(x, _result=x)  # x <- x^2, in place through the result
    m.sq.bwds(x, _result=x.with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)  # at X, not at X^2
    np.testing.assert_allclose(x.numpy(), X**2, rtol=1e-6)  # .bwds left the values alone


def test_bwds_after_writing_an_input_through_an_out_parameter(device, m):
    x = leaf(device)
    m.sq_out(x, x)
    seeded = x.with_grads(pydiff.tensor([1.0, 2.0, -1.0], device=device))
    m.sq_out.bwds(x, seeded)
    np.testing.assert_allclose(x.grad.numpy(), 2 * X * [1.0, 2.0, -1.0], rtol=1e-6)


def test_bwds_after_aliasing_without_a_kept_copy_is_refused(device, m):
    x = pydiff.tensor(X, device=device)  # no gradient buffers at the call: nothing kept
    m.sq(x, _result=x)
    with pytest.raises(ValueError, match=r"parameter 'x' .*overwritten by .*sq"):
        m.sq.bwds(x.with_grads(), _result=pydiff.zeros((3,), device=device).with_grads())


def test_bwds_with_a_written_parameter_sharing_an_input_gradient_is_refused(device, m):
    y = leaf(device)
    with pytest.raises(ValueError, match="parameter 'v''s gradient buffer is also .* 's'"):
        m.scale_inout.bwds(y, y)
    np.testing.assert_array_equal(y.grad.numpy(), np.zeros(3))


# --- a backward never writes the caller's values ------------------------------------------


def test_bwds_leaves_plain_rw_and_write_only_tensors_alone(device, m):
    x = leaf(device)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    acc = pydiff.tensor([1.0, 2.0, 3.0], device=device)
    m.count_rw.bwds(spy.grid((3,)), x, y, acc)
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 3.0, 4.0], rtol=1e-6)  # acc + 1
    np.testing.assert_array_equal(acc.numpy(), [1.0, 2.0, 3.0])
    o = pydiff.tensor([7.0, 8.0, 9.0], device=device)
    x.zero_grad()
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)  # y.grad is now dL/dy before
    m.mark_w.bwds(spy.grid((3,)), x, y, o)
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0, 2.0], rtol=1e-6)
    np.testing.assert_array_equal(o.numpy(), [7.0, 8.0, 9.0])


def test_repeated_tape_backward_over_a_plain_rw_tensor(device, m):
    x = leaf(device)
    y = pydiff.zeros((3,), device=device)
    acc = pydiff.tensor([1.0, 2.0, 3.0], device=device)
    with pydiff.Tape() as tape:
        m.count_rw(spy.grid((3,)), x, y, acc)  # y = x (acc + 1)
    assert not acc.requires_grad  # no gradient flows through a RWTensor
    for _ in range(3):
        x.zero_grad()
        tape.backward(y, grad=np.ones(3))
        np.testing.assert_allclose(x.grad.numpy(), [2.0, 3.0, 4.0], rtol=1e-6)
    np.testing.assert_array_equal(acc.numpy(), [2.0, 3.0, 4.0])  # the forward's write only


def test_int_inout_counter_on_a_tape(device, m):
    x = leaf(device)
    k = pydiff.tensor(np.array([1, 2, 3]), dtype="int", device=device)
    with pydiff.Tape() as tape:
        y = m.counted(x, k, _result="tensor")  # x (k + 1)
    for _ in range(2):
        x.zero_grad()
        tape.backward(y, grad=np.ones(3))
        np.testing.assert_allclose(x.grad.numpy(), [2.0, 3.0, 4.0], rtol=1e-6)
    np.testing.assert_array_equal(k.numpy(), [2, 3, 4])


def test_int_inout_counter_bwds_after_the_call_is_refused_with_a_fix(device, m):
    x = leaf(device)
    k = pydiff.tensor(np.array([1, 2, 3]), dtype="int", device=device)
    before = k.clone()
    y = m.counted(x, k, _result="tensor")
    with pytest.raises(ValueError, match=r"parameter 'k' .*k\.clone\(\)") as info:
        m.counted.bwds(x, k, y.with_grads(ones=True))
    assert "requires_grad" not in str(info.value)  # an int tensor cannot have gradients
    m.counted.bwds(x, before, y.with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 3.0, 4.0], rtol=1e-6)


def test_non_differentiable_in_place_call_passes_no_gradient_through(device, m):
    v, x = leaf(device), leaf(device, S)
    with pytest.warns(pydiff.GradientFlowWarning, match="plain_square"):
        with pydiff.Tape() as tape:
            m.plain_square(v)
            z = m.times(v, x, _result="tensor")
        tape.backward(z, grad=np.ones(3))
    np.testing.assert_array_equal(v.grad.numpy(), np.zeros(3))  # none flows to v before
    np.testing.assert_allclose(x.grad.numpy(), X**2, rtol=1e-6)


# --- tensors in struct (dict) arguments ---------------------------------------------------


def test_tape_records_a_call_with_gradients_only_in_struct_fields(device, m):
    a, b = leaf(device), leaf(device, B)
    x = pydiff.tensor(X, device=device)
    with pydiff.Tape() as tape:
        y = m.dps({"a": a, "b": b}, x, _result="tensor")  # a x + b^2
    tape.backward(y, grad=np.array([1.0, -2.0, 0.5]))
    np.testing.assert_allclose(a.grad.numpy(), X * [1.0, -2.0, 0.5], rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), 2 * B * [1.0, -2.0, 0.5], rtol=1e-6)


@pytest.mark.parametrize("first_all", [True, False])
def test_struct_fields_with_and_without_gradients_in_either_order(device, m, first_all):
    a, b, x = leaf(device), leaf(device, B), leaf(device)
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    calls = [{"a": a, "b": b}, {"a": pydiff.tensor(X, device=device), "b": b}]
    for arg in calls if first_all else calls[::-1]:
        m.dps.bwds(arg, x, _result=y)
    np.testing.assert_allclose(b.grad.numpy(), 2 * 2 * B, rtol=1e-6)  # both calls
    np.testing.assert_allclose(a.grad.numpy(), X, rtol=1e-6)  # only the call with a's grads


def test_reset_policy_applies_to_struct_fields(device, m):
    a, b, x = leaf(device), leaf(device, B), leaf(device)
    a.zero_policy = "reset"
    y = pydiff.zeros((3,), device=device).with_grads(ones=True)
    for _ in range(2):
        m.dps.bwds({"a": a, "b": b}, x, _result=y)
    np.testing.assert_allclose(a.grad.numpy(), X, rtol=1e-6)  # replaced, not added
    np.testing.assert_allclose(b.grad.numpy(), 2 * 2 * B, rtol=1e-6)  # accumulated


def test_written_struct_argument_is_refused_in_bwds_and_on_a_tape(device, m):
    x = leaf(device)
    p = {"a": pydiff.zeros((3,), device=device), "b": pydiff.zeros((3,), device=device)}
    with pytest.raises(TypeError, match=r"fill_p.bwds: parameter 'p' is an out P .* dict"):
        m.fill_p.bwds(x, p)
    with pydiff.Tape():
        with pytest.raises(TypeError, match=r"fill_p on a tape: parameter 'p'"):
            m.fill_p(x, p)
    np.testing.assert_array_equal(p["a"].numpy(), np.zeros(3))  # refused before it ran
    m.fill_p(x, p)  # off a tape the forward call works
    np.testing.assert_allclose(p["a"].numpy(), X**2, rtol=1e-6)


def test_writes_through_struct_fields_count_for_the_tape(device, m):
    a, b = leaf(device), leaf(device, B)
    with pydiff.Tape() as tape:
        y = m.dps({"a": a, "b": b}, pydiff.tensor(X, device=device), _result="tensor")
        m.fill_p(pydiff.tensor(S, device=device), {"a": a, "b": b})  # overwrites a and b
    with pytest.raises(RuntimeError, match="overwritten by .*fill_p"):
        tape.backward(y, grad=np.ones(3))
