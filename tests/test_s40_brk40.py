"""Session 40, brk40: a new user's edge cases in forward mode, transforms, custom derivatives,
gradcheck and torch interop, each checked against closed forms or float64 references."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

SRC = """
[Differentiable] float poly(float a, float x) { return a * x * x * x + sin(x); }
[Differentiable] float mul2(float x, float y) { return x * y * y; }
[Differentiable] half hsq(half x) { return x * x; }
[Differentiable] void sc(float s, inout float y) { y = s * y * y; }
"""

X = np.array([0.3, -0.7, 1.1])
U = np.array([1.0, 2.0, -1.0])


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s40_brk40", SRC, device=device)


def _scaled(dtype: str):
    """A Function y = 2x whose jvp returns a tensor of ``dtype`` (not the output's)."""

    class Scaled(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return pydiff.tensor(x.numpy() * 2.0, device=x.device, dtype=x.dtype)

        @staticmethod
        def backward(ctx, g):
            return g.numpy() * 2.0

        @staticmethod
        def jvp(ctx, t):
            return pydiff.tensor(t.numpy() * 2.0, device=t.device, dtype=dtype)

    return Scaled


@pytest.mark.parametrize("dtype", ["int", "half", "double"])
def test_function_jvp_tangent_of_another_dtype_is_converted(m, device, dtype):
    # Before: F.jvp returning an int/half/double tensor tangent for a float output was kept
    # as it was, and the next op or shader call failed naming neither F.jvp nor the tangent
    # (OpDtypeError "mul: a has dtype int", "tangent has ... dtype int"). backward converts
    # such gradients; jvp now converts the tangent to the output's dtype as well.
    F = _scaled(dtype)
    x = pydiff.tensor(X, device=device)
    u = np.array([1.0, 2.0, 3.0])
    _, t = pydiff.jvp(lambda x: m.poly(1.0, F.apply(x), _result="tensor"), (x,), (u,))
    y = 2 * X
    np.testing.assert_allclose(t.numpy(), (3 * y**2 + np.cos(y)) * 2 * u, rtol=1e-5)
    _, t2 = pydiff.jvp(lambda x: F.apply(x) * 3.0, (x,), (u,))
    np.testing.assert_allclose(t2.numpy(), 6 * u, rtol=1e-6)


def test_function_jvp_float_tangent_for_half_output(m, device):
    # A jvp written with ops (which compute in float) for a half output: its float tangent
    # is the half output's tangent; a half shader parameter then takes it.
    class Halve(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return pydiff.tensor(x.numpy() * 0.5, device=x.device, dtype="half")

        @staticmethod
        def backward(ctx, g):
            return g.numpy() * 0.5

        @staticmethod
        def jvp(ctx, t):
            return ops.mul(t, 0.5)

    x = pydiff.tensor(X, device=device)
    _, t = pydiff.jvp(lambda x: m.hsq(Halve.apply(x), _result="tensor"), (x,), (U,))
    h = (X * 0.5).astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(t.numpy().astype(np.float64), 2 * h * 0.5 * U, rtol=2e-3)


@pytest.mark.parametrize("boolean", ["tensor", "numpy"])
def test_function_jvp_boolean_tangent_is_refused(device, boolean):
    # backward refuses a boolean gradient (a forgotten "* grad"); jvp now refuses a boolean
    # tangent the same way instead of reading it as 0/1.
    class Mask(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return pydiff.tensor(np.maximum(x.numpy(), 0.0), device=x.device)

        @staticmethod
        def backward(ctx, g):
            return g.numpy() * (ctx.inputs[0].numpy() > 0)

        @staticmethod
        def jvp(ctx, t):
            mask = ctx.inputs[0].numpy() > 0
            return pydiff.tensor(mask, device=t.device) if boolean == "tensor" else mask

    with pytest.raises(TypeError, match=r"Mask\.jvp\(\) tangent 0 .*booleans"):
        pydiff.jvp(Mask.apply, (pydiff.tensor(X, device=device),), (U,))


def test_gradcheck_holds_a_torch_tensor_without_grad_fixed(m, device):
    # docs/gradcheck.md: "A torch tensor without requires_grad is an input held fixed, as any
    # other." Before: "TypeError: gradcheck: fn returned no pydiff.Tensor" (the module
    # function, called off a tape with torch data, returned torch tensors).
    torch = pytest.importorskip("torch")
    x = pydiff.tensor(X, device=device, requires_grad=True)
    assert pydiff.gradcheck(m.mul2, (x, torch.tensor(U, dtype=torch.float32)))
    y = torch.arange(6.0).reshape(2, 3).T  # transposed: non-contiguous
    assert pydiff.gradcheck(
        m.mul2, (pydiff.tensor(np.ones((3, 2)), device=device, requires_grad=True), y)
    )
    assert pydiff.gradcheck(
        lambda a, b: m.mul2(a, b, _result="tensor"), (x, torch.tensor(U, dtype=torch.float32))
    )
    assert np.array_equal(x.numpy(), X.astype(np.float32))


# ---- pinned good behaviour, each against an independent reference ----


def test_hvp_of_module_function_with_broadcast_parameter(m, device):
    a = pydiff.tensor([2.0], device=device)
    ha, hx = pydiff.hvp(m.poly, (a, pydiff.tensor(X, device=device)), (np.array([1.0]), U))
    np.testing.assert_allclose(ha.numpy(), [np.sum(3 * X**2 * U)], rtol=1e-5)
    np.testing.assert_allclose(hx.numpy(), 3 * X**2 + (12 * X - np.sin(X)) * U, rtol=1e-5)


def test_grad_of_jvp_is_hessian_vector_product(m, device):
    g = pydiff.grad(
        lambda x: pydiff.jvp(lambda y: m.poly(2.0, y, _result="tensor"), (x,), (U,))[1].sum()
    )(X)
    np.testing.assert_allclose(g, (12 * X - np.sin(X)) * U, rtol=1e-5)


def test_fwds_inout_aliased_with_input(m, device):
    y = pydiff.tensor(X.copy(), device=device).with_tangent(U)
    m.sc.fwds(y, y)  # y <- y^3
    np.testing.assert_allclose(y.numpy(), X**3, rtol=1e-6)
    np.testing.assert_allclose(y.tangent.numpy(), 3 * X**2 * U, rtol=1e-6)


def test_torch_strided_and_aliased_arguments(m, device):
    torch = pytest.importorskip("torch")
    b = torch.randn(10, requires_grad=True, generator=torch.Generator().manual_seed(0))
    y = m.mul2(b[::3], b[::3])  # the same strided view twice: y = x^3
    y.sum().backward()
    ref = torch.zeros(10, dtype=torch.float64)
    ref[::3] = 3 * b.detach()[::3].double() ** 2
    np.testing.assert_allclose(b.grad.numpy(), ref.numpy(), rtol=1e-5, atol=1e-7)


CONTRACTION = "[Differentiable] float contr(float x, float a, float b) { return a * tanh(x) + b; }"


def _contraction_reference(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x* of x = a tanh(x) + b in float64 and dx*/db = 1 / (1 - a sech^2 x*)."""
    x = np.zeros_like(b)
    for _ in range(5000):
        x = a * np.tanh(x) + b
    return x, 1 / (1 - a / np.cosh(x) ** 2)


@pytest.mark.parametrize("where", ["direct", "struct"])
def test_fixed_point_refuses_torch_params_by_name(device, where):
    # Before: "fixed_point: f (contr) returned a Tensor; it must return a pydiff Tensor of
    # x's shape" (a torch Tensor: f was called with torch data), naming neither the
    # parameter nor torch_function, the way the docs give.
    torch = pytest.importorskip("torch")
    m = pydiff.load_module_from_source("s40_brk40_fp", CONTRACTION, device=device)
    a = torch.tensor([0.5, -0.3, 0.8], requires_grad=True)
    b = torch.tensor([1.0, -0.5, 0.2])
    if where == "direct":
        f, params, label = m.contr, (pydiff.tensor([0.5, -0.3, 0.8], device=device), b), r"1\]"
    else:
        f = lambda x, p: p["a"] * ops.tanh(x) + p["b"]  # noqa: E731
        params, label = ({"a": a, "b": b},), r"0\]\['a'\]"
    with pytest.raises(TypeError, match=rf"params\[{label} is a torch tensor.*torch_function"):
        pydiff.fixed_point(f, np.zeros(3), *params)
    # the way the message gives: torch gradients through the implicit backward
    x = pydiff.torch_function(lambda a, b: pydiff.fixed_point(m.contr, np.zeros(3), a, b))(a, b)
    x.sum().backward()
    xs, dxdb = _contraction_reference(
        np.float32([0.5, -0.3, 0.8]).astype(float), b.double().numpy()
    )
    np.testing.assert_allclose(x.detach().numpy(), xs, rtol=1e-5)
    np.testing.assert_allclose(a.grad.numpy(), np.tanh(xs) * dxdb, rtol=1e-4)


def test_half_tensor_at_float_parameter_advises_a_differentiable_conversion(m, device):
    # Before, the advice was pydiff.tensor(x.numpy().astype(np.float32)): a copy that cuts a
    # half parameter off its gradient. x.astype("float") is recorded on the tape; following
    # the advice gives the gradient (half, converted back), checked against the closed form.
    x = pydiff.tensor(X, dtype="half", requires_grad=True, device=device)
    with pytest.raises(TypeError, match=r"x\.astype\('float'\), which the tape differentiates"):
        m.poly(2.0, x, _result="tensor")
    with pydiff.Tape() as tape:
        y = m.poly(2.0, x.astype("float"), _result="tensor")
    tape.backward(y, grad=np.ones(3))
    xh = X.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy().astype(np.float64), 6 * xh**2 + np.cos(xh), rtol=2e-3)


def test_torch_tensor_needing_grad_inside_a_list_names_the_list(device):
    # Before: "argument 0 holds a torch tensor that requires grad inside a Tensor" (the
    # tensor's own type, not the container's).
    torch = pytest.importorskip("torch")
    f = pydiff.torch_function(lambda ts: ts[0] * 2.0)
    with pytest.raises(ValueError, match=r"argument 0 holds .* requires grad inside a list:"):
        f([torch.ones(3, requires_grad=True)])
    with pytest.raises(ValueError, match=r"inside a dict:"):
        f({0: torch.ones(3, requires_grad=True)})


def test_transforms_hold_a_torch_primal_without_direction_fixed(m, device):
    # Before: a torch tensor given as a primal with no direction reached the shader call
    # inside as torch data, whose result was a torch tensor: jvp/jacfwd said "mul2 returned
    # a Tensor inside pydiff.jvp: call it with _result='tensor'" (it was), hvp/hessian named
    # the internal ShaderTangent.apply, jacrev "fn returned a Tensor". grad (on a tape)
    # already held it fixed; now they all do. Here f(a, b) = a b^2.
    torch = pytest.importorskip("torch")
    b = torch.tensor(U, dtype=torch.float32)

    def f(a, b):
        return m.mul2(a, b, _result="tensor")

    a = pydiff.tensor(X, device=device)
    value, t = pydiff.jvp(lambda a, b: f(a, b).sum(), (a, b), (np.ones(3), None))
    np.testing.assert_allclose(float(value), np.sum(X * U**2), rtol=1e-6)
    np.testing.assert_allclose(float(t), np.sum(U**2), rtol=1e-6)
    (ha, hb) = pydiff.hvp(lambda a, b: (f(a, b) * a).sum(), (a, b), (U, None))
    assert hb is None  # sum(a^2 b^2): H_aa = diag(2 b^2)
    np.testing.assert_allclose(ha.numpy(), 2 * U**2 * U, rtol=1e-5)
    np.testing.assert_allclose(pydiff.jacfwd(f)(a, b), np.diag(U**2), rtol=1e-6)
    np.testing.assert_allclose(pydiff.jacrev(f)(a, b), np.diag(U**2), rtol=1e-6)
    with pytest.raises(TypeError, match=r"hessian: primal 1 is a torch tensor.*from_torch"):
        pydiff.hessian(lambda a, b: f(a, b).sum(), (a, b))
    with pytest.raises(TypeError, match=r"jvp: primal 1 is a torch tensor that requires grad"):
        pydiff.jvp(f, (a, b.clone().requires_grad_(True)), (np.ones(3), None))


def test_grad_names_a_torch_argument(device):
    # Before: "grad(<lambda>): argument 0 is a Tensor; differentiate with respect to pydiff
    # tensors, ..." (torch's class name, no way out).
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"argument 0 is a torch tensor.*pydiff\.from_torch"):
        pydiff.grad(lambda x: (x * x).sum())(torch.ones(3))
    g = pydiff.grad(lambda x: (x * x).sum())(
        pydiff.from_torch(torch.tensor(X, dtype=torch.float32))
    )
    np.testing.assert_allclose(g.numpy(), 2 * X, rtol=1e-6)


def test_transforms_take_torch_data_a_function_closes_over(m, device):
    # Before, a torch tensor (data, no gradient) read from a closure worked in grad and vjp
    # (on their tapes) but not elsewhere: jvp/jacfwd said the shader call "returned a Tensor:
    # call it with _result='tensor'" (it was), hvp named ShaderTangent.apply, jacrev and
    # gradcheck said fn "returned a Tensor"/"no pydiff.Tensor", fixed_point "f returned a
    # Tensor". Each now runs the calls on pydiff tensors of its values. f(a) = a * c^2.
    torch = pytest.importorskip("torch")
    c = torch.tensor(U, dtype=torch.float32)
    a = pydiff.tensor(X, device=device)

    def f(a):
        return m.mul2(a, c, _result="tensor")

    value, t = pydiff.jvp(f, (a,), (np.ones(3),))
    np.testing.assert_allclose(value.numpy(), X * U**2, rtol=1e-6)
    np.testing.assert_allclose(t.numpy(), U**2, rtol=1e-6)
    (h,) = pydiff.hvp(lambda a: (f(a) * a).sum(), (a,), (np.ones(3),))  # sum a^2 c^2
    np.testing.assert_allclose(h.numpy(), 2 * U**2, rtol=1e-6)
    np.testing.assert_allclose(pydiff.jacfwd(f)(a), np.diag(U**2), rtol=1e-6)
    np.testing.assert_allclose(pydiff.jacrev(f)(a), np.diag(U**2), rtol=1e-6)
    np.testing.assert_allclose(pydiff.jacrev(lambda a: ops.mul(a, c))(a), np.diag(U), rtol=1e-6)
    assert pydiff.gradcheck(f, (pydiff.tensor(X, device=device, requires_grad=True),))
    x = pydiff.fixed_point(lambda x: ops.add(ops.mul(x, 0.5), c), np.zeros(3))  # x* = 2c
    np.testing.assert_allclose(x.numpy(), 2 * U, rtol=1e-5)
    # one that requires grad is refused by name (its gradient would be lost)
    g = c.clone().requires_grad_(True)
    with pytest.raises(TypeError, match=r"requires grad"):
        pydiff.jvp(lambda a: m.mul2(a, g, _result="tensor"), (a,), (np.ones(3),))
    with pytest.raises(TypeError, match=r"requires grad, in a call .*fixed_point"):
        pydiff.fixed_point(lambda x: ops.add(ops.mul(x, 0.5), g), np.zeros(3))


def test_to_torch_refuses_where_the_copy_loses_a_derivative(device):
    # Before: to_torch(x) of a tensor with a gradient on a tape, or a tangent under jvp,
    # silently gave a copy with no derivative: grad of from_torch(to_torch(x) * 2).sum() was
    # 0 (the DLPack export and NumPy's conversion already refused). Now refused likewise.
    torch = pytest.importorskip("torch")

    def f(x):
        return pydiff.from_torch(pydiff.to_torch(x) * 2.0).sum()

    with pytest.raises(TypeError, match=r"pydiff\.to_torch: .*requires a gradient"):
        pydiff.grad(f)(X)
    with pytest.raises(TypeError, match=r"pydiff\.to_torch: .*has a tangent"):
        pydiff.jvp(f, (pydiff.tensor(X, device=device),), (U,))
    # deliberate reads still work: detached, or off the tape
    x = pydiff.tensor(X, device=device, requires_grad=True)
    with pydiff.Tape():
        assert torch.equal(pydiff.to_torch(x.detach()), torch.tensor(X, dtype=torch.float32))
    assert torch.equal(pydiff.to_torch(x), torch.tensor(X, dtype=torch.float32))
    # and torch_function, the way for a gradient, still hands torch its results
    t = torch.tensor(X, dtype=torch.float32, requires_grad=True)
    pydiff.torch_function(lambda a: (a * a).sum())(t).backward()
    np.testing.assert_allclose(t.grad.numpy(), 2 * X, rtol=1e-6)


def test_values_copied_from_a_gradient_path_are_refused_through_unrecorded_calls(m, device):
    # Before: y.copy_(x) from a leaf that needs a gradient, then calls reading only y: the
    # tape recorded none of them (no input requires a gradient), so grad returned zeros
    # (true: 2x), vjp/jacrev/hvp zeros, and a recorded call reading their result a wrong
    # gradient (y*y*x: x^2 for 3x^2). Only a recorded call reading y itself was refused.
    # Their results are now marked as holding such values, refused where a gradient needs
    # them; a copy_ or on-tape clone of y keeps the mark.
    def copied(x):
        y = pydiff.zeros((3,), device=device)
        y.copy_(x)
        return y

    with pytest.raises(RuntimeError, match=r"copy_.*gradient path.*clone"):
        pydiff.grad(lambda x: (copied(x) * copied(x)).sum())(X)
    with pytest.raises(RuntimeError, match=r"copy_.*gradient path"):
        pydiff.vjp(lambda x: m.poly(1.0, copied(x), _result="tensor"), (X,), np.ones(3))
    with pytest.raises(RuntimeError, match=r"the result of .*copy_ of values"):
        pydiff.grad(lambda x: (copied(x) * copied(x) * x).sum())(X)
    with pytest.raises(RuntimeError, match=r"hvp: .*copy_"):
        pydiff.hvp(lambda x: (copied(x) * copied(x)).sum(), (pydiff.tensor(X),), (U,))

    def chained(x):
        z = pydiff.zeros((3,), device=device)
        z.copy_(copied(x))
        return (z.clone() * 2.0).sum()

    with pytest.raises(RuntimeError, match=r"copy_.*gradient path"):
        pydiff.grad(chained)(X)

    # the ways the message gives: clone (recorded) and a detached copy (a constant)
    np.testing.assert_allclose(pydiff.grad(lambda x: (x.clone() * x.clone()).sum())(X), 2 * X)

    def snapshot(x):
        y = pydiff.zeros((3,), device=device)
        y.copy_(x.detach())
        return (y * y * x).sum()

    np.testing.assert_allclose(pydiff.grad(snapshot)(X), X**2, rtol=1e-6)


@pytest.mark.parametrize("then", ["clone", "copy_"])
def test_a_copy_of_an_unrecorded_result_of_copied_values_keeps_the_mark(device, then):
    # Before: y.copy_(x); z = y * 2 (no tape records it: y needs no gradient); w = z.clone()
    # or w.copy_(z): grad of (w * x).sum() came out 2x (the copy's path lost) where 4x is
    # right. Now the copy of z keeps z's mark and the transform refuses it.
    def f(x):
        y = pydiff.zeros((3,), device=device)
        y.copy_(x)
        z = y * 2.0
        if then == "clone":
            w = z.clone()
        else:
            w = pydiff.zeros((3,), device=device)
            w.copy_(z)
        return (w * x).sum()

    with pytest.raises(RuntimeError, match=r"copy_"):
        pydiff.grad(f)(pydiff.tensor(X, device=device))

    def g(x):  # the same through a clone on the tape of x itself: exact
        return (x.clone() * 2.0 * x).sum()

    np.testing.assert_allclose(
        pydiff.grad(g)(pydiff.tensor(X, device=device)).numpy(), 4.0 * X, rtol=1e-5
    )
