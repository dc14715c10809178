"""break48b: forward mode, transforms, torch interop, Functions and gradcheck broken as a
demanding user would. References: closed forms checked by float64 central differences
(numpy), never pydiff's own output."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

SOURCE = """
import slangpy;
// x*x with a hand-written backward 2% off: 2.04 x instead of 2 x
[Differentiable] [BackwardDerivative(sqw_bwd)] float sqw(float x) { return x * x; }
void sqw_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 2.04 * x.p * d); }
[Differentiable] float sq(float x) { return x * x; }
// x*x*h with the derivative in x 2% off, beside a half parameter
[Differentiable] [BackwardDerivative(mixw_bwd)]
float mixw(float x, half h) { return x * x * float(h); }
void mixw_bwd(inout DifferentialPair<float> x, inout DifferentialPair<half> h, float d)
{
    x = diffPair(x.p, 2.04 * x.p * float(h.p) * d);
    h = diffPair(h.p, half(x.p * x.p * d));
}
[Differentiable] float mix(float x, half h) { return x * x * float(h); }
// a * x^2 + b with a struct parameter, and a [ForwardDerivative] wrong in x (3 a x, not 2 a x)
struct P : IDifferentiable { float a; float b; };
[Differentiable] [ForwardDerivative(stw_fwd)] float stw(P p, float x) { return p.a * x * x + p.b; }
[Differentiable]
DifferentialPair<float> stw_fwd(DifferentialPair<P> p, DifferentialPair<float> x)
{
    float d = p.d.a * x.p * x.p + p.p.a * 3.0 * x.p * x.d + p.d.b;
    return diffPair(p.p.a * x.p * x.p + p.p.b, d);
}
[Differentiable] float st(P p, float x) { return p.a * x * x + p.b; }
"""

X = np.array([0.5, -1.5, 2.0, 1.0])


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s48_break48b", SOURCE, device=device)


def _central(f, x, h=1e-6):
    """float64 central differences of an elementwise f (the reference derivative)."""
    return (f(x + h) - f(x - h)) / (2 * h)


def test_reference_derivatives_differ_from_the_wrong_ones():
    # the references the gradcheck cases below rest on: d(x^2)/dx = 2x, not 2.04x / 2.08x
    np.testing.assert_allclose(_central(lambda x: x * x, X), 2 * X, rtol=1e-8)
    assert np.all(np.abs(2.04 * X - _central(lambda x: x * x, X)) > 1e-2 * np.abs(2 * X))


def test_gradcheck_half_output_does_not_loosen_a_float_output(m):
    """A half output beside a float32 one raised the tolerances for every output: a float32
    gradient 2% off passed once the function also returned a half value."""
    x = pydiff.tensor(X, requires_grad=True, device=m.device)
    assert not pydiff.gradcheck(m.sqw, (x,), raise_exception=False)  # alone: caught

    def with_half_aux(x):
        return m.sqw(x, _result="tensor"), ops.mul(x, 0.5).astype("half")

    assert not pydiff.gradcheck(with_half_aux, (x,), raise_exception=False)

    def right_with_half_aux(x):
        return m.sq(x, _result="tensor"), ops.mul(x, x).astype("half")

    assert pydiff.gradcheck(right_with_half_aux, (x,))


def test_gradcheck_half_input_does_not_loosen_a_float_input(m):
    """A checked half input raised the tolerances for every input: the float input's
    gradient 2% off passed beside it."""
    x = pydiff.tensor(X, requires_grad=True, device=m.device)
    h = pydiff.tensor([1.0, 0.5, -1.0, 2.0], dtype="half", requires_grad=True, device=m.device)
    assert not pydiff.gradcheck(m.mixw, (x, h), raise_exception=False)
    assert pydiff.gradcheck(m.mix, (x, h))


class _SquareOverwrites(pydiff.Function):
    """x * x whose backward *writes* 2 x g into ctx.grad_target(0) instead of adding it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return ops.mul(x, x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        target = ctx.grad_target(0)
        if target is not None:
            target.copy_(ops.mul(ops.mul(x, 2.0), g))  # the bug: copy_, not an add
        return None


class _SquareAdds(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return ops.mul(x, x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        target = ctx.grad_target(0)
        if target is not None:
            target.copy_(ops.add(target, ops.mul(ops.mul(x, 2.0), g)))
        return None


def test_gradcheck_catches_a_backward_overwriting_its_grad_target(device):
    """gradcheck lent zeroed gradient buffers, so a backward that overwrote
    ctx.grad_target(k) instead of adding passed, while in use the gradient came out wrong
    as soon as another contribution was there first (here sin(x) beside it)."""
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        y = ops.add(_SquareOverwrites.apply(x), ops.sin(x))
        s = ops.sum(y)
    tape.backward(s)
    want = _central(lambda v: v * v + np.sin(v), X)  # float64 reference: 2x + cos x
    assert not np.allclose(x.grad.numpy(), want, rtol=1e-3)  # wrong in use ...
    assert not pydiff.gradcheck(_SquareOverwrites, (x,), raise_exception=False)  # ... caught
    assert pydiff.gradcheck(_SquareAdds, (x,))
    x2 = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        s = ops.sum(ops.add(_SquareAdds.apply(x2), ops.sin(x2)))
    tape.backward(s)
    np.testing.assert_allclose(x2.grad.numpy(), want, rtol=1e-5, atol=1e-6)


class _MarkedP1(pydiff.Function):
    """Pattern 1 (no backward): y = x^2, and z = 3x marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        y, z = ops.mul(x, x), ops.mul(x, 3.0)
        ctx.mark_non_differentiable(z)
        return y, z


class _MarkedP2(pydiff.Function):
    """Pattern 2 (backward and jvp): the same, the jvp rule returning 3u for z as well."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y, z = ops.mul(x, x), ops.mul(x, 3.0)
        ctx.mark_non_differentiable(z)
        return y, z

    @staticmethod
    def backward(ctx, gy, gz):
        (x,) = ctx.saved_tensors
        return ops.mul(ops.mul(x, 2.0), gy)

    @staticmethod
    def jvp(ctx, u):
        (x,) = ctx.saved_tensors
        return ops.mul(ops.mul(x, 2.0), u), ops.mul(u, 3.0)


@pytest.mark.parametrize("cls", [_MarkedP1, _MarkedP2])
def test_forward_mode_of_a_marked_output_agrees_with_reverse_mode(device, cls):
    """An output given to ctx.mark_non_differentiable is a constant (detached): reverse
    mode gave it a zero derivative, forward mode passed the tangent through (jacfwd 3 I
    where jacrev gave 0, and jvp of sum(z * x) counted z's tangent)."""
    x = pydiff.tensor(X, device=device)
    jr = pydiff.jacrev(lambda x: cls.apply(x)[1])(x)
    jf = pydiff.jacfwd(lambda x: cls.apply(x)[1])(x)
    np.testing.assert_array_equal(jr, np.zeros((4, 4)))
    np.testing.assert_array_equal(jf, np.zeros((4, 4)))
    # f(x) = sum(stop(3x) * x): df . u = sum(3x * u) with z held (float64 by hand)
    u = np.array([1.0, -2.0, 0.5, 3.0])
    _, slope = pydiff.jvp(lambda x: ops.sum(ops.mul(cls.apply(x)[1], x)), (x,), (u,))
    np.testing.assert_allclose(slope.numpy(), np.sum(3 * X * u), rtol=1e-6)
    (g,) = [pydiff.grad(lambda x: ops.sum(ops.mul(cls.apply(x)[1], x)))(X)]
    np.testing.assert_allclose(g, 3 * X, rtol=1e-6)
    # y keeps its derivative: 2x u
    _, (ty, tz) = pydiff.jvp(cls.apply, (x,), (u,))
    np.testing.assert_allclose(ty.numpy(), 2 * X * u, rtol=1e-6)
    np.testing.assert_array_equal(tz.numpy(), np.zeros(4))


@pytest.mark.parametrize("cls", [_MarkedP1, _MarkedP2])
def test_gradcheck_leaves_out_a_marked_output(device, cls):
    """gradcheck failed a right Function with a marked output: it took the output as one
    no input reaches (a zero Jacobian) while its finite differences are 3 (torch's
    gradcheck leaves outputs without a gradient out). y = x^2 is still checked."""
    x = pydiff.tensor(X, requires_grad=True, device=device)
    assert pydiff.gradcheck(cls, (x,))
    assert pydiff.gradcheck(cls, (x,), check_forward=True)

    class WrongY(cls):
        @staticmethod
        def backward(ctx, gy, gz):
            (x,) = ctx.saved_tensors
            return ops.mul(ops.mul(x, 2.1), gy)  # 5% off: still caught

    if cls is _MarkedP2:
        assert not pydiff.gradcheck(WrongY, (x,), raise_exception=False)


def test_gradcheck_checks_forward_mode_with_struct_arguments(m):
    """With a struct (dict) argument, gradcheck's default skipped forward mode: a wrong
    [ForwardDerivative] (which pydiff.jvp and .fwds then use) passed unless
    check_forward=True was given. Reference: d(a x^2 + b) = x^2 da + 2 a x dx + db."""
    x = pydiff.tensor([0.5, -1.0, 2.0], requires_grad=True, device=m.device)
    a = pydiff.tensor([1.0, 2.0, 0.5], requires_grad=True, device=m.device)
    b = pydiff.tensor([0.1, 0.2, 0.3], requires_grad=True, device=m.device)
    xs = np.array([0.5, -1.0, 2.0])
    _, t = pydiff.jvp(
        m.stw, ({"a": 1.0, "b": 0.0}, pydiff.tensor(xs, device=m.device)), (None, np.ones(3))
    )
    want = _central(lambda v: 1.0 * v * v, xs)  # 2x, float64
    assert np.abs(t.numpy() - want).max() > 0.4  # jvp uses the wrong derivative ...
    assert not pydiff.gradcheck(m.stw, ({"a": a, "b": b}, x), raise_exception=False)  # caught
    assert pydiff.gradcheck(m.st, ({"a": a, "b": b}, x))


MIXED_CHECK = """
// x^2 h with the derivative in x 2% off (2.04 x h), beside a half parameter
[Differentiable] [BackwardDerivative(mixw_bwd)]
float mixw(float x, half h) { return x * x * float(h); }
void mixw_bwd(inout DifferentialPair<float> x, inout DifferentialPair<half> h, float d)
{
    x = diffPair(x.p, 2.04 * x.p * float(h.p) * d);
    h = diffPair(h.p, half(x.p * x.p * d));
}
[Differentiable] float mix(float x, half h) { return x * x * float(h); }
"""


def test_pydiff_check_keeps_float_tolerances_for_a_float_parameter(device, tmp_path):
    """`pydiff check` raised every parameter's tolerances to half's once one parameter was
    half: x's derivative 2% off passed (its reference: the float64 central differences
    pydiff check itself takes, 2 x h)."""
    from pydiff.modcheck import check_module

    path = tmp_path / "mixed.slang"
    path.write_text(MIXED_CHECK)
    rows = {(r.function, r.parameter, r.mode): r.status for r in check_module(path, device=device)}
    assert rows[("mixw", "x", "backward")] == "FAIL", rows
    assert rows[("mixw", "h", "backward")] == "PASS", rows
    assert all(s == "PASS" for (f, *_), s in rows.items() if f == "mix"), rows
