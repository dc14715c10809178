"""Forward mode through struct (dict) and array arguments, generic functions under hvp,
tangents dropped at no_diff parameters, vjp's one-output cotangent and the transforms that
cannot run inside a recording tape (breaker findings F1, F6, F9, F10, F11, F13). Expected
values are closed forms."""

import warnings

import numpy as np
import pytest

import pydiff
from pydiff import ops
from pydiff.errors import GradientFlowWarning

SOURCE = """
struct Q : IDifferentiable { float a; float b; };
struct R : IDifferentiable { float a; no_diff float c; };
struct P { float a; float b; };
[Differentiable] float sq(Q q, float x) { return q.a * x * x + q.b; }
[Differentiable] float sr(R r, float x) { return r.a * x * r.c; }
[Differentiable] float sp(P q, float x) { return q.a * x * x + q.b; }
[Differentiable] float arr(float a[3], float s) { return s * (a[0] * a[1] + a[2] * a[2]); }
[Differentiable] T cube<T : __BuiltinFloatingPointType>(T x) { return x * x * x; }
[Differentiable] float nd_param(float a, no_diff float x) { return a * x * x; }
// a forward derivative that forgets x^2 on q.a: gradcheck's forward check must catch it
DifferentialPair<float> sqw_fwd(DifferentialPair<Q> q, DifferentialPair<float> x)
{
    return diffPair(q.p.a * x.p * x.p + q.p.b, q.d.a * x.p + q.d.b + 2.0 * q.p.a * x.p * x.d);
}
[Differentiable][ForwardDerivative(sqw_fwd)]
float sqw(Q q, float x) { return q.a * x * x + q.b; }
"""

A = np.array([0.5, -1.0, 2.0])


@pytest.fixture
def m(device):
    pydiff.set_default_device(device)
    return pydiff.load_module_from_source("forward_struct_array", SOURCE, device=device)


def test_jvp_and_jacfwd_follow_a_tensor_in_a_struct_argument(m):
    # f(a) = a x^2 + 1 at x = 2: df/da = x^2 = 4 (a was dropped: tangent 0)
    def f(a):
        return m.sq({"a": a, "b": 1.0}, 2.0, _result="tensor")

    _, t = pydiff.jvp(f, (pydiff.tensor(A),), (np.array([1.0, 2.0, 3.0]),))
    np.testing.assert_allclose(t.numpy(), 4.0 * np.array([1.0, 2.0, 3.0]), rtol=1e-6)
    np.testing.assert_allclose(pydiff.jacfwd(f)(pydiff.tensor(A)), 4.0 * np.eye(3), rtol=1e-6)
    a = pydiff.tensor(A, requires_grad=True)
    assert pydiff.gradcheck(f, (a,), check_forward=True)


def test_fwds_takes_tangents_of_tensors_in_struct_fields(m):
    at = pydiff.tensor(A).with_tangent(np.ones(3))
    y, dy = m.sq.fwds({"a": at, "b": 1.0}, 2.0)
    np.testing.assert_allclose(y.numpy(), 4 * A + 1, rtol=1e-6)
    np.testing.assert_allclose(dy.numpy(), [4.0, 4.0, 4.0], rtol=1e-6)
    # the tangent on field b (d/db = 1) and on x at once: d/dx (a x^2) = 2 a x
    y, dy = m.sq.fwds({"a": pydiff.tensor(A), "b": at}, (2.0, 0.5))
    np.testing.assert_allclose(dy.numpy(), 1.0 + 0.5 * 4 * A, rtol=1e-6)


def test_gradcheck_checks_forward_mode_through_struct_fields(m):
    a = pydiff.tensor(A, requires_grad=True)
    b = pydiff.tensor([0.1, 0.2, 0.3], requires_grad=True)
    x = pydiff.tensor([1.5, -0.5, 2.0], requires_grad=True)
    assert pydiff.gradcheck(m.sq, ({"a": a, "b": b}, x), check_forward=True)
    # the backward alone is right, and forward mode is checked by default too (break48b:
    # before, the default left it out with struct arguments and the wrong one passed)
    with pytest.raises(pydiff.GradcheckError, match="forward mode"):
        pydiff.gradcheck(m.sqw, ({"a": a, "b": b}, x))
    assert pydiff.gradcheck(m.sqw, ({"a": a, "b": b}, x), check_forward=False)
    with pytest.raises(pydiff.GradcheckError, match="forward mode"):
        pydiff.gradcheck(m.sqw, ({"a": a, "b": b}, x), check_forward=True)


