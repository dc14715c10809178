"""PyTorch interop (issue 17): from_torch/to_torch, torch_function, shader functions and ops
called with torch tensors, against torch's own autograd in float64 and closed forms. Skipped
without torch (an optional extra)."""

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(17)


@pytest.fixture
def poly(device):
    return pydiff.load_module("samples/polynomial.slang", device=device)


@pytest.mark.parametrize(
    "dtype, pydiff_dtype",
    [(torch.float32, "float"), (torch.float16, "half"), (torch.int32, "int")],
)
def test_round_trips_keep_values_shape_and_dtype(device, dtype, pydiff_dtype):
    t = (torch.arange(24).reshape(2, 3, 4) * 3 - 7).to(dtype)
    x = pydiff.from_torch(t, device=device)
    assert x.shape == (2, 3, 4) and x.dtype == pydiff_dtype
    back = pydiff.to_torch(x)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.cpu(), t)  # a view on the device on CUDA, a CPU copy elsewhere


def test_non_contiguous_and_transposed_tensors_are_copied_right(device):
    base = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    for view in (base.T, base[:, ::2], base.flip(0), base[1:4, 2:5]):
        x = pydiff.from_torch(view, device=device)
        np.testing.assert_array_equal(x.numpy(), view.numpy())


def test_narrowing_only_when_asked(device):
    with pytest.raises(TypeError, match=r"torch\.float64.*dtype=\"float\""):
        pydiff.from_torch(torch.zeros(3, dtype=torch.float64), device=device)
    x = pydiff.from_torch(
        torch.tensor([0.1, 1e-3], dtype=torch.float64), dtype="float", device=device
    )
    np.testing.assert_array_equal(x.numpy(), np.float32([0.1, 1e-3]))
    with pytest.raises(TypeError, match=r"torch\.int64.*dtype=\"int\""):
        pydiff.from_torch(torch.tensor([1, 2]), device=device)
    labels = pydiff.from_torch(torch.tensor([3, -1]), dtype="int", device=device)
    np.testing.assert_array_equal(labels.numpy(), [3, -1])
    with pytest.raises(ValueError, match="do not fit dtype 'int'"):
        pydiff.from_torch(torch.tensor([2**40]), dtype="int", device=device)


@pytest.mark.parametrize(
    "dtype", [torch.complex64, torch.bfloat16, torch.bool, torch.int8, torch.uint8]
)
def test_unsupported_dtypes_are_refused_by_name(device, dtype):
    with pytest.raises(TypeError, match=rf"torch\.{str(dtype).split('.')[1]}"):
        pydiff.from_torch(torch.zeros(2, dtype=dtype), device=device)


def test_bad_arguments_name_the_parameter():
    with pytest.raises(TypeError, match="from_torch: t must be a torch.Tensor, not ndarray"):
        pydiff.from_torch(np.zeros(2))
    with pytest.raises(TypeError, match="to_torch: x must be a pydiff.Tensor, not Tensor"):
        pydiff.to_torch(torch.zeros(2))
    with pytest.raises(ValueError, match="requires_grad=True needs a floating dtype"):
        pydiff.from_torch(torch.zeros(2, dtype=torch.int32), requires_grad=True)
    with pytest.raises(TypeError, match="must be callable"):
        pydiff.torch_function(3)


def test_requires_grad_follows_the_torch_tensor(device):
    t = torch.ones(3, requires_grad=True)
    assert pydiff.from_torch(t, device=device).requires_grad
    assert not pydiff.from_torch(t, device=device, requires_grad=False).requires_grad
    assert not pydiff.from_torch(torch.ones(3), device=device).requires_grad


def test_torch_function_of_a_shader_function_gives_torch_the_gradient(device, poly):
    X = RNG.standard_normal(16)
    x = torch.tensor(X, dtype=torch.float32, requires_grad=True)
    f = pydiff.torch_function(poly.polynomial)
    y = f(2.0, 8.0, -1.0, x)
    assert isinstance(y, torch.Tensor) and y.requires_grad
    np.testing.assert_allclose(y.detach().numpy(), 2 * X**2 + 8 * X - 1, rtol=1e-5, atol=1e-5)
    w = torch.tensor(RNG.standard_normal(16), dtype=torch.float32)
    (y * w).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), (4 * X + 8) * w.numpy(), rtol=1e-5, atol=1e-5)


