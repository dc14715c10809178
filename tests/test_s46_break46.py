"""Session 46 (break46): forward mode, transforms and torch interop probed at edge inputs,
each checked against an independent reference (closed forms, PyTorch float64 autograd)."""

import threading

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def poly():
    return pydiff.load_module("samples/polynomial.slang")


def test_fwds_size_one_tensor_closed_form(poly):
    x = pydiff.tensor([0.5]).with_tangent([2.0])
    _, dy = poly.polynomial.fwds(2.0, 8.0, -1.0, x)
    np.testing.assert_allclose(dy.numpy(), [(4 * 0.5 + 8) * 2.0], rtol=1e-6)


def test_grad_of_function_using_tensor_twice():
    # f(x) = sum(x*x) + sum(x*x*x): grad 2x + 3x^2 (closed form)
    x0 = np.array([0.5, -1.0, 2.0], dtype=np.float32)

    def f(x):
        return ops.add(ops.sum(ops.mul(x, x)), ops.sum(ops.mul(ops.mul(x, x), x)))

    g = np.asarray(pydiff.grad(f)(x0))
    np.testing.assert_allclose(g, 2 * x0 + 3 * x0**2, rtol=1e-5)


def test_torch_function_non_contiguous_input_against_torch_float64():
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4.0
    t = base.t()  # non-contiguous (3, 2)
    assert not t.is_contiguous()
    t = t.detach().requires_grad_(True)
    fn = pydiff.torch_function(lambda a: ops.sum(ops.mul(a, a)))
    out = fn(t)
    out.backward()
    ref = t.detach().double().requires_grad_(True)
    (ref * ref).sum().backward()
    want = float((ref.detach() ** 2).sum())
    np.testing.assert_allclose(float(out.detach()), want, rtol=1e-5)
    np.testing.assert_allclose(t.grad.numpy(), ref.grad.numpy(), rtol=1e-5)


def test_hvp_of_python_function_closed_form():
    # f(a, b) = sum(a^2 b^2); H_bb = diag(2 a^2), H_ba = diag(4 a b)
    a = np.array([1.0, 2.0], dtype=np.float32)
    b = np.array([0.5, 3.0], dtype=np.float32)
    v = np.array([1.0, -2.0], dtype=np.float32)
    _, hv = pydiff.hvp(lambda a, b: (a * a * b * b).sum(), (a, b), (None, v))
    hv_b = np.asarray(hv[1] if isinstance(hv, tuple) else hv)
    np.testing.assert_allclose(hv_b, 2.0 * a.astype(np.float64) ** 2 * v, rtol=1e-5)


def test_jvp_tangent_of_wrong_shape_is_a_clear_error(poly):
    x = pydiff.tensor([1.0, 2.0, 3.0])
    with pytest.raises((ValueError, TypeError)):
        x.with_tangent([1.0, 1.0])


def test_torch_function_used_twice_in_one_graph_retain_graph():
    # y = g(t) + g(t) with g = sum(t^3): dy/dt = 6 t^2; backward twice with retain_graph
    t = torch.tensor([0.5, -1.5, 2.0], requires_grad=True)
    g = pydiff.torch_function(lambda a: ops.sum(ops.mul(ops.mul(a, a), a)))
    y = g(t) + g(t)
    y.backward(retain_graph=True)
    y.backward()
    ref = 2 * 6 * t.detach().double().numpy() ** 2
    np.testing.assert_allclose(t.grad.numpy(), ref, rtol=1e-5)


def test_zero_d_inputs_grad_closed_form():
    f = pydiff.grad(lambda x: ops.sum(ops.mul(x, x)))
    np.testing.assert_allclose(float(np.asarray(f(np.float32(3.0)))), 6.0, rtol=1e-6)
    np.testing.assert_allclose(float(f(pydiff.tensor(3.0)).numpy()), 6.0, rtol=1e-6)


