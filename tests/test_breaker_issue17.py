# ruff: noqa: E402, E501, E731, E741  (the breaker's cases, kept as written)
"""Issue 17's breaker (a new user with the issue and the docs only): each case failed before
its fix; expected values from torch float64 autograd, NumPy and closed forms. Public API."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import pydiff
from pydiff import ops

SRC = """
[Differentiable] float poly(float a, float b, float c, float x) { return a * x * x + b * x + c; }
"""


@pytest.fixture(scope="module")
def m():
    return pydiff.load_module_from_source("b17poly", SRC)


# --- 1. wrong-number: a second torch backward through pydiff hands torch accumulated grads ---


def test_torch_backward_twice_retain_graph_gives_same_grad_each_time(m):
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    y = m.poly(1.0, 0.0, 0.0, a)  # y = a^2, dy/da = 2a
    y.sum().backward(retain_graph=True)
    g1 = a.grad.clone()
    y.sum().backward()
    # torch accumulates: after two backwards a.grad must be 2 * (2a) = [4, 8]
    torch.testing.assert_close(g1, torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(a.grad, torch.tensor([4.0, 8.0]))  # got [6, 12]


def test_torch_autograd_grad_twice_is_not_accumulated(m):
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    y = m.poly(1.0, 0.0, 0.0, a)
    (g1,) = torch.autograd.grad(y.sum(), a, retain_graph=True)
    (g2,) = torch.autograd.grad(y.sum(), a)
    torch.testing.assert_close(g1, torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(g2, torch.tensor([2.0, 4.0]))  # got [4, 8]


def test_torch_function_backward_twice(m):
    f = pydiff.torch_function(lambda a: ops.sum(ops.mul(a, a)))
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    y = f(a)
    y.backward(retain_graph=True)
    y.backward()
    torch.testing.assert_close(a.grad, torch.tensor([4.0, 8.0]))  # got [6, 12]


# --- 2. wrong-number: torch_function output that IS an input (or a view of it) gets no gradient ---


def test_torch_function_identity_gets_ones():
    z = torch.ones(2, requires_grad=True)
    y = pydiff.torch_function(lambda a: a)(z)
    y.sum().backward()
    torch.testing.assert_close(z.grad, torch.ones(2))  # got zeros


def test_torch_function_reshape_of_input_gets_ones():
    z = torch.tensor([1.0, 2.0], requires_grad=True)
    y = pydiff.torch_function(lambda a: a.reshape(2, 1))(z)
    y.sum().backward()
    torch.testing.assert_close(z.grad, torch.ones(2))  # got zeros


def test_torch_function_input_returned_beside_other_output():
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0], requires_grad=True)
    out0, out1 = pydiff.torch_function(lambda a, b: (a, ops.mul(a, b)))(a, b)
    (out0.sum() + 2 * out1.sum()).backward()
    torch.testing.assert_close(a.grad, torch.tensor([7.0, 9.0]))  # 1 + 2b; got [6, 8]
    torch.testing.assert_close(b.grad, torch.tensor([2.0, 4.0]))


# --- 3. wrong-number: pydiff.grad of a function returning a view of its argument ---


def test_grad_of_reshape_view_of_argument_is_one():
    g = pydiff.grad(lambda a: a.reshape(1))(np.array([[2.0]]))
    np.testing.assert_array_equal(g, [[1.0]])  # got [[0.]]


# --- 4. wrong-number (silent): double backward is documented unsupported but is silently wrong ---


def test_create_graph_double_backward_refused_not_silently_dropped():
    f = pydiff.torch_function(lambda a: ops.sum(ops.mul(ops.mul(a, a), a)))
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    y = f(a)
    # A gradient penalty through pydiff would silently add nothing: refused loudly instead.
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y, a, create_graph=True)
    (g,) = torch.autograd.grad(f(a), a)  # plain backward still works
    torch.testing.assert_close(g, torch.tensor([3.0, 12.0]))


# --- 5. wrong-number: sqrt's derivative is clamped for x < ~1e-7 ---


def test_sqrt_gradient_small_positive_inputs():
    xs = np.array([1e-8, 1e-10], np.float32)
    g = pydiff.grad(lambda x: ops.sum(ops.sqrt(x)))(xs)
    np.testing.assert_allclose(
        g, 0.5 / np.sqrt(xs.astype(np.float64)), rtol=1e-4
    )  # got 1581.14 for both


def test_pow_half_gradient_matches_torch():
    xs = np.array([1e-9], np.float32)
    g = pydiff.grad(lambda x: (x**0.5).sum())(xs)
    ref = torch.func.grad(lambda t: (t**0.5).sum())(torch.tensor(xs, dtype=torch.float64))
    np.testing.assert_allclose(g, ref.numpy(), rtol=1e-4)  # got 1581 vs 15811


# --- 6. wrong-number: arange past int32 wraps silently ---


def test_arange_beyond_int32_not_silently_wrapped():
    try:
        t = pydiff.arange(2**31 + 5, 2**31 + 7)
    except (ValueError, OverflowError, TypeError):
        return  # a clear refusal is fine
    np.testing.assert_array_equal(
        t.numpy(), [2**31 + 5, 2**31 + 6]
    )  # got [-2147483643, -2147483642]


# --- 7. wrong-number (silent): truthiness / membership / equality ---


def test_bool_of_zero_tensor_is_false():
    assert not bool(pydiff.tensor([0.0]))  # got True


def test_bool_of_multi_element_tensor_raises():
    with pytest.raises(ValueError):  # NumPy and torch: ambiguous
        bool(pydiff.tensor([0.0, 1.0]))


def test_in_operator_finds_value():
    assert 1.0 in pydiff.tensor([1.0, 2.0])  # got False


# --- 8. crash: torch tensor + pydiff tensor that both need a gradient in one op ---


def test_op_mixing_torch_and_pydiff_leaves_backward():
    p = pydiff.tensor([1.0, 2.0], requires_grad=True)
    x = torch.tensor([3.0, 4.0], requires_grad=True)
    try:
        y = ops.mul(x, p)
    except (TypeError, ValueError) as e:  # a clear refusal at call time is fine
        assert "pydiff" in str(e) and "torch" in str(e)
        return
    y.sum().backward()  # got RuntimeError: PydiffFunctionBackward returned a gradient ... position 4
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 2.0]))


# --- 9. unclear-error / wrong behaviour in grad with non-differentiated NumPy arguments ---


def test_grad_nondifferentiated_numpy_argument_is_usable():
    # transforms.md: "numbers and NumPy arrays accepted as arguments", "an argument the result
    # does not depend on gets zeros". Got: TypeError "mul: expected at least one pydiff.Tensor argument".
    f = lambda a, b: ops.sum(ops.mul(a, a))
    g = pydiff.grad(f, argnums=1)(np.array([1.0, 2.0]), np.array([3.0, 4.0]))
    np.testing.assert_array_equal(g, [0.0, 0.0])


def test_grad_argnums_float_error_names_argnums():
    with pytest.raises(
        (TypeError, ValueError), match="argnums"
    ):  # got "'float' object is not iterable"
        pydiff.grad(lambda x: ops.sum(x), argnums=0.0)(np.array([1.0]))


# --- 10. unclear-error: float64 torch tensor into a shader call ---


def test_float64_torch_into_shader_names_parameter_and_fix(m):
    with pytest.raises(TypeError) as ei:
        m.poly(2.0, 8.0, -1.0, torch.tensor([1.0, 2.0], dtype=torch.float64))
    msg = str(ei.value)
    # got: "argument 3: from_torch: ... pass dtype="float" for a narrowing copy" (no dtype= exists here,
    # the parameter 'x' is not named; docs/interop.md says the fix is .float())
    assert "'x'" in msg
    assert ".float()" in msg


# --- 11. unclear-error: sum/mean with a tuple axis, and a @ scalar ---


def test_sum_tuple_axis_error_not_out_of_range():
    x = pydiff.tensor(np.ones((3, 4), np.float32))
    try:
        r = x.sum(axis=(0, 1))
    except (TypeError, ValueError, NotImplementedError) as e:
        assert "out of range" not in str(e), str(e)  # (0, 1) is in range for 2-D
        return
    np.testing.assert_allclose(r.numpy(), [12.0])


def test_matmul_with_scalar_error():
    x = pydiff.tensor(np.ones((3, 4), np.float32))
    with pytest.raises((TypeError, ValueError)) as ei:
        x @ 2.0
    assert "(1, 1)" not in str(ei.value), str(ei.value)  # got "b is (1, 1)": the user gave a scalar


# --- 12. silently lossy conversions ---


def test_from_torch_float64_overflow_not_silent():
    t = torch.tensor([1e300], dtype=torch.float64)
    # int64 values are checked to fit (ValueError); float64 -> float32 overflow gives inf silently
    with pytest.raises(ValueError):
        pydiff.from_torch(t, dtype="float")


def test_astype_float64_not_silently_float32():
    x = pydiff.tensor([0.1, 0.2])
    try:
        y = x.astype(np.float64)
    except (TypeError, ValueError):
        return
    assert y.dtype not in ("float",), "astype(np.float64) silently returned a float32 tensor"


# --- 13. unclear-error: empty / zero-size errors do not name the function ---


def test_from_torch_empty_error_names_from_torch():
    with pytest.raises(ValueError, match="from_torch"):  # got "shape=(0,): every dimension ..."
        pydiff.from_torch(torch.zeros(0))


def test_rand_zero_size_error_names_rand():
    with pytest.raises(ValueError, match="rand"):  # got "shape=(0,): every dimension ..."
        pydiff.rand(0, seed=1)


def test_np_sum_of_tensor_is_the_tensor_sum():
    total = np.sum(pydiff.tensor([1.0, 2.0]))
    assert isinstance(total, pydiff.Tensor) and total.item() == 3.0
    with pytest.raises(TypeError, match="out= are not supported"):
        np.sum(pydiff.tensor([1.0, 2.0]), out=np.zeros(1))


# --- 14. docs: operators on int (and half) tensors ---


def test_int_tensor_operator_from_arange():
    # issue 17: operators "with scalars"; transforms.md: arange(4) gives int. NumPy gives floats here.
    # Got ValueError "mul: argument 0 has dtype int; pydiff.ops work on float tensors" (not said in tensor-api.md)
    r = pydiff.arange(4) * 0.5
    np.testing.assert_allclose(r.numpy(), [0.0, 0.5, 1.0, 1.5])


# --- 15. torch's own gradcheck fails (consequence of finding 1: backward not reentrant) ---


def test_torch_gradcheck_on_pydiff_op_is_reentrant():
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    # float32 gradcheck with loose tolerances: analytical matches numerical, but got
    # GradcheckError "Backward is not reentrant ... running backward with same input and
    # grad_output multiple times gives different values"
    assert torch.autograd.gradcheck(ops.tanh, (x,), eps=1e-3, atol=1e-2, rtol=1e-2)


# --- 16. docs/unclear-error: shader functions with out/inout parameters called with torch tensors ---

OUT_SRC = """
[Differentiable] void sq_out(float x, out float y) { y = x * x; }
"""


def test_shader_out_param_with_torch_tensor():
    # interop.md: "Results are new torch tensors: a torch tensor given to a parameter the function
    # writes (out, inout) is not written back." Got TypeError "torch_function: <pydiff.ShaderFunction
    # ...sq_out...> returned NoneType (output 0); it must return pydiff tensors": no result at all,
    # and the message speaks of torch_function, which the user never called.
    mo = pydiff.load_module_from_source("b17out", OUT_SRC)
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    try:
        r = mo.sq_out(x, torch.zeros(2))
    except (TypeError, ValueError) as e:
        assert "torch_function" not in str(e), str(e)
        return
    assert r is not None


def test_torch_tensors_in_list_argument_error():
    # torch tensors inside a list given to a torch_function: the inner op sees torch tensors and
    # fails with "pydiff.Tape: tapes do not nest" -- nothing about lists or torch tensors.
    g = pydiff.torch_function(lambda lst: ops.add(lst[0], lst[1]))
    try:
        g([torch.ones(2, requires_grad=True), torch.ones(2)])
    except (TypeError, ValueError, RuntimeError) as e:
        assert "do not nest" not in str(e), str(e)


# --- 17. docs: tape.md names Tensor.fill_ which does not exist ---


def test_tape_doc_names_methods_that_exist():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "tape.md").read_text()
    assert "t.fill_" not in text and hasattr(pydiff.tensor([1.0]), "fill")


def test_value_and_grad_numpy_data_argument_in_matmul():
    # the typical use: differentiate w, pass the data x as a NumPy array (transforms.md: "numbers and
    # NumPy arrays accepted as arguments"). Got ValueError "matmul: a must be a 2-D float tensor, got ndarray".
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5, 3)).astype(np.float32)
    W = rng.standard_normal((3, 2)).astype(np.float32)
    value, g = pydiff.value_and_grad(lambda w, x: ops.mean(ops.tanh(ops.matmul(x, w))))(W, X)
    h = np.tanh(X.astype(np.float64) @ W)
    np.testing.assert_allclose(value.item(), h.mean(), rtol=1e-5)
    np.testing.assert_allclose(g, X.T @ ((1 - h**2) / h.size), rtol=1e-4, atol=1e-6)


# --- 18. unclear-error / Python conventions of the tensor type ---


def test_add_string_raises_typeerror():
    # Python operators with an unsupported operand should raise TypeError;
    # got slangpy BoundVariableException "Failed to create type marshall for argument arg1"
    with pytest.raises(TypeError):
        pydiff.tensor([1.0]) + "a"


def test_float_of_one_element_tensor():
    # NumPy and torch allow float() of a one-element array/tensor (float(loss) is common); got TypeError
    assert float(pydiff.tensor([2.5])) == 2.5


# --- 19. documented: tensors the function closes over get gradients, as on any tape ---


def test_grad_adds_into_closed_over_leaves_as_documented():
    w = pydiff.tensor([2.0], requires_grad=True)
    g = pydiff.grad(lambda a: ops.sum(ops.mul(a, w)))(np.array([1.0]))
    np.testing.assert_array_equal(g, [2.0])
    np.testing.assert_array_equal(w.grad.numpy(), [1.0])  # docs/transforms.md says so