def test_shader_function_called_with_torch_tensors_directly(device, poly):
    X = RNG.standard_normal(8)
    x = torch.tensor(X, dtype=torch.float32, requires_grad=True)
    y = poly.polynomial(2.0, 8.0, -1.0, x)
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * X + 8, rtol=1e-5, atol=1e-5)


def test_ops_with_torch_tensors_match_torch_autograd_in_float64(device):
    """A small model: linear -> relu -> linear -> cross_entropy (int64 labels), its loss and
    gradients against torch's own float64 computation."""
    pydiff.set_default_device(device)
    X = torch.tensor(RNG.standard_normal((6, 8)), dtype=torch.float32)
    labels = torch.tensor([0, 2, 1, 1, 0, 2])
    W1, b1, W2, b2 = (
        torch.tensor(RNG.standard_normal(s) * 0.5, dtype=torch.float32, requires_grad=True)
        for s in ((4, 8), (4,), (3, 4), (3,))
    )
    loss = ops.cross_entropy(ops.linear(ops.relu(ops.linear(X, W1, b1)), W2, b2), labels)
    loss.sum().backward()

    ref = [p.detach().double().requires_grad_() for p in (W1, b1, W2, b2)]
    h = torch.relu(X.double() @ ref[0].T + ref[1])
    expected = torch.nn.functional.cross_entropy(h @ ref[2].T + ref[3], labels)
    expected.backward()
    np.testing.assert_allclose(loss.detach().numpy().reshape(()), expected.item(), rtol=1e-5)
    for p, r in zip((W1, b1, W2, b2), ref):
        np.testing.assert_allclose(p.grad.numpy(), r.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_torch_function_of_python_composition_with_two_outputs(device):
    pydiff.set_default_device(device)

    def both(a, b):
        return ops.mul(a, b), ops.sum(ops.exp(a))

    A, B = RNG.standard_normal(5), RNG.standard_normal(5)
    a = torch.tensor(A, dtype=torch.float32, requires_grad=True)
    b = torch.tensor(B, dtype=torch.float32, requires_grad=True)
    prod, total = pydiff.torch_function(both)(a, b)
    g = torch.tensor(RNG.standard_normal(5), dtype=torch.float32)
    ((prod * g).sum() + 3 * total.sum()).backward()
    np.testing.assert_allclose(a.grad.numpy(), B * g.numpy() + 3 * np.exp(A), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), A * g.numpy(), rtol=1e-5, atol=1e-5)


def test_only_the_output_used_gets_a_backward(device):
    pydiff.set_default_device(device)
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    prod, total = pydiff.torch_function(lambda x: (ops.mul(x, x), ops.sum(x)))(a)
    prod.sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), [2.0, 4.0])


def test_torch_function_refusals(device, poly):
    pydiff.set_default_device(device)
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="keyword argument 'x' requires grad.*positionally"):
        pydiff.torch_function(poly.polynomial)(a=1.0, b=1.0, c=1.0, x=x)
    with pytest.raises(TypeError, match="returned float"):
        pydiff.torch_function(lambda t: 1.0)(x)
    with pytest.raises(TypeError, match=r"argument 0 is a torch\.float64 tensor.*t\.float\(\)"):
        pydiff.torch_function(ops.exp)(torch.ones(2, dtype=torch.float64))


