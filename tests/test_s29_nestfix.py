"""Transforms and struct (dict) arguments of user Slang functions: vjp refuses a struct or
torch primal (their gradients were dropped as None); hvp / hessian / jvp on a tape of a
shader call with a constant struct, array or vector argument (a zero direction of the
argument's own type); the refusal of a struct field that needs a gradient under second order
names the user's function, parameter and field."""

from __future__ import annotations

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import ops

SOURCE = """
struct P : IDifferentiable { float a; float b; };
struct Q : IDifferentiable { P p; float3 v; };
struct R : IDifferentiable { float a; int n; };
[Differentiable] float g(P p, float x) { return p.a * p.a * sin(x) + p.b * x * x * p.a; }
[Differentiable] float g_nested(Q q, float x) { return q.p.a * sin(x) * q.v.y + q.p.b * x * x; }
[Differentiable] float g_int(R r, float x) { return r.a * sin(x) * float(r.n); }
[Differentiable] float g_arr(float c[3], float x) { return c[1] * sin(x); }
[Differentiable] float g_vec(float3 c, float x) { return c.y * sin(x); }
"""

X = np.array([0.5, -1.0, 2.0])
U = np.array([1.0, -2.0, 0.5])


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s29_nestfix", SOURCE, device=device)


def _g64(a, b, x):
    return a * a * np.sin(x) + b * x * x * a


def _central(f, x, eps=1e-5):
    """Float64 central differences of a scalar function of a vector."""
    out = np.zeros_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = eps
        out[i] = (f(x + e) - f(x - e)) / (2 * eps)
    return out


# --- 1. vjp of a struct (dict) primal --------------------------------------------------------


def test_vjp_refuses_a_dict_primal_as_grad_does(device, m):
    x = pydiff.tensor(X, device=device)
    q = {"a": pydiff.tensor([1.5, -0.5, 2.0], device=device, requires_grad=True), "b": 1.0}
    with pytest.raises(
        TypeError, match=r"vjp: primal 0 is a struct \(dict\).*primals of their own"
    ):
        pydiff.vjp(lambda q: m.g(q, x, _result="tensor"), (q,), (np.ones(3),))
    with pytest.raises(TypeError, match=r"primal 0 \('p' of .*g\) is a struct \(dict\)"):
        pydiff.vjp(m.g, (q, x), (np.ones(3),))
    with pytest.raises(TypeError, match=r"primal 1 holds a struct \(dict\)"):
        pydiff.vjp(lambda x, qs: m.g(qs[0], x, _result="tensor"), (x, [q]), (np.ones(3),))


def test_vjp_refuses_a_torch_primal(device):
    torch = pytest.importorskip("torch")
    x = pydiff.tensor(X, device=device)
    with pytest.raises(TypeError, match=r"vjp: primal 0 is a torch tensor.*from_torch"):
        pydiff.vjp(lambda t, x: ops.mul(x, x), (torch.ones(3, requires_grad=True), x), (U,))


