"""`.bwds` of a call that reads and writes a tensor (issue 15, class 1): it never
differentiates at the value the call wrote. Explicit `.bwds` on a tensor the same function
just overwrote is refused; on a copy of the value before the call, or on a tape, it is right;
and `.bwds` leaves its arguments' values as they were. References are closed forms."""

import numpy as np
import pytest

import pydiff

SOURCE = """
import slangpy;
[Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
[Differentiable]
void square_inplace(int i, IRWDiffTensor<float, 1> data) { data[i] = data[i] * data[i]; }
[Differentiable] void cube_out(float x, out float y) { y = x * x * x; }
[Differentiable] float sq(float x) { return x * x; }
"""
V, S = np.array([0.5, -1.25, 2.0]), np.array([3.0, -0.5, 1.5])


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("inplace_bwds", SOURCE, device=device)


def test_bwds_after_an_inout_call_on_the_same_tensor_is_refused(device, m):
    s = pydiff.tensor(S, device=device, requires_grad=True)
    v = pydiff.tensor(V, device=device)  # no gradient buffers at the call: nothing kept
    m.scale_inout(s, v)
    with pytest.raises(ValueError, match=r"parameter 'v' .* overwritten by .*scale_inout"):
        m.scale_inout.bwds(s, v.with_grads(ones=True))
    np.testing.assert_array_equal(s.grad.numpy(), np.zeros(3))


@pytest.mark.parametrize("calls", [1, 2])
def test_bwds_after_an_in_place_call_uses_the_value_read(device, m, calls):
    s = pydiff.tensor(S, device=device, requires_grad=True)
    v = pydiff.tensor(V, device=device, requires_grad=True)
    read = V * S ** (calls - 1)  # the value the last call read
    for _ in range(calls):
        m.scale_inout(s, v)
    v.grad.fill(1.0)  # dL/d(v after)
    m.scale_inout.bwds(s, v)
    np.testing.assert_allclose(s.grad.numpy(), read, rtol=1e-6)  # not v*s*u
    np.testing.assert_allclose(v.grad.numpy(), S, rtol=1e-6)  # dL/d(v before) = s
    np.testing.assert_allclose(v.numpy(), read * S, rtol=1e-6)  # values untouched


def test_irw_tensor_bwds_after_the_call_uses_the_value_read(device, m):
    x = pydiff.tensor(V, device=device, requires_grad=True)
    m.square_inplace(spy_grid(3), x)
    up = np.array([1.0, 2.0, -1.0])
    x.grad.copy_from_numpy(up)
    m.square_inplace.bwds(spy_grid(3), x)
    np.testing.assert_allclose(x.grad.numpy(), 2 * V * up, rtol=1e-6)
    np.testing.assert_allclose(x.numpy(), V**2, rtol=1e-6)


def test_a_later_write_drops_the_kept_value(device, m):
    s = pydiff.tensor(S, device=device, requires_grad=True)
    v = pydiff.tensor(V, device=device, requires_grad=True)
    m.scale_inout(s, v)
    v.copy_from_numpy(V)  # the caller restores the values: the kept copy is stale
    v.grad.fill(1.0)
    m.scale_inout.bwds(s, v)  # differentiates at V, the values given
    np.testing.assert_allclose(s.grad.numpy(), V, rtol=1e-6)


def test_bwds_after_an_irw_tensor_call_on_the_same_tensor_is_refused(device, m):
    x = pydiff.tensor(V, device=device)  # no gradient buffers at the call
    m.square_inplace(spy_grid(3), x)
    with pytest.raises(ValueError, match=r"parameter 'data' .*clone\(\)"):
        m.square_inplace.bwds(spy_grid(3), x.with_grads(ones=True))


def spy_grid(n):
    import slangpy as spy

    return spy.grid((n,))


def test_bwds_on_a_copy_before_the_call_is_right(device, m):
    s = pydiff.tensor(S, device=device, requires_grad=True)
    v = pydiff.tensor(V, device=device)
    before = v.clone()
    m.scale_inout(s, v)
    np.testing.assert_allclose(v.numpy(), S * V, rtol=1e-6)
    seeded = before.with_grads(ones=True)
    m.scale_inout.bwds(s, seeded)
    np.testing.assert_allclose(s.grad.numpy(), V, rtol=1e-6)  # d(s v)/ds = v (read value)
    np.testing.assert_allclose(seeded.grad.numpy(), S, rtol=1e-6)  # dL/dv_before = s
    np.testing.assert_allclose(before.numpy(), V, rtol=1e-6)  # .bwds left the values alone


def test_irw_tensor_on_a_tape_differentiates_at_the_value_read(device, m):
    x = pydiff.tensor(V, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        m.square_inplace(spy_grid(3), x)
        y = m.sq(x, _result="tensor")  # y = x^4
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(y.numpy(), V**4, rtol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), 4 * V**3, rtol=1e-5)


