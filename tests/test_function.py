"""pydiff.Function: every example of the custom-Function tutorial, backed by Slang kernels,
checked by closed forms and gradcheck."""

import numpy as np
import pytest

import pydiff

X = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)


@pytest.fixture
def m(device, load):
    return load("chain", device)


def _t(device, data, grad=True):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, requires_grad=grad)


def _classes(m):
    class AddAndScale(pydiff.Function):  # pattern 1: composed of recorded calls
        @staticmethod
        def forward(ctx, x, y, scale):
            return m.scale(m.add(x, y, _result="tensor"), scale, _result="tensor")

    class Scale(pydiff.Function):
        @staticmethod
        def forward(ctx, x, s):
            ctx.save_for_backward(x)
            ctx.scale_factor = s
            return m.scale(x, s, _result="tensor")

        @staticmethod
        def backward(ctx, grad_output):
            return m.scale(grad_output, ctx.scale_factor, _result="tensor")

    class Add(pydiff.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return m.add(a, b, _result="tensor")

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, grad_output

    class Split(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return m.scale(x, 2.0, _result="tensor"), m.scale(x, 3.0, _result="tensor")

        @staticmethod
        def backward(ctx, g1, g2):
            return m.add(
                m.scale(g1, 2.0, _result="tensor"),
                m.scale(g2, 3.0, _result="tensor"),
                _result="tensor",
            )

    class Identity(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    class Legendre3(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return m.p3(x, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return m.p3_backward(x, g, _result="tensor")

    class Legendre3Wrong(Legendre3):
        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return m.p3_backward_wrong(x, g, _result="tensor")

    class BadOp(pydiff.Function):
        @staticmethod
        def forward(ctx, a, b):
            return m.add(a, b, _result="tensor")

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output

    class BadShape(pydiff.Function):
        @staticmethod
        def forward(ctx, a):
            return m.scale(a, 1.0, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            return np.ones(3)

    return locals()


def test_add_and_scale_pattern_1(device, m):
    F = _classes(m)
    x, y = _t(device, X), _t(device, X + 4)
    with pydiff.Tape() as tape:
        out = F["AddAndScale"].apply(x, y, 2.0)
    np.testing.assert_allclose(out.numpy(), (2 * X + 4) * 2)
    tape.backward(out, grad=np.ones((2, 2)))
    np.testing.assert_allclose(x.grad.numpy(), np.full((2, 2), 2.0))
    np.testing.assert_allclose(y.grad.numpy(), np.full((2, 2), 2.0))


def test_scale_add_split_identity(device, m):
    F = _classes(m)
    x = _t(device, X)
    with pydiff.Tape() as tape:
        s = F["Scale"].apply(x, 2.0)
    tape.backward(s, grad=np.ones((2, 2)))
    np.testing.assert_allclose(x.grad.numpy(), np.full((2, 2), 2.0))

    a, b = _t(device, X), _t(device, 2 * X)
    with pydiff.Tape() as tape:
        c = F["Add"].apply(a, b)
    tape.backward(c, grad=X)
    np.testing.assert_allclose(a.grad.numpy(), X)
    np.testing.assert_allclose(b.grad.numpy(), X)

    x = _t(device, X)
    with pydiff.Tape() as tape:
        o1, o2 = F["Split"].apply(x)
        total = m.add(o1, o2, _result="tensor")
    np.testing.assert_allclose(total.numpy(), 5 * X)
    tape.backward(total, grad=np.ones((2, 2)))
    np.testing.assert_allclose(x.grad.numpy(), np.full((2, 2), 5.0))

    x = _t(device, X)
    with pydiff.Tape() as tape:
        y = F["Identity"].apply(x)
    tape.backward(y, grad=np.full((2, 2), 3.0))
    np.testing.assert_allclose(x.grad.numpy(), np.full((2, 2), 3.0))


def test_legendre_p3(device, m):
    F = _classes(m)
    x = _t(device, [[0.5]])
    with pydiff.Tape():
        y = F["Legendre3"].apply(x)
    y.backward()
    np.testing.assert_allclose(y.numpy(), [[0.5 * (5 * 0.125 - 1.5)]], rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), [[7.5 * 0.25 - 1.5]], rtol=1e-6)


def test_none_gradient_and_non_tensor_args(device, m):
    class HalfNone(pydiff.Function):
        @staticmethod
        def forward(ctx, a, k, b):
            ctx.k = k
            return m.scale(m.add(a, b, _result="tensor"), k, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            return m.scale(g, ctx.k, _result="tensor"), None

    a, b = _t(device, X), _t(device, X)
    with pydiff.Tape() as tape:
        out = HalfNone.apply(a, 3.0, b)
    tape.backward(out, grad=np.ones((2, 2)))
    np.testing.assert_allclose(a.grad.numpy(), np.full((2, 2), 3.0))
    np.testing.assert_array_equal(b.grad.numpy(), np.zeros((2, 2)))


def test_wrong_gradient_count_and_shape(device, m):
    F = _classes(m)
    a, b = _t(device, X), _t(device, X)
    with pydiff.Tape() as tape:
        out = F["BadOp"].apply(a, b)
    with pytest.raises(
        RuntimeError, match=r"BadOp\.backward\(\) returned 1 gradients but expected 2"
    ):
        tape.backward(out, grad=np.ones((2, 2)))
    with pydiff.Tape() as tape:
        out = F["BadShape"].apply(a)
    with pytest.raises(
        RuntimeError,
        match=r"BadShape\.backward\(\) gradient 0 has shape \(3,\) but input 0 has shape \(2, 2\)",
    ):
        tape.backward(out, grad=np.ones((2, 2)))


def test_function_outside_tape_just_runs(device, m):
    F = _classes(m)
    y = F["Legendre3"].apply(_t(device, [0.5, 1.0], grad=False))
    np.testing.assert_allclose(
        y.numpy(), 0.5 * (5 * np.array([0.5, 1.0]) ** 3 - 3 * np.array([0.5, 1.0])), rtol=1e-6
    )


@pytest.mark.parametrize("name", ["Scale", "Add", "Split", "Identity", "Legendre3", "AddAndScale"])
def test_gradcheck_passes_on_tutorial_functions(device, m, name):
    F = _classes(m)
    x, y = _t(device, [0.3, -0.7, 1.1]), _t(device, [0.2, 0.5, -0.4])
    args = {
        "Scale": (x, 1.5),
        "Add": (x, y),
        "Split": (x,),
        "Identity": (x,),
        "Legendre3": (x,),
        "AddAndScale": (x, y, 2.0),
    }[name]
    assert pydiff.gradcheck(F[name], args)


def test_gradcheck_catches_wrong_function_backward(device, m):
    F = _classes(m)
    x = _t(device, [0.3, -0.7, 1.1])
    with pytest.raises(
        pydiff.GradcheckError,
        match=r"Legendre3Wrong.*input 0, element \(\d,\): analytic .* numeric",
    ):
        pydiff.gradcheck(F["Legendre3Wrong"], (x,))
    assert pydiff.gradcheck(F["Legendre3Wrong"], (x,), raise_exception=False) is False


def test_backward_adding_into_grad_target(device):
    """A backward may add its gradient straight into ctx.grad_target(k) and return None."""
    import pydiff

    class Twice(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return pydiff.tensor(2.0 * x.numpy(), device=x.device)

        @staticmethod
        def backward(ctx, g):
            target = ctx.grad_target(0)
            target.copy_from_numpy(target.numpy() + 2.0 * g.numpy())
            return None

    x = pydiff.tensor(np.array([1.0, -2.0, 3.0], np.float32), device=device, requires_grad=True)
    x.grad.copy_from_numpy(np.full(3, 10.0, np.float32))  # accumulate policy: added to
    with pydiff.Tape() as tape:
        y = Twice.apply(x)
    tape.backward(y, grad=np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(x.grad.numpy(), [12.0, 14.0, 16.0])
    x.zero_grad()
    with pydiff.zero_policy("strict"):
        with pydiff.Tape() as tape:
            y = Twice.apply(x)
        tape.backward(y, grad=np.ones(3))
        with pydiff.Tape() as tape:
            y = Twice.apply(x)
        with pytest.raises(pydiff.StaleGradientError):
            tape.backward(y, grad=np.ones(3))  # the policy applies to grad targets too


# --- outputs that alias inputs (issue 15, class 7) and backward's return value (class 16) ---
X3 = np.array([1.0, -2.0, 0.5])


def _aliasing(m):
    class Identity(pydiff.Function):  # returns its input unchanged
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class GradScale(pydiff.Function):  # identity forward, scaled gradient
        @staticmethod
        def forward(ctx, x, s):
            ctx.s = s
            return x

        @staticmethod
        def backward(ctx, g):
            return ctx.s * g.numpy()

    class SameTwice(pydiff.Function):  # one tensor returned as two outputs
        @staticmethod
        def forward(ctx, x):
            y = m.scale(x, 2.0, _result="tensor")
            return y, y

        @staticmethod
        def backward(ctx, g1, g2):
            return 2.0 * (g1.numpy() + g2.numpy())

    class InputAndNew(pydiff.Function):  # (x, 3x): an input inside a tuple of outputs
        @staticmethod
        def forward(ctx, x):
            return (x, m.scale(x, 3.0, _result="tensor"))

        @staticmethod
        def backward(ctx, g1, g2):
            return g1.numpy() + 3.0 * g2.numpy()

    class View(pydiff.Function):  # a view (same storage) of the input
        @staticmethod
        def forward(ctx, x):
            return x.reshape((x.numel,))

        @staticmethod
        def backward(ctx, g):
            return g.numpy().reshape(ctx.inputs[0].shape)

    return locals()


def test_identity_and_gradient_scaling_count_the_input_once(device, m):
    F = _aliasing(m)
    x = _t(device, X3)
    with pydiff.Tape() as tape:
        y = F["Identity"].apply(x)
        z = m.square(y, _result="tensor")
    assert y is not x
    tape.backward(z, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 2 * X3, rtol=1e-6)  # d(x^2)/dx, not twice it

    x = _t(device, X3)
    x.grad.fill(1.0)  # accumulate: added to, not lost
    with pydiff.Tape() as tape:
        y = F["GradScale"].apply(x, 0.25)
    tape.backward(y, grad=np.array([4.0, 8.0, -4.0]))
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 3.0, 0.0], rtol=1e-6)


def test_returning_an_input_is_not_an_overwrite_of_it(device, m):
    """A call that read x before the Function still backpropagates (x was not written)."""
    F = _aliasing(m)
    x = _t(device, X3)
    with pydiff.Tape() as tape:
        sq = m.square(x, _result="tensor")
        y = F["Identity"].apply(x)
        total = m.add(sq, y, _result="tensor")
    tape.backward(total, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 2 * X3 + 1, rtol=1e-6)
    np.testing.assert_allclose(x.numpy(), X3)


def test_same_tensor_twice_input_in_tuple_and_views(device, m):
    F = _aliasing(m)
    x = _t(device, X3)
    with pydiff.Tape() as tape:
        a, b = F["SameTwice"].apply(x)
        c = m.times(a, b, _result="tensor")  # 4 x^2
    assert a is not b
    tape.backward(c, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 8 * X3, rtol=1e-6)

    x = _t(device, X3)
    with pydiff.Tape() as tape:
        same, tripled = F["InputAndNew"].apply(x)
        c = m.times(same, tripled, _result="tensor")  # 3 x^2
    tape.backward(c, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 6 * X3, rtol=1e-6)

    x2 = _t(device, X3.reshape(3, 1))
    with pydiff.Tape() as tape:
        v = F["View"].apply(x2)
        s = m.square(v, _result="tensor")
    tape.backward(s, grad=np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(x2.grad.numpy().ravel(), 2 * X3 * [1, 2, 3], rtol=1e-6)


@pytest.mark.parametrize("name", ["Identity", "SameTwice", "InputAndNew", "View"])
def test_gradcheck_passes_on_aliasing_outputs(device, m, name):
    x = _t(device, [0.3, -0.7, 1.1])
    assert pydiff.gradcheck(_aliasing(m)[name], (x,))


def _returning(value_of):
    class Returns(pydiff.Function):
        @staticmethod
        def forward(ctx, a, b):
            return pydiff.tensor(a.numpy() + b.numpy(), device=a.device)

        @staticmethod
        def backward(ctx, g):
            return value_of(g)

    return Returns


@pytest.mark.parametrize(
    "value_of, error, message",
    [
        (lambda g: "grad", RuntimeError, r"returned 1 gradients but expected 2"),
        (lambda g: ("grad", g), TypeError, r"Returns\.backward\(\) gradient 0 is a str"),
        (lambda g: ({"x": g}, g), TypeError, r"gradient 0 is a dict; it must be a pydiff"),
        (lambda g: (["a", "b"], g), TypeError, r"gradient 0 is a list that is not an array"),
        (lambda g: None, TypeError, r"Returns\.backward\(\) returned None \(a missing return\?\)"),
        (lambda g: (g, g, g), RuntimeError, r"returned 3 gradients but expected 2"),
        (lambda g: (g, np.ones(5)), RuntimeError, r"gradient 1 has shape \(5,\) but input 1"),
    ],
)
def test_backward_return_errors_name_the_function_and_what_to_return(
    device, value_of, error, message
):
    a, b = _t(device, X3), _t(device, X3)
    with pydiff.Tape() as tape:
        out = _returning(value_of).apply(a, b)
    with pytest.raises(error, match=message) as info:
        tape.backward(out, grad=np.ones(3))
    if error is TypeError or "expected" in message:
        assert "must return one gradient per tensor input of forward (2: input 0: shape (3,)" in (
            str(info.value)
        )


def test_backward_may_return_a_list_of_gradients(device):
    a, b = _t(device, X3), _t(device, X3)
    with pydiff.Tape() as tape:
        out = _returning(lambda g: [2.0 * g.numpy(), None]).apply(a, b)
    tape.backward(out, grad=np.ones(3))
    np.testing.assert_allclose(a.grad.numpy(), 2.0)
    np.testing.assert_allclose(b.grad.numpy(), 0.0)


def test_a_saved_output_overwritten_before_backward_raises(device):
    """save_for_backward(output): overwritten in place, the backward would read the new values
    (as PyTorch, refused); a saved input was checked already, an unsaved output is not."""

    class Exp(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            y = pydiff.ops.exp(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            return g.numpy() * ctx.saved_tensors[0].numpy()

    x = _t(device, X3)
    with pydiff.Tape() as tape:
        y = Exp.apply(x)
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), np.exp(X3), rtol=1e-6)
    with pydiff.Tape() as tape:
        y = Exp.apply(x)
    y.fill(0.0)
    with pytest.raises(RuntimeError, match=r"overwritten by a host write"):
        tape.backward(y, grad=np.ones(3))  # y itself: now a constant to the tape
    with pydiff.Tape() as tape:  # from a later result: a read of y (or the saved y) refuses
        y = Exp.apply(x)
        w = pydiff.ops.exp(x).sum() + y.sum()
    y.fill(0.0)
    with pytest.raises(RuntimeError, match=r"overwritten by a host write"):
        tape.backward(w)
    with pydiff.Tape() as tape:  # the same for a library op that saves its output
        s = pydiff.ops.softmax(x)
    s.fill(0.0)
    with pytest.raises(RuntimeError, match=r"overwritten"):
        tape.backward(s, grad=np.arange(3.0))
