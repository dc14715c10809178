"""Tape: chains and branches of Slang calls against NumPy closed forms; overwrite detection."""

import numpy as np
import pytest

import pydiff

XS = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


def _x(device, values=XS):
    return pydiff.tensor(values, device=device, requires_grad=True)


def test_chain_with_branch_matches_closed_form(device, load):
    """c = x^2 * sin(x): x is consumed by two calls."""
    m = load("chain", device)
    x = _x(device)
    with pydiff.Tape() as tape:
        a = m.square(x, _result="tensor")
        b = m.sine(x, _result="tensor")
        c = m.times(a, b, _result="tensor")
    assert a.requires_grad and c.requires_grad  # results get gradient buffers
    up = np.array([1.0, 2.0, -1.0, 0.5])
    tape.backward(c, grad=up)
    xd = XS.astype(np.float64)
    np.testing.assert_allclose(
        x.grad.numpy(), up * (2 * xd * np.sin(xd) + xd**2 * np.cos(xd)), rtol=1e-5
    )


def test_five_call_chain_with_two_leaves(device, load):
    """y = exp(s * x^2) + x ; five calls, gradients for x and s."""
    m = load("chain", device)
    x = _x(device)
    s = pydiff.tensor([0.3], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        sq = m.square(x, _result="tensor")
        sc = m.scale(sq, s, _result="tensor")
        e = m.expo(sc, _result="tensor")
        y = m.add(e, x, _result="tensor")
        total = m.halve_sum(y, _result="tensor")
    tape.backward(total)
    xd, sd = XS.astype(np.float64), 0.3
    e_val = np.exp(sd * xd**2)
    np.testing.assert_allclose(total.numpy(), [0.5 * np.sum(e_val + xd)], rtol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), 0.5 * (e_val * 2 * sd * xd + 1), rtol=1e-5)
    np.testing.assert_allclose(s.grad.numpy(), [0.5 * np.sum(e_val * xd**2)], rtol=1e-5)


def test_tape_equals_hand_written_bwds(device, load):
    m = load("chain", device)
    x1, x2 = _x(device), _x(device)
    with pydiff.Tape() as tape:
        a = m.square(x1, _result="tensor")
        b = m.sine(a, _result="tensor")
    tape.backward(b, grad=np.ones(4))
    # By hand: forward, then each .bwds in reverse with the same primals.
    a2 = m.square(x2, _result="tensor").with_grads()
    b2 = m.sine(a2, _result="tensor").with_grads(ones=True)
    m.sine.bwds(a2, _result=b2)
    m.square.bwds(x2, _result=a2)
    np.testing.assert_array_equal(x1.grad.numpy(), x2.grad.numpy())


def test_backward_twice_follows_policy(device, load):
    m = load("chain", device)
    x = _x(device)
    with pydiff.Tape() as tape:
        y = m.square(x, _result="tensor")
    tape.backward(y, grad=np.ones(4))
    tape.backward(y, grad=np.ones(4))  # intermediates restart; the leaf accumulates
    np.testing.assert_allclose(x.grad.numpy(), 2 * 2 * XS)
    with pydiff.zero_policy("reset"):
        tape.backward(y, grad=np.ones(4))
    np.testing.assert_allclose(x.grad.numpy(), 2 * XS)
    with pydiff.zero_policy("strict"), pytest.raises(pydiff.StaleGradientError):
        tape.backward(y, grad=np.ones(4))
    tape.zero()
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(4))


def test_tensor_backward_and_default_seed(device, load):
    m = load("chain", device)
    x = _x(device)
    with pydiff.Tape():
        total = m.halve_sum(x, _result="tensor")
    total.backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(4, 0.5))


