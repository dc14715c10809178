"""What pydiff.Function.apply checks (pydiff/function_checks.py): a forward without backward
whose outputs no recorded call connects to its inputs, tensors nested in list/dict
arguments of a Function with a backward, integer and marked outputs, saved inputs
overwritten inside forward, bool gradients. Expected values are closed forms."""

import warnings

import numpy as np
import pytest

import pydiff
from pydiff import ops

X = np.array([0.5, -1.0, 2.0])
Y = np.array([1.5, 0.3, -0.7])
C = np.array([1.0, 2.0, 3.0])


def leaf(device, values=X, grad=True):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=grad)


class HostSquare(pydiff.Function):  # no backward: forward on the host (a forgotten backward)
    @staticmethod
    def forward(ctx, a):
        return pydiff.tensor(a.numpy() ** 2, device=a.device)


class OpsSquare(pydiff.Function):  # pattern 1 done right: recorded ops
    @staticmethod
    def forward(ctx, a):
        return ops.mul(a, a)


# --- F2: a forward without backward must be connected to its inputs on a tape ---------------


def test_host_forward_without_backward_is_refused(device):
    x = leaf(device)
    with pytest.raises(RuntimeError, match=r"HostSquare.*no backward.*recorded pydiff calls"):
        with pydiff.Tape():
            ops.sum(ops.mul(HostSquare.apply(x), x))
    with pytest.raises(RuntimeError, match="HostSquare.*Give HostSquare a backward"):
        pydiff.gradcheck(HostSquare, (leaf(device),))


def test_host_forward_without_backward_off_tape_or_without_grad(device):
    np.testing.assert_allclose(HostSquare.apply(leaf(device)).numpy(), X**2, rtol=1e-6)
    with pydiff.Tape():
        y = HostSquare.apply(leaf(device, grad=False))  # nothing wants a gradient
    np.testing.assert_allclose(y.numpy(), X**2, rtol=1e-6)


def test_recorded_forward_without_backward_still_differentiates(device):
    x = leaf(device)
    with pydiff.Tape() as tape:
        loss = ops.sum(ops.mul(OpsSquare.apply(x), x))
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 3 * X**2, rtol=1e-5)  # d(x^3)/dx

    class AddList(pydiff.Function):  # tensors in a list: pattern 1 records the calls inside
        @staticmethod
        def forward(ctx, xs):
            return ops.mul(xs[0], xs[1])

    a, b = leaf(device), leaf(device, Y)
    with pydiff.Tape() as tape:
        loss = ops.sum(AddList.apply([a, b]))
    tape.backward(loss)
    np.testing.assert_allclose(a.grad.numpy(), Y, rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), X, rtol=1e-6)


def test_host_forward_from_a_list_argument_is_refused(device):
    class HostAdd(pydiff.Function):
        @staticmethod
        def forward(ctx, xs):
            return pydiff.tensor(xs[0].numpy() + xs[1].numpy(), device=xs[0].device)

    with pytest.raises(RuntimeError, match="HostAdd.*recorded pydiff calls"):
        with pydiff.Tape():
            HostAdd.apply([leaf(device), leaf(device, Y)])


