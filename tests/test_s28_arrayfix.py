"""NumPy's conversion of a tensor to an array (``Tensor.__array__``) is refused where the copy
would lose a gradient silently: a tensor that requires a gradient while a tape records (or one
with a tangent under ``pydiff.jvp``), also inside a list or tuple that NumPy converts
(``np.sum([x, x])``, ``np.array([x])``). The deliberate reads keep working."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

X = np.array([1.0, 2.0, 3.0])
Y = np.array([4.0, -5.0, 0.5])

# Every refusal names the tensor's shape, why, and both ways on: pydiff ops for a gradient,
# x.numpy() / t.numpy() for the values.
REFUSED = r"pydiff\.Tensor of shape \(3,\) .*requires a gradient.*Tape.*pydiff ops.*numpy\(\)"

CASES = [
    ("np.sum([x, x])", lambda x, y: np.sum([x, x])),
    ("np.array([x])", lambda x, y: np.array([x])),
    ("np.stack([x, y])", lambda x, y: np.stack([x, y])),
    ("np.concatenate([x])", lambda x, y: np.concatenate([x])),
    ("np.mean([x, 2*x])", lambda x, y: np.mean([x, 2 * x])),
    ("np.asarray(x)", lambda x, y: np.asarray(x)),
    ("np.array(x)", lambda x, y: np.array(x)),
    ("np.asarray([x])", lambda x, y: np.asarray([x])),
    ("np.array((x, y))", lambda x, y: np.array((x, y))),
    ("np.array([[x]])", lambda x, y: np.array([[x]])),
    ("np.max([x, y])", lambda x, y: np.max([x, y])),
    ("np.exp([x])", lambda x, y: np.exp([x])),
    ("np.multiply([x], 2.0)", lambda x, y: np.multiply([x], 2.0)),
    ("np.linalg.norm([x])", lambda x, y: np.linalg.norm([x])),
    ("np.testing.assert_allclose", lambda x, y: np.testing.assert_allclose(x, X)),
    ("pydiff.tensor([x, y])", lambda x, y: pydiff.tensor([x, y])),
]


@pytest.mark.parametrize("name, f", CASES, ids=[c[0] for c in CASES])
def test_numpy_reading_a_tensor_requiring_grad_on_a_tape_is_refused(device, name, f):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    y = pydiff.tensor(Y, requires_grad=True, device=device)
    with pydiff.Tape():
        with pytest.raises(TypeError, match=REFUSED):
            f(x, y)
        with pytest.raises(TypeError, match=REFUSED):
            f(x * 1.0, y * 1.0)  # intermediates carry the gradient too


def test_refusal_names_a_0d_tensor_inside_a_list(device):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape():
        with pytest.raises(TypeError, match=r"shape \(\) .*requires a gradient.*x\.detach\(\)"):
            np.array([x[0], x[1]])


def test_refused_case_then_the_pydiff_way_gives_float64_gradients(device):
    """The refusal leaves the tape usable: the same sums written with pydiff ops (and the
    NumPy functions pydiff records, np.sum(x) and np.mean(x)) match closed forms."""
    x = pydiff.tensor(X, requires_grad=True, device=device)
    y = pydiff.tensor(Y, requires_grad=True, device=device)
    w = np.array([0.5, -1.0, 2.0])
    with pydiff.Tape() as tape:
        with pytest.raises(TypeError, match=REFUSED):
            np.sum([x, x])
        with pytest.raises(TypeError, match=REFUSED):
            np.mean([x, 2 * x])
        a = np.sum(x + x)  # sum(2x): d/dx = 2
        b = np.mean(x * 0.5 + x)  # mean of [x, 2x] over both: d/dx = 1.5 / 3
        c = np.sum((x * y) * w)  # d/dx = y w, d/dy = x w
        loss = a + b + c
    tape.backward(loss)
    np.testing.assert_allclose(loss.item(), 2 * X.sum() + 1.5 * X.mean() + (X * Y * w).sum(), 1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 + 1.5 / 3 + Y * w, rtol=1e-6)
    np.testing.assert_allclose(y.grad.numpy(), X * w, rtol=1e-6)


def test_numpy_reading_a_tensor_with_a_tangent_under_jvp_is_refused(device):
    def f(v):
        return v * float(np.sum([v, v]))

    with pytest.raises(TypeError, match=r"shape \(3,\) that has a tangent while pydiff.jvp"):
        pydiff.jvp(f, (X,), (np.array([1.0, 0.0, 0.0]),))


def test_deliberate_reads_on_a_tape_keep_working(device):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    c = pydiff.tensor(Y, device=device)  # no gradient: nothing to lose
    with pydiff.Tape() as tape:
        s = (x * x).sum()
        np.testing.assert_array_equal(x.numpy(), X)
        assert float(x[0]) == 1.0 and int(x[2]) == 3 and s.item() == pytest.approx(14.0)
        assert f"{s:.1f}" == "14.0" and "shape=(3,)" in repr(x) and "14." in str(s)
        assert bool(x[1]) and 2.0 in x
        np.testing.assert_array_equal(np.asarray(x.detach()), X)
        np.testing.assert_array_equal(np.array([x.detach(), x.numpy()]), [X, X])
        assert np.sum([x.numpy(), x.numpy()]) == pytest.approx(12.0)
        np.testing.assert_array_equal(np.stack([c, c]), [Y, Y])
        assert np.sum([c, c]) == pytest.approx(2 * Y.sum())
        assert [float(v) for v in x] == X.tolist()  # rows, each read as a float
        assert np.shape(x) == (3,) and np.size(x) == 3
        np.testing.assert_array_equal(x.grad.numpy(), np.zeros(3))
    tape.backward(s)
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)


def test_reads_off_a_tape_keep_working(device):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    y = pydiff.tensor(Y, requires_grad=True, device=device)
    np.testing.assert_array_equal(np.asarray(x), X)
    np.testing.assert_array_equal(np.array(x), X)
    np.testing.assert_allclose(x, X)
    np.testing.assert_array_equal(np.array([x, y]), [X, Y])
    assert np.sum([x, x]) == pytest.approx(12.0)
    assert np.mean([x, 2 * x]) == pytest.approx(3.0)
    np.testing.assert_array_equal(np.stack([x, y]), [X, Y])


class _Cube(pydiff.Function):
    """x**3 computed and differentiated on the host: its forward and backward read their
    tensors through NumPy (np.asarray, np.dot, a list), as a host Function does."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        values = np.asarray(x, np.float64)
        return pydiff.tensor(np.prod([values, values, values], axis=0), device=x.device)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors  # requires a gradient; the tape is still active
        values = np.asarray(x, np.float64)
        scale = np.dot(x, np.ones(x.shape)) * 0.0 + 3.0  # np.dot of a saved tensor
        return pydiff.tensor(scale * np.sum([values * values], axis=0) * np.asarray(grad))


def test_function_forward_and_backward_read_values_inside_the_tape(device):
    """A Function's forward runs unrecorded; its backward (run by tape.backward within the
    tape's `with`) reads values for the gradient itself: neither loses one, neither is refused.
    (np.dot in such a backward was refused before this fix.)"""
    x = pydiff.tensor(X, requires_grad=True, device=device)
    w = np.array([1.0, -2.0, 0.5])
    with pydiff.Tape() as tape:
        loss = (_Cube.apply(x) * w).sum()
        tape.backward(loss)
    np.testing.assert_allclose(loss.item(), (X**3 * w).sum(), rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 3 * X**2 * w, rtol=1e-6)