def test_pydiff_layer_inside_a_torch_module_trains(device):
    """The sample's pattern: a torch.nn.Module whose forward calls a pydiff op, trained by
    torch.optim; its loss falls and its gradient matches torch's float64 one at the start."""
    pydiff.set_default_device(device)
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4) * 0.3)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.head(ops.tanh(ops.linear(x, self.w)))

    net = Net()
    X = torch.randn(32, 4)
    Y = torch.sin(X.sum(1, keepdim=True))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    losses = []
    for step in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(X), Y)
        loss.backward()
        if step == 0:
            w = net.w.detach().double().requires_grad_()
            out = torch.nn.functional.linear(
                torch.tanh(X.double() @ w.T), net.head.weight.double(), net.head.bias.double()
            )
            torch.nn.functional.mse_loss(out, Y.double()).backward()
            np.testing.assert_allclose(net.w.grad.numpy(), w.grad.numpy(), rtol=1e-4, atol=1e-6)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


# --- torch tensors on a pydiff tape (breaker 17 round 2): data works, grads refused ---


def test_torch_constant_on_a_user_tape_is_data_and_the_gradient_is_exact(device):
    x = pydiff.tensor([1.0, -2.0, 0.5], device=device, requires_grad=True)
    w = torch.tensor([3.0, 4.0, -1.0])  # no gradient: data
    with pydiff.Tape() as tape:
        y = ops.sum(ops.mul(ops.mul(x, x), w))  # sum(w x^2)
    assert isinstance(y, pydiff.Tensor)
    tape.backward(y)
    # closed form: d/dx sum(w x^2) = 2 w x
    np.testing.assert_allclose(x.grad.numpy(), 2 * w.numpy() * x.numpy(), rtol=1e-6)
    assert np.isclose(y.item(), float((w.double() * torch.tensor([1.0, 4.0, 0.25]).double()).sum()))


def _on_user_tape(call):
    with pydiff.Tape():
        call()


def test_torch_tensor_that_requires_grad_on_a_pydiff_tape_is_refused_with_the_way_out(device, poly):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    t = torch.ones(2, requires_grad=True)
    for run, name in (
        (lambda: pydiff.grad(lambda a: ops.sum(ops.mul(a, t)))(x), "mul"),
        (lambda: _on_user_tape(lambda: poly.polynomial(1.0, 2.0, 3.0, t)), "polynomial"),
    ):
        with pytest.raises(TypeError) as e:
            run()
        msg = str(e.value)
        assert name in msg and "torch" in msg and "pydiff.from_torch" in msg, msg
        assert "torch_function" in msg and "nest" not in msg, msg
        with pydiff.Tape():  # no tape was left open (else "tapes do not nest")
            pass


def test_torch_function_of_a_closure_with_a_torch_constant(device):
    w = torch.tensor([2.0, -3.0])
    f = pydiff.torch_function(lambda a: ops.mul(a, w))  # w reaches ops.mul on the bridge's tape
    a = torch.tensor([1.0, 5.0], dtype=torch.float64).float().requires_grad_(True)
    f(a).sum().backward()
    torch.testing.assert_close(a.grad, w)  # d/da sum(a w) = w