def test_fwds_broadcast_closed_form(poly):
    a = pydiff.tensor([[1.0], [2.0]])  # (2, 1) against x (1, 3)
    xs = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    x = pydiff.tensor(xs).with_tangent(np.ones((1, 3), np.float32))
    y, dy = poly.polynomial.fwds(a, 8.0, -1.0, x)
    av = np.array([[1.0], [2.0]])
    np.testing.assert_allclose(y.numpy(), av * xs**2 + 8 * xs - 1, rtol=1e-6)
    np.testing.assert_allclose(dy.numpy(), 2 * av * xs + 8, rtol=1e-6)


def test_empty_and_wrong_dtype_inputs_are_clear_errors(poly):
    with pytest.raises(ValueError, match="zero-size"):
        pydiff.tensor(np.zeros(0, np.float32))
    with pytest.raises(TypeError, match="float64"):
        t = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
        pydiff.torch_function(lambda a: ops.sum(ops.mul(a, a)))(t)
    with pytest.raises(TypeError, match="bool"):
        pydiff.from_torch(torch.tensor([True, False]))


def test_jvp_of_grad_is_refused_loudly():
    g = pydiff.grad(lambda x: ops.sum(ops.mul(ops.mul(x, x), x)))
    x = np.array([1.0, 2.0], np.float32)
    with pytest.raises(NotImplementedError, match="hvp"):
        pydiff.jvp(g, (x,), (np.ones(2, np.float32),))