def test_vjp_the_documented_way_for_a_struct_matches_central_differences(device, m):
    """The tensor inside the struct as a primal of its own: d/da of sum(u * g) in float64."""
    a64 = np.array([1.5, -0.5, 2.0])
    x = pydiff.tensor(X, device=device)
    a = pydiff.tensor(a64, device=device)
    _, (ga,) = pydiff.vjp(lambda a: m.g({"a": a, "b": 1.0}, x, _result="tensor"), (a,), (U,))
    ref = _central(lambda a: float(np.sum(U * _g64(a, 1.0, X))), a64)
    np.testing.assert_allclose(ga.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_vjp_still_gives_none_for_ints_and_other_values(device):
    x = pydiff.tensor(X, device=device)
    for other in (3, None, "abc", True, object(), np.array([1, 2, 3])):
        _, (g_other, gx) = pydiff.vjp(lambda o, x: ops.mul(x, x), (other, x), (U,))
        assert g_other is None
        np.testing.assert_allclose(gx.numpy(), 2 * X * U, rtol=1e-6)


# --- 2. second order through a call with a constant struct argument --------------------------


def _hu_const(a, b):
    return (-(a**2) * np.sin(X) + 2 * a * b) * U


def test_hvp_and_hessian_with_a_constant_struct_argument(device, m):
    f = lambda x: ops.sum(m.g({"a": 1.5, "b": 0.3}, x, _result="tensor"))  # noqa: E731
    x = pydiff.tensor(X, device=device)
    (hu,) = pydiff.hvp(f, (x,), (U,))
    np.testing.assert_allclose(hu.numpy(), _hu_const(1.5, 0.3), rtol=1e-5, atol=1e-6)
    h = pydiff.hessian(f, (x,))
    np.testing.assert_allclose(h @ U, _hu_const(1.5, 0.3), rtol=1e-5, atol=1e-6)
    # the Hessian is diagonal (elementwise): its off-diagonal is zero
    np.testing.assert_allclose(h - np.diag(np.diag(h)), 0.0, atol=1e-7)


def test_hvp_with_a_constant_tensor_field(device, m):
    a64 = np.array([1.5, -0.5, 2.0])
    a = pydiff.tensor(a64, device=device)  # closed over, no gradient wanted
    f = lambda x: ops.sum(m.g({"a": a, "b": 0.3}, x, _result="tensor"))  # noqa: E731
    (hu,) = pydiff.hvp(f, (pydiff.tensor(X, device=device),), (U,))
    np.testing.assert_allclose(hu.numpy(), _hu_const(a64, 0.3), rtol=1e-5, atol=1e-6)


def test_jvp_on_a_tape_with_a_constant_struct_then_backward(device, m):
    """d/dx <grad f, u> by the tape, against float64 central differences of the tangent."""
    f = lambda x: ops.sum(m.g({"a": 1.5, "b": 0.3}, x, _result="tensor"))  # noqa: E731
    x = pydiff.tensor(X, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        _, t = pydiff.jvp(f, (x,), (U,))
    tangent64 = lambda x: float(np.sum((2.25 * np.cos(x) + 2 * 0.3 * 1.5 * x) * U))  # noqa: E731
    assert float(t.numpy()) == pytest.approx(tangent64(X), rel=1e-5)
    tape.backward(t)
    np.testing.assert_allclose(x.grad.numpy(), _central(tangent64, X), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name, call, scale",
    [
        # d2/dx2 of sum(c(x)) = -k sin(x), k from the constant argument
        (
            "nested struct",
            lambda m, x: m.g_nested(
                {"p": {"a": 1.5, "b": 0.0}, "v": spy.float3(1, 2, 3)}, x, _result="tensor"
            ),
            3.0,
        ),  # noqa: E501
        (
            "struct with an int field",
            lambda m, x: m.g_int({"a": 1.5, "n": 2}, x, _result="tensor"),
            3.0,
        ),  # noqa: E501
        ("array as a list", lambda m, x: m.g_arr([1.0, 2.0, 3.0], x, _result="tensor"), 2.0),
        ("float3 vector", lambda m, x: m.g_vec(spy.float3(1, 2, 3), x, _result="tensor"), 2.0),
    ],
)
def test_hvp_with_other_constant_arguments(device, m, name, call, scale):
    f = lambda x: ops.sum(call(m, x))  # noqa: E731
    (hu,) = pydiff.hvp(f, (pydiff.tensor(X, device=device),), (U,))
    np.testing.assert_allclose(hu.numpy(), -scale * np.sin(X) * U, rtol=1e-5, atol=1e-6)


# --- 4. a struct field that needs a gradient under second order ------------------------------


def test_hvp_refuses_a_struct_field_needing_a_gradient_by_the_users_names(device, m):
    w = pydiff.tensor([1.5, -0.5, 2.0], device=device, requires_grad=True)
    f = lambda x: ops.sum(m.g({"a": w, "b": 0.3}, x, _result="tensor"))  # noqa: E731
    x = pydiff.tensor(X, device=device)
    with pytest.raises(NotImplementedError) as hvp_error:
        pydiff.hvp(f, (x,), (U,))
    text = str(hvp_error.value)
    assert "s29_nestfix.g" in text and "parameter 'p'" in text and "p['a']" in text
    assert "ShaderTangent" not in text and "forward(ctx" not in text
    # nested: the path of the field; jvp on a tape refuses it the same way
    q = {"p": {"a": w, "b": 0.0}, "v": spy.float3(1, 2, 3)}
    with pytest.raises(NotImplementedError, match=r"parameter 'q' .*\(q\['p'\]\['a'\]\)"):
        with pydiff.Tape():
            pydiff.jvp(lambda x: ops.sum(m.g_nested(q, x, _result="tensor")), (x,), (U,))
    assert w.grad is None or not np.any(w.grad.numpy())


def test_the_detached_field_the_message_offers_gives_the_closed_form(device, m):
    a64 = np.array([1.5, -0.5, 2.0])
    w = pydiff.tensor(a64, device=device, requires_grad=True)
    f = lambda x: ops.sum(m.g({"a": w.detach(), "b": 0.3}, x, _result="tensor"))  # noqa: E731
    (hu,) = pydiff.hvp(f, (pydiff.tensor(X, device=device),), (U,))
    np.testing.assert_allclose(hu.numpy(), _hu_const(a64, 0.3), rtol=1e-5, atol=1e-6)


# --- 3. `pydiff check` tests the forward derivative of struct functions ----------------------

CHECK_SOURCE = """
struct P : IDifferentiable { float a; float b; };
struct Inner : IDifferentiable { float a; float2 v; };
struct Held : IDifferentiable { Inner inner; no_diff float k; int n; };
// wrong: d/dx is 2 a x; this says 3 a x
[Differentiable] [ForwardDerivative(gf_fwd)] float gf(P q, float x) { return q.a * x * x + q.b; }
DifferentialPair<float> gf_fwd(DifferentialPair<P> q, DifferentialPair<float> x) {
  return diffPair(q.p.a * x.p * x.p + q.p.b, q.d.a * x.p * x.p + q.d.b + 3.0 * q.p.a * x.p * x.d);
}
[Differentiable] float good(P q, float x) { return q.a * x * x + q.b * q.b; }
// a no_diff field and an int field are held fixed: no row, no false FAIL
[Differentiable] float held(Held h, float x) {
  return h.inner.a * x * x + h.inner.v.x * h.inner.v.y * x + h.k * float(h.n);
}
"""


@pytest.fixture
def check_rows(device, tmp_path):
    from pydiff.modcheck import check_module

    path = tmp_path / "s29_check_struct.slang"
    path.write_text(CHECK_SOURCE)
    rows = check_module(path, device=device)
    return {(r.function, r.parameter, r.mode): r for r in rows}


def test_check_fails_a_wrong_forward_derivative_of_a_struct_function(check_rows):
    assert check_rows[("gf", "(all)", "forward")].status == "FAIL"
    # the backward derivative (Slang's, from the primal) is right
    assert check_rows[("gf", "q.a", "backward")].status == "PASS"
    assert check_rows[("gf", "x", "backward")].status == "PASS"


def test_check_passes_correct_struct_functions_forward_too(check_rows):
    for fn in ("good", "held"):
        status = {(p, mode): r.status for (f, p, mode), r in check_rows.items() if f == fn}
        assert status[("(all)", "forward")] == "PASS", status
        assert status[("(all)", "adjoint")] == "PASS", status
        assert all(s == "PASS" for s in status.values()), status
    held = {p for (f, p, mode) in check_rows if f == "held" and mode == "backward"}
    assert held == {"h.inner.a", "h.inner.v", "x"}  # h.k (no_diff) and h.n (int) held fixed


def test_the_cli_exits_nonzero_on_a_wrong_struct_forward_derivative(device, tmp_path):
    from test_cli import pydiff_cli

    path = tmp_path / "s29_check_struct.slang"
    path.write_text(CHECK_SOURCE)
    out = pydiff_cli("check", str(path), "--function", "gf", device=device)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "forward" in out.stdout and "FAIL" in out.stdout


# --- 6. zero-size tensors: refused naming the function ---------------------------------------


@pytest.mark.parametrize(
    "what, make",
    [
        ("pydiff.tensor", lambda d: pydiff.tensor(np.zeros(0), device=d)),
        ("pydiff.tensor", lambda d: pydiff.tensor([], device=d)),
        ("pydiff.tensor", lambda d: pydiff.tensor(np.zeros((2, 0)), device=d)),
        ("pydiff.tensor", lambda d: pydiff.tensor(np.zeros((0, 3)), dtype="float3", device=d)),
        ("pydiff.zeros", lambda d: pydiff.zeros((0,), device=d)),
        ("pydiff.empty", lambda d: pydiff.empty((3, 0), dtype="int", device=d)),
    ],
)
def test_zero_size_tensors_are_refused_naming_the_function(device, what, make):
    with pytest.raises(ValueError) as refused:
        make(device)
    text = str(refused.value)
    assert text.startswith(what + ":") or text.startswith(what + " "), text
    assert "0" in text and "no zero-size tensors" in text and "skip the call" in text