def test_struct_tangent_where_no_derivative_flows_warns(m):
    at = pydiff.tensor(A).with_tangent(np.ones(3))
    with pytest.warns(GradientFlowWarning, match="'r.c'"):
        _, dy = m.sr.fwds({"a": at, "c": at}, 2.0)
    np.testing.assert_allclose(dy.numpy(), 2.0 * A, rtol=1e-6)  # d/da (a x c) = x c only
    with pytest.warns(GradientFlowWarning, match="not IDifferentiable"):
        _, dy = m.sp.fwds({"a": at, "b": 1.0}, 2.0)
    np.testing.assert_allclose(dy.numpy(), 0.0)


def test_struct_refusals_name_the_parameter(m):
    at = pydiff.tensor(A).with_tangent(np.ones(3))
    ones = np.ones(3)
    with pytest.raises(TypeError, match="'q'.*pair of a struct"):
        m.sq.fwds(({"a": pydiff.tensor(A), "b": 1.0}, {"a": ones, "b": 0.0}), 2.0)
    with pytest.raises(TypeError, match="jvp: primal 0 \\('q'"):
        pydiff.jvp(m.sq, ({"a": pydiff.tensor(A), "b": 1.0}, 2.0), ({"a": ones}, None))
    with pytest.raises(TypeError, match="hvp: primal 0 \\('q'"):
        pydiff.hvp(m.sq, ({"a": pydiff.tensor(A), "b": 1.0}, 2.0), ({"a": ones}, 0.0))
    with pytest.raises(TypeError, match="hessian: primal 0 \\('q'"):
        pydiff.hessian(m.sq, ({"a": pydiff.tensor(A), "b": 1.0}, 2.0))
    with pytest.raises(TypeError, match="'a'.*list"):
        m.arr.fwds([at, 1.0, 2.0], 1.0)

    def g(a):  # sum(4 a^2 + a): H = 8 I, but the struct path has no second order
        return ops.sum(m.sq({"a": a, "b": 1.0}, 2.0, _result="tensor") * a)

    with pytest.raises(NotImplementedError, match="parameter 'q'.*struct"):
        pydiff.hvp(g, (pydiff.tensor(A),), (ones,))
    with pytest.raises(NotImplementedError, match="parameter 'q'.*struct"):
        pydiff.hessian(g, (pydiff.tensor(A),))


def test_forward_mode_of_a_float_array_parameter(m):
    # f(a, s) = s (a0 a1 + a2^2): J u = s (u0 a1 + a0 u1 + 2 a2 u2) + us (a0 a1 + a2^2)
    V = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]])
    U = np.array([[1.0, 0.5, -2.0], [0.0, 1.0, 3.0]])
    s, us = 1.3, 0.7

    def jvp_want(v, u, us):
        ds = s * (u[:, 0] * v[:, 1] + v[:, 0] * u[:, 1] + 2 * v[:, 2] * u[:, 2])
        return ds + us * (v[:, 0] * v[:, 1] + v[:, 2] ** 2)

    y, dy = m.arr.fwds(pydiff.tensor(V).with_tangent(U), (s, us))
    np.testing.assert_allclose(y.numpy(), s * (V[:, 0] * V[:, 1] + V[:, 2] ** 2), rtol=1e-6)
    np.testing.assert_allclose(dy.numpy(), jvp_want(V, U, us), rtol=1e-5)
    _, dy = pydiff.jvp(lambda v: m.arr(v, s, _result="tensor"), (pydiff.tensor(V),), (U,))
    np.testing.assert_allclose(dy.numpy(), jvp_want(V, U, 0.0), rtol=1e-5)
    # H u of sum f over a: s (u1, u0, 2 u2) per row
    hu = s * np.stack([U[:, 1], U[:, 0], 2 * U[:, 2]], axis=1)
    (h,) = pydiff.hvp(lambda v: m.arr(v, s, _result="tensor").sum(), (pydiff.tensor(V),), (U,))
    np.testing.assert_allclose(h.numpy(), hu, rtol=1e-5)
    h, _ = pydiff.hvp(m.arr, (pydiff.tensor(V), s), (U, None))
    np.testing.assert_allclose(h.numpy(), hu, rtol=1e-5)