def test_bwds_leaves_out_and_result_values_alone(device, m):
    x = pydiff.tensor(V, device=device, requires_grad=True)
    y = pydiff.tensor(np.full(3, 7.0), device=device).with_grads(ones=True)
    m.cube_out.bwds(x, y)
    np.testing.assert_array_equal(y.numpy(), np.full(3, 7.0))  # not overwritten with x^3
    np.testing.assert_allclose(x.grad.numpy(), 3 * V**2, rtol=1e-6)
    r = pydiff.tensor(np.full(3, -1.0), device=device).with_grads(ones=True)
    x.zero_grad()
    m.sq.bwds(x, _result=r)
    np.testing.assert_array_equal(r.numpy(), np.full(3, -1.0))
    np.testing.assert_allclose(x.grad.numpy(), 2 * V, rtol=1e-6)


def test_repeated_tape_backward_over_in_place_calls(device, m):
    s = pydiff.tensor(S, device=device, requires_grad=True)
    x = pydiff.tensor(V, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        v = m.sq(x, _result="tensor")  # x^2
        m.scale_inout(s, v)  # s x^2
        m.scale_inout(s, v)  # s^2 x^2
    for _ in range(3):
        s.zero_grad()
        x.zero_grad()
        tape.backward(v, grad=np.ones(3))
        np.testing.assert_allclose(v.numpy(), S**2 * V**2, rtol=1e-5)
        np.testing.assert_allclose(s.grad.numpy(), 2 * S * V**2, rtol=1e-5)
        np.testing.assert_allclose(x.grad.numpy(), 2 * S**2 * V, rtol=1e-5)


def test_kept_value_of_a_view_is_not_used_for_another_shape(device, m):
    s = pydiff.tensor([2.0], device=device, requires_grad=True)
    x = pydiff.tensor(np.array([0.5, -1.0, 2.0, 3.0]), device=device, requires_grad=True)
    view = x.reshape((2, 2)).with_grads(ones=True)
    m.scale_inout(s, view)  # the values read are kept, shaped (2, 2)
    with pytest.raises(ValueError, match="overwritten by"):
        m.scale_inout.bwds(s, x)  # same storage, shape (4,): refused, not mis-bound
    m.scale_inout.bwds(s, view)  # the view itself: differentiates at the values read
    np.testing.assert_allclose(s.grad.numpy(), [0.5 - 1.0 + 2.0 + 3.0], rtol=1e-6)


def test_bwds_of_a_later_call_reading_an_in_place_result_elsewhere(device, m):
    # v is written in place by the first call, then read (at 's') by the second one: the
    # second call's .bwds reads v's current values, not the copy kept for the first call.
    s = pydiff.tensor(S, device=device, requires_grad=True)
    v = pydiff.tensor(V, device=device, requires_grad=True)
    w = pydiff.tensor(-S, device=device, requires_grad=True)
    m.scale_inout(s, v)  # v = S V
    m.scale_inout(v, w)  # w = (S V)(-S)
    w.grad.fill(1.0)
    m.scale_inout.bwds(v, w)
    np.testing.assert_allclose(w.grad.numpy(), S * V, rtol=1e-6)  # d w_after / d w_before
    np.testing.assert_allclose(v.grad.numpy(), -S, rtol=1e-6)
    v.grad.fill(1.0)
    s.zero_grad()
    m.scale_inout.bwds(s, v)  # the first call: at the value it read (V)
    np.testing.assert_allclose(s.grad.numpy(), V, rtol=1e-6)


def test_bwds_after_writing_an_input_through_result(device, m):
    x = pydiff.tensor(V, device=device, requires_grad=True)
    m.sq(x, _result=x)  # off a tape: an in-place update, the values read are kept
    np.testing.assert_allclose(x.numpy(), V**2, rtol=1e-6)
    up = pydiff.tensor(np.array([1.0, -2.0, 0.5]), device=device).with_grads()
    up.grad.copy_from_numpy(np.array([1.0, -2.0, 0.5]))
    m.sq.bwds(x, _result=up)
    np.testing.assert_allclose(x.grad.numpy(), 2 * V * [1.0, -2.0, 0.5], rtol=1e-6)


def test_bwds_after_writing_an_input_through_result_without_gradients_is_refused(device, m):
    x = pydiff.tensor(V, device=device)  # no gradient buffers at the call: nothing kept
    m.sq(x, _result=x)
    up = pydiff.zeros((3,), device=device).with_grads(ones=True)
    with pytest.raises(ValueError, match=r"parameter 'x' .* overwritten by .*sq"):
        m.sq.bwds(x.with_grads(), _result=up)


def test_bwds_that_could_mean_either_of_two_calls_is_refused(device, m):
    x = pydiff.tensor(V, device=device, requires_grad=True)
    m.sq(x, _result=x)  # x = V^2, V kept for this call's .bwds
    y = m.sq(x, _result="tensor")  # reads V^2 at the same parameter
    with pytest.raises(ValueError, match="cannot tell which of the two calls"):
        m.sq.bwds(x, _result=y.with_grads(ones=True))
    before = pydiff.tensor(V**2, device=device, requires_grad=True)  # the way out: a copy
    m.sq.bwds(before, _result=y.with_grads(ones=True))
    np.testing.assert_allclose(before.grad.numpy(), 2 * V**2, rtol=1e-6)