def test_constant_output_beside_a_connected_one_warns_unless_marked(device):
    class WithStats(pydiff.Function):
        @staticmethod
        def forward(ctx, a, mark):
            stats = pydiff.tensor(np.array([a.numpy().mean()]), device=a.device)
            if mark:
                ctx.mark_non_differentiable(stats)
            return ops.mul(a, a), stats

    x = leaf(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pydiff.Tape() as tape:
            y, stats = WithStats.apply(x, False)
    assert any(
        issubclass(w.category, pydiff.GradientFlowWarning) and "output 1" in str(w.message)
        for w in seen
    ), [str(w.message) for w in seen]
    x = leaf(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pydiff.Tape() as tape:
            y, stats = WithStats.apply(x, True)
            loss = ops.sum(y)
    assert not stats.requires_grad
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)


def test_marked_constant_output_without_backward_is_not_refused(device):
    class Zeros(pydiff.Function):
        @staticmethod
        def forward(ctx, a):
            out = pydiff.zeros(a.shape, device=a.device)
            ctx.mark_non_differentiable(out)
            return out

    with pydiff.Tape():
        z = Zeros.apply(leaf(device))
    assert not z.requires_grad
    np.testing.assert_array_equal(z.numpy(), np.zeros(3))


# --- F3: tensors nested in list/dict arguments of a Function with a backward ----------------


class StackSum(pydiff.Function):
    @staticmethod
    def forward(ctx, xs):
        return pydiff.tensor(xs[0].numpy() + xs[1].numpy())

    @staticmethod
    def backward(ctx, g):
        return (g,)


def test_nested_tensor_requiring_grad_with_backward_is_refused(device):
    a, b = leaf(device), leaf(device, Y)
    with pytest.raises(TypeError, match=r"StackSum.apply: argument 0\[0\].*separate arguments"):
        with pydiff.Tape():
            StackSum.apply([a, b])

    class DictSum(pydiff.Function):
        @staticmethod
        def forward(ctx, k, d):
            return pydiff.tensor(d["p"].numpy() * k)

        @staticmethod
        def backward(ctx, g):
            return ()

    with pytest.raises(TypeError, match=r"DictSum.apply: argument 1\['p'\]"):
        with pydiff.Tape():
            DictSum.apply(2.0, {"p": b, "q": 1.0})


def test_nested_tensors_without_grad_or_off_tape_are_taken(device):
    a, b = leaf(device), leaf(device, Y)
    np.testing.assert_allclose(StackSum.apply([a, b]).numpy(), X + Y, rtol=1e-6)
    with pydiff.Tape():
        y = StackSum.apply([a.detach(), b.detach()])
    np.testing.assert_allclose(y.numpy(), X + Y, rtol=1e-6)


def test_tensors_as_separate_arguments_get_their_gradients(device):
    class Sum2(pydiff.Function):
        @staticmethod
        def forward(ctx, a, b):
            return pydiff.tensor(a.numpy() + b.numpy())

        @staticmethod
        def backward(ctx, g):
            return g, g

    a, b, c = leaf(device), leaf(device, Y), leaf(device, C)
    with pydiff.Tape() as tape:
        loss = ops.sum(ops.mul(Sum2.apply(a, b), c))
    tape.backward(loss)
    np.testing.assert_allclose(a.grad.numpy(), C)
    np.testing.assert_allclose(b.grad.numpy(), C)
    np.testing.assert_allclose(c.grad.numpy(), X + Y, rtol=1e-6)


def test_jvp_rule_refuses_a_nested_tensor_with_a_tangent(device):
    class ListScale(pydiff.Function):
        @staticmethod
        def forward(ctx, xs):
            return ops.mul(xs[0], 2.0)

        @staticmethod
        def jvp(ctx, t):
            return None

    with pytest.raises(TypeError, match=r"ListScale.apply: argument 0\[0\].*has a tangent"):
        pydiff.jvp(lambda x: ListScale.apply([x]), (leaf(device),), (np.ones(3),))


# --- F5: a saved input overwritten inside forward ---------------------------------------------


def test_saved_input_overwritten_inside_forward_raises_at_backward(device):
    class SquareThenClobber(pydiff.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            out = pydiff.tensor(a.numpy() ** 2)
            a.fill(0.0)
            return out

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            return 2 * a.numpy() * g.numpy()

    a = leaf(device)
    with pydiff.Tape() as tape:
        loss = ops.sum(SquareThenClobber.apply(a))
    with pytest.raises(RuntimeError, match="input 0 of SquareThenClobber, saved.*overwritten"):
        tape.backward(loss)


def test_saved_output_filled_after_saving_is_fine(device):
    class Exp(pydiff.Function):
        @staticmethod
        def forward(ctx, a):
            out = pydiff.zeros(a.shape, device=a.device)
            ctx.save_for_backward(a, out)  # saved first, filled afterwards
            out.copy_from_numpy(np.exp(a.numpy()))
            return out

        @staticmethod
        def backward(ctx, g):
            return g.numpy() * ctx.saved_tensors[1].numpy()

    a = leaf(device)
    with pydiff.Tape() as tape:
        loss = ops.sum(Exp.apply(a))
    tape.backward(loss)
    np.testing.assert_allclose(a.grad.numpy(), np.exp(X), rtol=1e-5)


# --- F7: integer, bool and marked outputs have no gradient -------------------------------------


class SortValues(pydiff.Function):
    @staticmethod
    def forward(ctx, a):
        order = np.argsort(a.numpy())
        ctx.order = order
        return pydiff.tensor(a.numpy()[order]), pydiff.tensor(order.astype(np.int32))

    @staticmethod
    def backward(ctx, g_values, g_order):
        assert g_order is None
        out = np.zeros(len(ctx.order))
        out[ctx.order] = g_values.numpy()
        return out


def test_integer_output_has_no_gradient_and_backward_gets_none(device):
    x = leaf(device)
    with pydiff.Tape() as tape:
        values, order = SortValues.apply(x)
        loss = ops.sum(ops.mul(values, pydiff.tensor(C)))
    assert values.requires_grad and not order.requires_grad
    np.testing.assert_array_equal(order.numpy(), [1, 0, 2])
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 1.0, 3.0])  # weight of each sorted slot