def test_hvp_and_hessian_of_a_generic_function_at_float(m):
    X, U = np.array([0.5, -1.0, 2.0]), np.array([1.0, 2.0, 3.0])

    def f(a):
        return ops.sum(m.cube(a, _result="tensor"))

    (h,) = pydiff.hvp(f, (pydiff.tensor(X),), (U,))
    np.testing.assert_allclose(h.numpy(), 6 * X * U, rtol=1e-5)
    np.testing.assert_allclose(pydiff.hessian(f, (pydiff.tensor(X),)), np.diag(6 * X), rtol=1e-5)
    (h,) = pydiff.hvp(m.cube, (pydiff.tensor(X),), (U,))
    np.testing.assert_allclose(h.numpy(), 6 * X * U, rtol=1e-5)


def test_tangent_given_to_a_no_diff_parameter_warns(m):
    X = pydiff.tensor(A)
    with pytest.warns(GradientFlowWarning, match="'x' is no_diff"):
        _, dy = m.nd_param.fwds(1.0, pydiff.tensor(A).with_tangent(np.ones(3)))
    np.testing.assert_allclose(dy.numpy(), 0.0)
    with pytest.warns(GradientFlowWarning, match="'x' is no_diff"):
        pydiff.jvp(m.nd_param, (1.0, X), (None, np.ones(3)))
    with pytest.warns(GradientFlowWarning, match="'x' is no_diff"):
        J = pydiff.jacfwd(lambda x: m.nd_param(1.0, x, _result="tensor"))(X)
    np.testing.assert_allclose(J, 0.0)
    with pytest.warns(GradientFlowWarning, match="'x' is no_diff"):
        _, dy = m.nd_param.fwds(1.0, (2.0, 1.0))
    assert dy == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tangent given there: nothing to say
        _, dy = m.nd_param.fwds((1.0, 1.0), X)
    np.testing.assert_allclose(dy.numpy(), A**2, rtol=1e-6)


def test_vjp_of_one_output_takes_a_one_tuple_of_cotangents(device):
    pydiff.set_default_device(device)
    x, u = pydiff.tensor(A), np.array([1.0, 2.0, 3.0])
    for fn, scale in ((lambda a: a * 2.0, 2.0), (lambda a: a, 1.0)):
        for cot in ((u,), [u], (pydiff.tensor(u),)):
            _, (g,) = pydiff.vjp(fn, (x,), cot)
            np.testing.assert_allclose(g.numpy(), scale * u, rtol=1e-6)
    _, (g,) = pydiff.vjp(lambda a: ops.sum(a * a), (x,), (0.5,))
    np.testing.assert_allclose(g.numpy(), A, rtol=1e-6)  # 0.5 * 2a
    with pytest.raises(ValueError, match="vjp: cotangents has shape \\(2, 3\\)"):
        pydiff.vjp(lambda a: a * 2.0, (x,), (u, u))