def test_two_threads_differentiate_at_once():
    res = {}

    def work(i):
        try:
            x = np.arange(1, 5, dtype=np.float32) * (i + 1)
            for _ in range(10):
                g = np.asarray(pydiff.grad(lambda x: ops.sum(ops.mul(x, x)))(x))
                np.testing.assert_allclose(g, 2.0 * x.astype(np.float64), rtol=1e-5)
            res[i] = "ok"
        except Exception as e:  # reported below
            res[i] = repr(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert res == {0: "ok", 1: "ok"}


class _Cube(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return ops.mul(ops.mul(x, x), x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return ops.mul(g, ops.mul(ops.mul(x, x), 3.0))

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return ops.mul(t, ops.mul(ops.mul(x, x), 3.0))


class _BadShape(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        return ops.mul(x, x)

    @staticmethod
    def backward(ctx, g):
        return pydiff.tensor([1.0])


def test_custom_function_used_twice_and_nested_closed_form():
    x0 = np.array([0.5, -1.0, 2.0], np.float32)
    xd = x0.astype(np.float64)

    def f(x):
        return ops.add(ops.sum(_Cube.apply(x)), ops.sum(_Cube.apply(_Cube.apply(x))))

    # d/dx (x^3 + x^9) = 3x^2 + 9x^8
    np.testing.assert_allclose(np.asarray(pydiff.grad(f)(x0)), 3 * xd**2 + 9 * xd**8, rtol=1e-5)
    _, t = pydiff.jvp(_Cube.apply, (x0,), (np.ones(3, np.float32),))
    np.testing.assert_allclose(np.asarray(t.numpy()), 3 * xd**2, rtol=1e-6)
    (hv,) = pydiff.hvp(lambda x: ops.sum(_Cube.apply(x)), (x0,), (np.ones(3, np.float32),))
    np.testing.assert_allclose(np.asarray(hv), 6 * xd, rtol=1e-6)
    assert pydiff.gradcheck(_Cube, (pydiff.tensor(x0, requires_grad=True),))


def test_custom_backward_of_wrong_shape_names_the_shapes():
    x0 = np.array([0.5, -1.0, 2.0], np.float32)
    with pytest.raises(RuntimeError, match=r"shape \(1,\).*shape \(3,\)"):
        pydiff.grad(lambda x: ops.sum(_BadShape.apply(x)))(x0)


def test_fwds_at_infinite_primal_matches_torch(poly):
    x = pydiff.tensor([np.inf, 1.0]).with_tangent([1.0, 1.0])
    _, dy = poly.polynomial.fwds(2.0, 8.0, -1.0, x)
    xt = torch.tensor([np.inf, 1.0], dtype=torch.float64, requires_grad=True)
    (2 * xt * xt + 8 * xt - 1).sum().backward()
    np.testing.assert_allclose(dy.numpy(), xt.grad.numpy(), rtol=1e-6)


def test_fixed_point_grad_and_jvp_closed_form():
    av = np.array([0.1, 0.5, -0.3], np.float32)
    bv = np.array([1.0, 2.0, -1.0], np.float32)
    ad, bd = av.astype(np.float64), bv.astype(np.float64)
    a = pydiff.tensor(av, requires_grad=True)
    b = pydiff.tensor(bv, requires_grad=True)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, a, b: a * x + b, np.zeros(3), a, b)
        loss = ops.sum(ops.mul(x, x))
    tape.backward(loss)
    xs = bd / (1 - ad)  # x* = b / (1 - a); L = sum(x*^2)
    np.testing.assert_allclose(a.grad.numpy(), 2 * xs * bd / (1 - ad) ** 2, rtol=1e-4)
    np.testing.assert_allclose(b.grad.numpy(), 2 * xs / (1 - ad), rtol=1e-4)

    def solve(a):
        return pydiff.fixed_point(lambda x, a: a * x + 1.0, np.zeros(3), a)

    _, t = pydiff.jvp(solve, (av,), (np.ones(3, np.float32),))
    np.testing.assert_allclose(t.numpy(), 1 / (1 - ad) ** 2, rtol=1e-4)


def test_fixed_point_bad_inputs_are_clear_errors():
    a = pydiff.tensor([1.5], requires_grad=True)
    with pytest.raises(pydiff.ConvergenceError, match="max_iter=50"):
        pydiff.fixed_point(lambda x, a: a * x + 1.0, np.zeros(1), a, max_iter=50)
    a3 = pydiff.tensor([0.1, 0.2, 0.3], requires_grad=True)
    with pytest.raises(ValueError, match=r"shape \(\)"):
        pydiff.fixed_point(lambda x, a: ops.sum(a * x), np.zeros(3), a3)


def test_torch_function_stride_zero_and_transposed_grad_outputs():
    g = pydiff.torch_function(lambda a: ops.mul(a, a))
    t = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    g(t).backward(torch.ones(1).expand(3))  # stride-0 grad_output
    np.testing.assert_allclose(t.grad.numpy(), [2.0, 4.0, 6.0], rtol=1e-6)
    m = np.array([[1.0, 2.0], [3.0, 4.0]])
    t2 = torch.tensor(m, dtype=torch.float32, requires_grad=True)
    g(t2).backward(torch.tensor(m, dtype=torch.float32).t())  # non-contiguous grad_output
    np.testing.assert_allclose(t2.grad.numpy(), 2 * m * m.T, rtol=1e-6)


def _sq(x):
    return ops.sum(ops.mul(x, x))


def test_transforms_edge_values_closed_form():
    np.testing.assert_allclose(pydiff.grad(_sq)([1, 2]), [2.0, 4.0], rtol=1e-6)  # ints: numbers
    np.testing.assert_allclose(pydiff.grad(_sq)(np.array([1e30], np.float32)), [2e30], rtol=1e-6)
    np.testing.assert_allclose(pydiff.jacrev(lambda x: ops.mul(x, x))(np.float32(3.0)), 6.0)
    np.testing.assert_allclose(pydiff.jacfwd(lambda x: ops.mul(x, x))(np.float32([3.0])), [[6.0]])
    np.testing.assert_allclose(np.asarray(pydiff.hessian(_sq, (np.float32(3.0),))).ravel(), [2.0])


def test_transforms_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="argument 0 holds booleans"):
        pydiff.grad(_sq)(np.array([True, False]))
    with pytest.raises(ValueError, match="overflow"):
        pydiff.grad(_sq)(np.array([1e300]))
    with pytest.raises(ValueError, match=r"tangents\[0\] has shape \(2,\)"):
        pydiff.jvp(_sq, (np.ones(3, np.float32),), (np.ones(2, np.float32),))
    with pytest.raises(ValueError, match="1 primals but 0 tangents"):
        pydiff.jvp(_sq, (np.ones(3, np.float32),), ())
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        pydiff.grad(lambda x: ops.mul(x, x))(np.ones(3, np.float32))