def test_marked_float_and_bool_outputs_with_backward(device):
    class Signed(pydiff.Function):
        @staticmethod
        def forward(ctx, a):
            sign = pydiff.tensor(np.sign(a.numpy()))
            ctx.mark_non_differentiable(sign)
            positive = pydiff.tensor(a.numpy() > 0, dtype="bool")
            return pydiff.tensor(a.numpy() * 3.0), sign, positive

        @staticmethod
        def backward(ctx, g, g_sign, g_positive):
            assert g_sign is None and g_positive is None
            return 3.0 * g.numpy()

    x = leaf(device)
    with pydiff.Tape() as tape:
        y, sign, positive = Signed.apply(x)
        loss = ops.sum(ops.mul(y, sign))
    assert not sign.requires_grad and not positive.requires_grad
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 3.0 * np.sign(X))

    class OnlyIndex(pydiff.Function):  # no differentiable output at all: not recorded
        @staticmethod
        def forward(ctx, a):
            return pydiff.tensor(np.argsort(a.numpy()).astype(np.int32))

        @staticmethod
        def backward(ctx, g):
            raise AssertionError("not recorded")

    with pydiff.Tape() as tape:
        idx = OnlyIndex.apply(leaf(device))
    assert len(tape) == 0 and not idx.requires_grad


# --- F15: bool gradients refused, integer ones taken ---------------------------------------------


@pytest.mark.parametrize(
    "grad",
    [
        lambda a, g: a.numpy() > 0,  # the mask without "* g"
        lambda a, g: True,
        lambda a, g: pydiff.tensor(a.numpy() > 0, dtype="bool"),
    ],
)
def test_bool_gradient_is_refused(device, grad):
    class Relu(pydiff.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return pydiff.tensor(np.maximum(a.numpy(), 0))

        @staticmethod
        def backward(ctx, g):
            return grad(ctx.saved_tensors[0], g)

    x = leaf(device)
    with pydiff.Tape() as tape:
        loss = ops.sum(ops.mul(Relu.apply(x), 3.0))
    with pytest.raises(TypeError, match="Relu.backward.. gradient 0 .*booleans"):
        tape.backward(loss)


def test_integer_gradient_is_taken(device):
    class Ints(pydiff.Function):
        @staticmethod
        def forward(ctx, a):
            return pydiff.tensor(a.numpy() * 2.0)

        @staticmethod
        def backward(ctx, g):
            return np.array([1, 2, 3], np.int64)

    x = leaf(device)
    with pydiff.Tape() as tape:
        loss = ops.sum(Ints.apply(x))
    tape.backward(loss)
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 2.0, 3.0])