@pytest.mark.parametrize("name", ["vjp", "jacrev", "hvp", "hessian", "grad", "gradcheck"])
def test_transforms_with_a_tape_of_their_own_refuse_inside_a_recording_tape(device, name):
    pydiff.set_default_device(device)
    W = pydiff.tensor([0.3, 0.7, -0.2], requires_grad=True)
    x = pydiff.tensor(A)

    def f(a):
        return ops.sum(ops.tanh(a * W))

    run = {
        "vjp": lambda: pydiff.vjp(f, (x,), np.array(1.0)),
        "jacrev": lambda: pydiff.jacrev(f)(x),
        "hvp": lambda: pydiff.hvp(f, (x,), (np.ones(3),)),
        "hessian": lambda: pydiff.hessian(f, (x,)),
        "grad": lambda: pydiff.grad(f)(x),
        "gradcheck": lambda: pydiff.gradcheck(f, (pydiff.tensor(A, requires_grad=True),)),
    }[name]
    with pydiff.Tape() as tape:
        loss = ops.sum(W * W)
        with pytest.raises(RuntimeError, match=f"pydiff.{name} cannot run while a pydiff.Tape"):
            run()
        pydiff.jvp(f, (x,), (np.ones(3),))  # forward mode records on the tape itself
    tape.backward(loss)
    np.testing.assert_allclose(W.grad.numpy(), 2 * np.array([0.3, 0.7, -0.2]), rtol=1e-6)
    run()  # outside the block it runs


def test_hvp_retried_after_a_failed_wrapper_raises_again(device, tmp_path):
    # the Slang session keeps a module that failed to compile; loading the same name again
    # handed back the half-built module and the second hvp crashed the interpreter
    src = """
[Differentiable][ForwardDerivative(softplus_fwd)]
float softplus(float x) { return log(1.0 + exp(x)); }
DifferentialPair<float> softplus_fwd(DifferentialPair<float> x)
{ return diffPair(log(1.0 + exp(x.p)), x.d / (1.0 + exp(-x.p))); }
"""
    with pytest.warns(pydiff.ShaderTrapWarning, match="softplus_fwd"):  # (since fix49b:
        m = pydiff.load_module_from_source("hvp_retry", src, device=device)  # refused first)
    x = pydiff.tensor([-1.0, 0.0, 0.5, 2.0], device=device)
    with pytest.raises(pydiff.ShaderTrapError, match="softplus_fwd\\(\\) \\[Differentiable\\]"):
        pydiff.hvp(m.softplus, (x,), (np.ones(4),))
    path = tmp_path / "hvp_retry_nolint.slang"
    path.write_text(src)
    m = pydiff.load_module(path, device=device, lint=False)  # the build itself fails
    for _ in range(3):
        with pytest.raises(
            pydiff.SlangCompileError,
            match=r"hvp_retry_nolint.slang:3: hvp: .*softplus_fwd\(\) is not differentiable.*"
            r"must itself be \[Differentiable\]",
        ):
            pydiff.hvp(m.softplus, (x,), (np.ones(4),))
    with pytest.raises(pydiff.SlangCompileError, match="hvp_retry_broken"):
        pydiff.load_module_from_source("hvp_retry_broken", "float f( {", device=device)
    with pytest.raises(pydiff.SlangCompileError, match="hvp_retry_broken"):
        pydiff.load_module_from_source("hvp_retry_broken", "float f( {", device=device)


def test_reshape_and_clone_keep_a_tangent_attached_by_hand(device):
    m = pydiff.load_module_from_source(
        "hand_tangent",
        "[Differentiable] float f(float a, float x) { return a * x * x; }",
        device=device,
    )
    values = np.arange(1, 7, dtype=np.float64)
    u = np.linspace(-1.0, 2.0, 6)
    x = pydiff.tensor(values, device=device).with_tangent(u)
    want = 2.0 * 2.0 * values * u  # d(a x^2) = 2 a x u
    for view, expect in ((x.reshape((2, 3)), want.reshape(2, 3)), (x.clone(), want)):
        _, dy = m.f.fwds(2.0, view)
        np.testing.assert_allclose(dy.numpy(), expect, rtol=1e-6)
    assert x.reshape((2, 3)).tangent.storage is x.tangent.storage  # a view of it
    view = x.reshape((2, 3))
    x.with_tangent(2.0 * u)  # a view made before follows the base's new tangent
    np.testing.assert_allclose(m.f.fwds(2.0, view)[1].numpy(), 2.0 * want.reshape(2, 3), rtol=1e-6)
    assert x.clone().tangent.storage is not x.tangent.storage  # a copy of it