def test_backward_errors(device, load):
    m = load("chain", device)
    x = _x(device)
    with pydiff.Tape() as tape:
        y = m.square(x, _result="tensor")
    with pytest.raises(ValueError, match=r"grad= is required for an output of shape \(4,\)"):
        tape.backward(y)
    with pytest.raises(ValueError, match=r"grad has shape \(3,\)"):
        tape.backward(y, grad=np.ones(3))
    with pytest.raises(RuntimeError, match="not produced by any call recorded"):
        tape.backward(x, grad=np.ones(4))
    with pytest.raises(RuntimeError, match="not produced by a call recorded on a pydiff.Tape"):
        x.backward()
    with pytest.raises(RuntimeError, match="tapes do not nest"):
        with pydiff.Tape(), pydiff.Tape():
            pass
    tape.reset()
    assert len(tape) == 0


def test_read_then_overwrite_raises(device, load):
    m = load("chain", device)
    x = _x(device)
    with pydiff.Tape() as tape:
        y = m.square(x, _result="tensor")
        m.sine(_x(device), _result=x)  # overwrites x, which square's backward needs
    with pytest.raises(
        RuntimeError,
        match=r"parameter 'x' of chain.square was read by call #1.*overwritten by chain.sine",
    ):
        tape.backward(y, grad=np.ones(4))


def test_host_overwrite_raises(device, load):
    m = load("chain", device)
    x = _x(device)
    with pydiff.Tape() as tape:
        y = m.square(x, _result="tensor")
    x.copy_from_numpy(np.zeros(4))
    with pytest.raises(RuntimeError, match="overwritten by a host write"):
        tape.backward(y, grad=np.ones(4))


def test_write_then_read_is_fine(device, load):
    m = load("chain", device)
    x = _x(device)
    buf = pydiff.zeros((4,), device=device)
    with pydiff.Tape() as tape:
        m.square(x, _result=buf)  # writes buf
        y = m.sine(buf, _result="tensor")  # then reads it
    tape.backward(y, grad=np.ones(4))
    xd = XS.astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), np.cos(xd**2) * 2 * xd, rtol=1e-5)


def test_overwrite_of_unused_branch_is_fine(device, load):
    """Only calls the output depends on are checked (exact, not conservative)."""
    m = load("chain", device)
    x, z = _x(device), _x(device)
    with pydiff.Tape() as tape:
        y = m.square(x, _result="tensor")
        m.sine(z, _result="tensor")
    z.copy_from_numpy(np.zeros(4))
    tape.backward(y, grad=np.ones(4))
    np.testing.assert_allclose(x.grad.numpy(), 2 * XS)


def test_in_place_call_on_tape(device, load):
    """double_in_place(inout v) on the tape: pydiff keeps the value before for backward."""
    m = load("chain", device)
    x = _x(device)
    with pydiff.Tape() as tape:
        m.double_in_place(x)
        y = m.square(x, _result="tensor")
    np.testing.assert_allclose(x.numpy(), 2 * XS)
    tape.backward(y, grad=np.ones(4))
    # y = (2 x0)^2 -> dy/dx0 = 8 x0
    np.testing.assert_allclose(x.grad.numpy(), 8 * XS, rtol=1e-6)


@pytest.mark.parametrize("policy", ["accumulate", "reset", "strict"])
def test_chained_tapes_under_accumulate_give_the_whole_gradient(device, policy):
    # docs/tape.md's recipe for chaining two tapes by hand: with any policy in force, the
    # pair runs under accumulate after the leaves are zeroed, and gives the gradient of
    # the whole function (a reset backward would drop the second tape's share of x).
    import torch

    from pydiff import ops

    x = _x(device)
    x.grad.fill(5.0)  # an earlier step's gradient, which the recipe zeroes
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as first:
            h = ops.mul(x, x)
        with pydiff.Tape(reads_other_tapes=True) as second:  # h: chained on purpose
            loss = ops.sum(ops.sin(h)) + ops.sum(x * x * x)
        x.zero_grad()
        with pydiff.zero_policy("accumulate"):
            second.backward(loss)
            first.backward(h, grad=h.grad)
    xt = torch.tensor(XS.astype(np.float64), requires_grad=True)
    (torch.sin(xt * xt).sum() + (xt * xt * xt).sum()).backward()
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-5, atol=1e-6)