def test_function_apply_with_a_torch_tensor_names_torch_function(device):
    class Twice(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return ops.mul(x, 2.0)

        @staticmethod
        def backward(ctx, g):
            return ops.mul(g, 2.0)

    with pytest.raises(
        TypeError, match=r"Twice\.apply: argument 0 is a torch tensor.*torch_function"
    ):
        Twice.apply(torch.ones(2))
    t = torch.tensor([1.0, 3.0], requires_grad=True)
    pydiff.torch_function(Twice.apply)(t).sum().backward()  # the way out works
    torch.testing.assert_close(t.grad, torch.tensor([2.0, 2.0]))


@pytest.mark.parametrize("op", ["+", "-", "*", "/", "@", "**", "r+"])
def test_operators_with_a_torch_tensor_name_torch(device, op):
    x = pydiff.tensor([1.0, 2.0], device=device)
    t = torch.ones(2)
    run = {
        "+": lambda: x + t,
        "-": lambda: x - t,
        "*": lambda: x * t,
        "/": lambda: x / t,
        "@": lambda: x @ t,
        "**": lambda: x**t,
        "r+": lambda: x.__radd__(t),
    }[op]
    with pytest.raises(TypeError, match=r"pydiff\.Tensor and torch\.Tensor.*from_torch"):
        run()


def test_half_torch_tensor_in_an_op_says_float_and_the_cast_works(device):
    h = torch.tensor([1.0, 2.0], dtype=torch.float16, requires_grad=True)
    with pytest.raises(
        pydiff.OpDtypeError, match=r"mul: a is a torch\.float16 tensor.*a\.float\(\)"
    ):
        ops.mul(h, h)
    ops.mul(h.float(), h.float()).sum().backward()  # the advice: autograd reaches h
    torch.testing.assert_close(h.grad, torch.tensor([2.0, 4.0], dtype=torch.float16))


def test_from_torch_refuses_sparse_meta_and_a_non_bool_requires_grad(device):
    with pytest.raises(TypeError, match=r"from_torch: .*sparse.*to_dense"):
        pydiff.from_torch(torch.eye(2).to_sparse(), device=device)
    with pytest.raises(ValueError, match=r"from_torch: .*'meta'"):
        pydiff.from_torch(torch.ones(2, device="meta"), device=device)
    with pytest.raises(TypeError, match=r"from_torch: requires_grad must be a bool"):
        pydiff.from_torch(torch.ones(2), device=device, requires_grad=1)
    assert pydiff.from_torch(torch.ones(2), device=device, requires_grad=np.True_).requires_grad


def test_torch_tensors_that_require_grad_in_copied_values_are_refused_clearly(device):
    """A torch tensor that requires grad, alone or in a list, where pydiff copies values: no
    gradient could reach it, and torch's own error ("Can't call numpy() on Tensor that
    requires grad") named neither the place nor the reason. Without grad the values pass."""
    m = pydiff.load_module_from_source(
        "torch_lists",
        "[Differentiable] float sq(float x) { return x * x; }\n"
        "float sum3(float[3] a) { return a[0] + a[1] + a[2]; }\n",
        device=device,
    )
    leaf = torch.tensor(2.0, requires_grad=True)
    cases = [
        (
            lambda: pydiff.tensor([torch.tensor(1.0), leaf], device=device),
            "pydiff.tensor: data: a list",
        ),
        (lambda: pydiff.tensor([[1.0], [leaf]], device=device), "pydiff.tensor: data: a list"),
        (lambda: pydiff.tensor(torch.ones(2, requires_grad=True), device=device), "a torch tensor"),
        (lambda: m.sq([torch.tensor(1.0), leaf]), "parameter 'x'"),
        (lambda: m.sum3([torch.tensor(1.0), leaf, torch.tensor(3.0)]), "parameter 'a'"),
    ]
    for make, where in cases:
        with pytest.raises(TypeError, match="requires grad; its values are copied") as info:
            make()
        assert where in str(info.value)
    assert leaf.grad is None
    plain = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]
    np.testing.assert_array_equal(pydiff.tensor(plain, device=device).numpy(), [1.0, 2.0, 3.0])
    assert m.sum3(plain) == 6.0


def test_pydiff_parameter_beside_torch_data_gets_its_gradient(device):
    # torch records a call only for inputs of its own: with a data batch that needs no
    # gradient the pydiff parameter's gradient was lost, and pydiff.optim never moved it
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 2))
    x = torch.tensor(rng.standard_normal((4, 2)), dtype=torch.float32)  # requires no grad
    head = torch.tensor(rng.standard_normal((3, 1)), dtype=torch.float32)
    W = pydiff.tensor(w.astype(np.float32), device=device, requires_grad=True)
    h = pydiff.ops.linear(x, W)
    assert h.grad_fn is not None
    (h @ head).sum().backward()
    g = np.ones((4, 1)) @ head.numpy().astype(np.float64).T  # dL/dh
    np.testing.assert_allclose(W.grad.numpy(), g.T @ x.numpy().astype(np.float64), rtol=1e-5)
    with torch.no_grad():  # inference: no graph, and nothing written
        W.zero_grad()
        assert pydiff.ops.linear(x, W).grad_fn is None
