"""`Tensor.clone()` is differentiable on a tape (as torch.clone): a gradient reaches the source
through the copy. `copy_values()` is the copy that never records. Closed forms throughout."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff


def test_gradient_flows_through_a_clone(device):
    x0 = np.array([0.5, -1.5, 2.0, 3.0], np.float32)
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        loss = (x.clone() * x).sum()  # sum x^2: gradient 2x
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 2 * x0, rtol=1e-6)


def test_a_clone_of_a_clone_and_a_slice(device):
    x0 = np.linspace(-1.0, 1.0, 6).astype(np.float32)
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = x.clone().clone()
        loss = (y[1:4] * 3.0).sum() + (y * y).sum()
    tape.backward(loss)
    want = 2 * x0 + np.where((np.arange(6) >= 1) & (np.arange(6) < 4), 3.0, 0.0)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6, atol=1e-7)


def test_the_clone_holds_its_own_values(device):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pydiff.Tape():
        y = x.clone()
    x.copy_from_numpy(np.array([7.0, 8.0], np.float32))
    np.testing.assert_array_equal(y.numpy(), [1.0, 2.0])


def test_copy_values_never_records(device):
    x0 = np.array([1.0, 2.0, 3.0], np.float32)
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        loss = (x.copy_values() * x).sum()  # the copy is a constant: gradient x
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), x0, rtol=1e-6)


def test_grad_jvp_and_hvp_through_a_clone(device):
    x0 = np.array([0.3, -0.7, 1.1], np.float64)
    x = pydiff.tensor(x0.astype(np.float32), device=device)

    def f(t):
        c = t.clone()
        return (c * c * t).sum()  # sum x^3: gradient 3x^2, Hessian diag(6x)

    g = pydiff.grad(f)(x)
    np.testing.assert_allclose(g.numpy(), 3 * x0**2, rtol=1e-5)
    v = np.array([1.0, 2.0, -1.0])
    _, dy = pydiff.jvp(f, (x,), (v,))
    np.testing.assert_allclose(float(np.asarray(dy.numpy()).ravel()[0]), 3 * x0**2 @ v, rtol=1e-5)
    (hv,) = pydiff.hvp(f, (x,), (v,))
    np.testing.assert_allclose(np.asarray(hv.numpy()), 6 * x0 * v, rtol=1e-5)


def test_clone_without_gradients_is_a_plain_copy(device):
    x = pydiff.tensor([1.0, 2.0], device=device)
    with pydiff.Tape() as tape:
        y = x.clone()
    assert not y.requires_grad and len(tape) == 0
    np.testing.assert_array_equal(y.numpy(), [1.0, 2.0])


@pytest.mark.parametrize("n", [1, 5, 4099])
def test_clone_values_of_every_size(device, n):
    x0 = np.arange(n, dtype=np.float32)
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        loss = (x.clone() * 2.0).sum()
    tape.backward(loss)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(n, 2.0, np.float32))


def test_copy_of_values_with_a_gradient_path_read_on_a_tape_is_refused(device):
    """copy_ is not recorded: a later recorded read of the copy would silently lose the
    gradient to the source, so the read is refused, naming the way out."""
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    w = pydiff.tensor([3.0, 4.0], device=device, requires_grad=True)
    y = pydiff.zeros((2,), device=device)
    with pydiff.Tape():
        y.copy_(x)
        with pytest.raises(RuntimeError, match=r"clone\(\).*detach\(\)"):
            (y * w).sum()


def test_a_detached_copy_and_a_snapshot_are_constants_on_a_tape(device):
    x0 = np.array([1.0, 2.0], np.float32)
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    y = pydiff.zeros((2,), device=device)
    before = x.clone()  # outside a tape: a snapshot
    with pydiff.Tape() as tape:
        y.copy_(x.detach())
        loss = (y * x).sum() + (before * x).sum()  # gradient: y + before = 2 x0
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 2 * x0, rtol=1e-6)
