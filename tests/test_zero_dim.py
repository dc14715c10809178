"""0-d tensors (issue 17): shape () where NumPy and PyTorch give it (an int per axis, sums and
means over everything, losses, scalars, calls whose tensors are all 0-d), their values,
shapes and gradients against NumPy float64 and PyTorch float64, and the host conversions."""

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(2017)
A = RNG.standard_normal((3, 4))
RTOL = 2e-5  # pydiff computes in float32, the references in float64


def _leaf(data, device):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, requires_grad=True)


def _torch_leaf(data):
    return torch.tensor(np.asarray(np.asarray(data, np.float32), np.float64), requires_grad=True)


def _backward(fn, *leaves):
    """fn(*leaves) on a tape, backward with the default seed (1): the result and gradients."""
    with pydiff.Tape() as tape:
        out = fn(*leaves)
    tape.backward(out)
    return out, [t.grad.numpy() for t in leaves]


# --- making and reading 0-d tensors ----------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda d: pydiff.tensor(3.0, device=d),
        lambda d: pydiff.tensor(np.float32(3), device=d),
        lambda d: pydiff.tensor(np.array(3.0), device=d),
        lambda d: pydiff.full((), 3.0, device=d),
        lambda d: pydiff.zeros((), device=d) + 3.0,
        lambda d: pydiff.ones((), device=d) * 3.0,
    ],
)
def test_making_a_0d_tensor_gives_shape_empty_as_numpy(device, make):
    x = make(device)
    assert x.shape == np.asarray(3.0).shape == ()
    assert x.numel == 1
    assert x.numpy().shape == () and x.numpy() == 3.0
    assert np.asarray(x).shape == () and float(x) == 3.0 and x.item() == 3.0
    assert int(x) == 3 and bool(x)
    assert repr(x).startswith("pydiff.Tensor(3., shape=()")
    with pytest.raises(TypeError, match="0-d"):
        len(x)
    with pytest.raises(TypeError, match="0-d"):
        iter(x)


def test_zeros_empty_and_rand_of_shape_empty(device):
    assert pydiff.zeros((), device=device).numpy() == 0.0
    assert pydiff.empty((), device=device).shape == ()
    assert pydiff.rand((), seed=3, device=device).shape == ()
    assert pydiff.zeros((), dtype="int", device=device).numpy().dtype == np.int32
    with pytest.raises(ValueError, match="give a shape"):
        pydiff.rand(seed=3)


def test_a_0d_vector_tensor_keeps_its_components(device):
    v = pydiff.tensor(np.array([1.0, 2.0, 3.0]), dtype="float3", device=device)
    assert v.shape == () and v.numpy().shape == (3,)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0])


def test_reshape_between_0d_and_one_element(device):
    x = _leaf(2.0, device)
    one = x.reshape(1)
    assert one.shape == (1,) and one.grad.shape == (1,)
    back = one.reshape(())
    assert back.shape == () and back.grad.shape == ()
    assert pydiff.tensor([[5.0]], device=device).reshape(()).numpy() == 5.0
    assert x.reshape(1, 1).shape == (1, 1)
    # a gradient through the views lands in the 0-d leaf
    _, (g,) = _backward(lambda t: (t.reshape(1) * 3.0).reshape(()), x)
    assert g.shape == () and g == 3.0


def test_the_grad_of_a_0d_leaf_is_0d(device):
    x = _leaf(1.5, device)
    assert x.grad.shape == () and x.grad.numpy() == 0.0
    _, (g,) = _backward(lambda t: t * t, x)
    assert g.shape == ()
    np.testing.assert_allclose(g, 3.0, rtol=RTOL)


# --- indexing and reductions give 0-d ---------------------------------------------------------


@pytest.mark.parametrize("key", [(1, 2), (-1, 0), (Ellipsis, 1, -1)])
def test_an_int_per_axis_gives_0d_and_its_gradient_one_element(device, key):
    x = _leaf(A, device)
    y, (g,) = _backward(lambda t: t[key] * 2.0, x)
    assert y.shape == A[key].shape == ()
    np.testing.assert_allclose(y.numpy(), 2.0 * np.float32(A[key]), rtol=RTOL)
    tx = _torch_leaf(A)
    (tx[key] * 2.0).backward()
    np.testing.assert_allclose(g, tx.grad.numpy(), rtol=RTOL)


def test_indexing_a_1d_tensor(device):
    x = pydiff.tensor([1.0, 2.0, 3.0], device=device)
    assert x[1].shape == () and x[1].numpy() == 2.0 and x[-1].item() == 3.0
    assert [float(v) for v in x] == [1.0, 2.0, 3.0]  # iteration gives 0-d elements
    with pytest.raises(IndexError):
        x[1][0]


@pytest.mark.parametrize("name", ["sum", "mean"])
def test_sum_and_mean_over_everything_are_0d(device, name):
    x = _leaf(A, device)
    ref = _torch_leaf(A)
    want = getattr(ref, name)()
    want.backward()
    for reduce in (
        lambda t: getattr(t, name)(),
        lambda t: getattr(ops, name)(t),
        lambda t: getattr(ops, name)(t, axis=(0, 1)),
    ):
        x.zero_grad()
        y, (g,) = _backward(reduce, x)
        assert y.shape == want.shape == getattr(np, name)(A).shape == ()
        np.testing.assert_allclose(y.numpy(), want.item(), rtol=RTOL)
        np.testing.assert_allclose(g, ref.grad.numpy(), rtol=RTOL)
    assert getattr(x, name)(keepdims=True).shape == (1, 1)
    assert np.sum(x).shape == ()


def test_reductions_of_a_0d_tensor(device):
    x = _leaf(4.0, device)
    assert x.sum().shape == () and x.mean().item() == 4.0
    assert ops.sum(x, axis=0).shape == torch.tensor(4.0).sum(0).shape == ()
    assert x.sum(keepdims=True).shape == np.sum(np.float32(4.0), keepdims=True).shape == ()
    _, (g,) = _backward(lambda t: t.sum() * 3.0, x)
    assert g.shape == () and g == 3.0


def test_mse_loss_is_0d_with_torch_gradients(device):
    p, t = RNG.standard_normal((5, 3)), RNG.standard_normal((5, 3))
    tp = _torch_leaf(p)
    want = torch.nn.functional.mse_loss(tp, torch.tensor(np.float32(t), dtype=torch.float64))
    want.backward()
    loss, (g,) = _backward(
        lambda a: ops.mse_loss(a, pydiff.tensor(t, device=device)), _leaf(p, device)
    )
    assert loss.shape == want.shape == ()
    np.testing.assert_allclose(loss.numpy(), want.item(), rtol=RTOL)
    np.testing.assert_allclose(g, tp.grad.numpy(), rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("labels_as", ["tensor", "list"])
def test_cross_entropy_is_0d_with_torch_gradients(device, labels_as):
    z = RNG.standard_normal((6, 4))
    labels = [0, 3, 1, 2, 2, 0]
    given = pydiff.tensor(np.array(labels, np.int32), device=device)
    tz = _torch_leaf(z)
    want = torch.nn.functional.cross_entropy(tz, torch.tensor(labels))
    want.backward()
    loss, (g,) = _backward(
        lambda a: ops.cross_entropy(a, given if labels_as == "tensor" else labels),
        _leaf(z, device),
    )
    assert loss.shape == want.shape == ()
    np.testing.assert_allclose(loss.numpy(), want.item(), rtol=RTOL)
    np.testing.assert_allclose(g, tz.grad.numpy(), rtol=1e-4, atol=1e-7)


# --- operators with 0-d operands --------------------------------------------------------------

OPERATORS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
}


@pytest.mark.parametrize("op", list(OPERATORS))
@pytest.mark.parametrize("other_shape", [(), (1,), (4,), (3, 4)])
@pytest.mark.parametrize("zero_d_first", [True, False])
def test_operators_between_0d_and_nd_broadcast_as_numpy(device, op, other_shape, zero_d_first):
    s_val = 1.75
    o_val = RNG.uniform(0.5, 2.0, other_shape)
    f = OPERATORS[op]
    s, o = _leaf(s_val, device), _leaf(o_val, device)
    ts, to = _torch_leaf(s_val), _torch_leaf(o_val)
    args, targs = ((s, o), (ts, to)) if zero_d_first else ((o, s), (to, ts))
    with pydiff.Tape() as tape:
        y = f(*args)
    want = f(*targs)
    assert y.shape == tuple(want.shape) == np.broadcast_shapes((), other_shape)
    np.testing.assert_allclose(y.numpy(), want.detach().numpy(), rtol=RTOL)
    up = RNG.standard_normal(want.shape)
    tape.backward(y, grad=up)
    want.backward(torch.tensor(up))
    # the broadcast 0-d operand's gradient is the sum over the result, shape ()
    assert s.grad.shape == () and o.grad.shape == other_shape
    np.testing.assert_allclose(s.grad.numpy(), ts.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(o.grad.numpy(), to.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_numbers_and_arrays_with_a_0d_tensor(device):
    s = pydiff.tensor(2.0, device=device)
    assert (s + 1.0).shape == () and (1.0 - s).item() == -1.0
    assert (s * np.ones(3)).shape == (3,)
    assert (np.float32(3.0) * s).shape == ()
    assert (-s).shape == () and (s**2).item() == 4.0
    assert s.exp().shape == () and s.tanh().shape == ()
    v = pydiff.tensor([1.0, 2.0], device=device)
    assert (v @ v).shape == (np.array([1.0, 2.0]) @ np.array([1.0, 2.0])).shape == ()


def test_elementwise_methods_of_0d_against_torch(device):
    x = _leaf(0.7, device)
    tx = _torch_leaf(0.7)
    y, (g,) = _backward(lambda t: (t.sin() * t.exp() + t.sqrt()).tanh(), x)
    want = (tx.sin() * tx.exp() + tx.sqrt()).tanh()
    want.backward()
    assert y.shape == ()
    np.testing.assert_allclose(y.numpy(), want.item(), rtol=RTOL)
    np.testing.assert_allclose(g, tx.grad.item(), rtol=1e-4)


UNARY = {
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "silu": torch.nn.functional.silu,
    "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "log": torch.log,
    "sqrt": torch.sqrt,
}


@pytest.mark.parametrize("name", list(UNARY))
@pytest.mark.parametrize("value", [-0.6, 0.8])
def test_unary_ops_of_0d_against_torch(device, name, value):
    if name in ("log", "sqrt") and value < 0:
        value = -value
    x, tx = _leaf(value, device), _torch_leaf(value)
    y, (g,) = _backward(getattr(ops, name), x)
    want = UNARY[name](tx)
    want.backward()
    assert y.shape == tuple(want.shape) == ()
    np.testing.assert_allclose(y.numpy(), want.item(), rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(g, tx.grad.item(), rtol=1e-4, atol=1e-7)


def test_host_functions_of_0d(device):
    x = _leaf(-0.5, device)
    for y in (x.T, x.transpose(), x[()], x[...], x.clone(), x.astype("half"), x**3):
        assert y.shape == ()
    _, (g,) = _backward(lambda t: t.astype("half").astype("float") * t[...] + t.T, x)
    np.testing.assert_allclose(g, 2 * -0.5 + 1.0, rtol=1e-3)
    assert (pydiff.tensor(3, device=device) * 0.5).shape == ()  # an int 0-d operand
    with pytest.raises(ValueError, match="at least 1 dimension"):
        ops.softmax(x)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_optimizers_step_a_0d_parameter(device, name):
    p = _leaf(1.0, device)
    opt = getattr(pydiff.optim, name)([p], lr=0.1)
    with pydiff.Tape() as tape:
        loss = p * p
    tape.backward(loss)
    opt.step()
    # gradient 2: SGD moves by lr * 2; Adam's first step by lr (its update is g/|g|);
    # AdamW also decays p by lr * weight_decay (0.01 by default, as torch)
    tp = _torch_leaf(1.0)
    topt = getattr(torch.optim, name)([tp], lr=0.1)
    (tp * tp).backward()
    topt.step()
    assert p.shape == ()
    np.testing.assert_allclose(p.numpy(), tp.item(), rtol=1e-6)


# --- shader calls given 0-d tensors -----------------------------------------------------------


def _polynomial(device):
    return pydiff.load_module("samples/polynomial.slang", device=device)


def test_a_shader_call_given_a_0d_tensor_returns_a_0d_tensor(device):
    m = _polynomial(device)
    x = _leaf(1.5, device)
    for result in ("tensor", None):
        kw = {} if result is None else {"_result": result}
        y = m.polynomial(2.0, 8.0, -1.0, x, **kw)
        assert isinstance(y, pydiff.Tensor) and y.shape == ()
        np.testing.assert_allclose(y.numpy(), 2 * 1.5**2 + 8 * 1.5 - 1, rtol=RTOL)
    y2 = m.polynomial(2.0, 8.0, -1.0, x, _result="tensor")  # again: the call plan's path
    assert y2.shape == ()
    out = m.polynomial(2.0, 8.0, -1.0, x, _result="numpy")
    assert out.shape == () and out == pytest.approx(2 * 1.5**2 + 8 * 1.5 - 1)
    # tensors of other shapes keep theirs
    assert m.polynomial(2.0, 8.0, -1.0, pydiff.tensor([1.5], device=device)).shape == (1,)
    assert m.polynomial(x, 8.0, -1.0, pydiff.tensor([1.0, 2.0], device=device)).shape == (2,)


def test_a_shader_call_of_0d_tensors_on_a_tape_against_torch(device):
    m = _polynomial(device)
    a, x = _leaf(2.0, device), _leaf(1.5, device)
    ta, tx = _torch_leaf(2.0), _torch_leaf(1.5)
    y, (ga, gx) = _backward(lambda a_, x_: m.polynomial(a_, 8.0, -1.0, x_), a, x)
    (ta * tx * tx + 8.0 * tx - 1.0).backward()
    assert y.shape == () and ga.shape == () and gx.shape == ()
    np.testing.assert_allclose(ga, ta.grad.item(), rtol=RTOL)
    np.testing.assert_allclose(gx, tx.grad.item(), rtol=RTOL)


def test_a_0d_tensor_broadcast_into_a_shader_call_gets_the_summed_gradient(device):
    m = _polynomial(device)
    a = _leaf(2.0, device)
    xs = RNG.standard_normal(7)
    x = pydiff.tensor(xs, device=device)
    y, (ga,) = _backward(lambda a_: m.polynomial(a_, 8.0, -1.0, x).sum(), a)
    assert y.shape == () and ga.shape == ()
    np.testing.assert_allclose(ga, np.sum(np.float32(xs).astype(np.float64) ** 2), rtol=1e-5)


def test_bwds_with_a_0d_result(device):
    m = _polynomial(device)
    x = _leaf(1.5, device)
    y = m.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
    m.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y.with_grads(ones=True))
    assert x.grad.shape == ()
    np.testing.assert_allclose(x.grad.numpy(), 2 * 2.0 * 1.5 + 8.0, rtol=RTOL)


# --- tape, grad and value_and_grad ------------------------------------------------------------


def test_tape_backward_of_a_0d_loss_defaults_to_one_and_takes_one_value(device):
    w = _leaf(A, device)
    for seed in (None, 1.0, [1.0], np.ones(()), np.ones((1,))):
        w.zero_grad()
        with pydiff.Tape() as tape:
            loss = (w * w).sum()
        tape.backward(loss, grad=seed)
        np.testing.assert_allclose(w.grad.numpy(), 2 * np.float32(A), rtol=RTOL)
    with pytest.raises(ValueError, match="grad has shape"):
        with pydiff.Tape() as tape:
            loss = (w * w).sum()
        tape.backward(loss, grad=np.ones(2))


def test_loss_backward_method_of_a_0d_loss(device):
    w = _leaf(A, device)
    with pydiff.Tape():
        loss = (w * 3.0).mean()
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), np.full(A.shape, 3.0 / A.size), rtol=RTOL)


@pytest.mark.parametrize("reshape", [(), (1,)])
def test_grad_and_value_and_grad_take_0d_and_one_element_results(device, reshape):
    def f(w):
        return ((w * w).sum() * 0.5).reshape(reshape)

    w = pydiff.tensor(A, device=device)
    value, g = pydiff.value_and_grad(f)(w)
    assert value.shape == reshape
    np.testing.assert_allclose(
        value.numpy().reshape(()), 0.5 * np.sum(np.float32(A) ** 2.0), rtol=RTOL
    )
    np.testing.assert_allclose(g.numpy(), np.float32(A), rtol=RTOL)
    np.testing.assert_allclose(pydiff.grad(f)(w).numpy(), np.float32(A), rtol=RTOL)


def test_grad_of_a_number_and_a_0d_array(device):
    f = pydiff.grad(lambda s: s * s * s)
    assert f(2.0) == pytest.approx(12.0)
    g = f(np.array(2.0))
    assert isinstance(g, np.ndarray) and g.shape == () and g == pytest.approx(12.0)
    t = f(pydiff.tensor(2.0, device=device))
    assert t.shape == () and t.item() == pytest.approx(12.0)


# --- torch interop ----------------------------------------------------------------------------


def test_from_torch_and_to_torch_keep_0d(device):
    x = pydiff.from_torch(torch.tensor(3.0), device=device)
    assert x.shape == tuple(torch.tensor(3.0).shape) == () and x.item() == 3.0
    back = pydiff.to_torch(x)
    assert back.shape == () and back.item() == 3.0 and back.dtype == torch.float32
    s = pydiff.to_torch(pydiff.tensor(A, device=device).sum())
    assert s.shape == () and s.item() == pytest.approx(np.float32(A).sum(), rel=RTOL)
    g = pydiff.from_torch(torch.tensor(2.0, requires_grad=True), device=device)
    assert g.requires_grad and g.grad.shape == ()
    i = pydiff.from_torch(torch.tensor(5, dtype=torch.int64), dtype="int", device=device)
    assert i.shape == () and i.dtype == "int" and int(i) == 5


def test_torch_function_with_a_0d_result(device):
    m = _polynomial(device)
    f = pydiff.torch_function(lambda x: m.polynomial(2.0, 8.0, -1.0, x).sum())
    tx = torch.tensor([0.5, 1.5, -2.0], requires_grad=True)
    y = f(tx)
    assert y.shape == ()
    y.backward()
    np.testing.assert_allclose(tx.grad.numpy(), 4.0 * tx.detach().numpy() + 8.0, rtol=RTOL)


# --- forward mode and fixed points ------------------------------------------------------------


def test_fwds_and_jvp_of_0d_tensors(device):
    m = _polynomial(device)
    x = pydiff.tensor(1.5, device=device).with_tangent(1.0)
    y, dy = m.polynomial.fwds(2.0, 8.0, -1.0, x)
    assert y.shape == () and dy.shape == ()
    np.testing.assert_allclose([y.item(), dy.item()], [15.5, 2 * 2.0 * 1.5 + 8.0], rtol=RTOL)
    y, dy = pydiff.jvp(
        m.polynomial, (2.0, 8.0, -1.0, pydiff.tensor(1.5, device=device)), (None, None, None, 1.0)
    )
    assert y.shape == () and dy.shape == () and dy.item() == pytest.approx(14.0)


def test_fixed_point_of_a_number_is_0d_with_the_implicit_gradient(device):
    b = _leaf(1.0, device)
    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(lambda x, b: ops.mul(ops.cos(x), b), 0.5, b, tol=1e-6)
    assert x.shape == ()
    tape.backward(x)
    xs = np.float64(x.item())  # x = b cos x: dx/db = cos x / (1 + b sin x), closed form
    np.testing.assert_allclose(xs, np.cos(xs), rtol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), np.cos(xs) / (1 + np.sin(xs)), rtol=1e-4)


def test_torch_function_with_a_0d_torch_input_broadcast(device):
    m = _polynomial(device)
    f = pydiff.torch_function(lambda a, x: m.polynomial(a, 8.0, -1.0, x))
    ta = torch.tensor(2.0, requires_grad=True)
    tx = torch.tensor([0.5, 1.5, -2.0])
    y = f(ta, tx)
    assert y.shape == (3,)
    y.sum().backward()
    assert ta.grad.shape == ()  # the broadcast 0-d input's gradient: the sum of x**2
    np.testing.assert_allclose(ta.grad.item(), 0.25 + 2.25 + 4.0, rtol=RTOL)


def test_hvp_of_a_0d_tensor_against_the_closed_form(device):
    m = _polynomial(device)
    x = pydiff.tensor(1.5, device=device)
    # f = a x^2 + b x + c: the Hessian times e_x is (2x, 1, 0, 2a)
    hv = pydiff.hvp(m.polynomial, (2.0, 8.0, -1.0, x), (0.0, 0.0, 0.0, 1.0))
    got = [float(np.asarray(v if not isinstance(v, pydiff.Tensor) else v.numpy())) for v in hv]
    np.testing.assert_allclose(got, [3.0, 1.0, 0.0, 4.0], rtol=RTOL)
    assert isinstance(hv[3], pydiff.Tensor) and hv[3].shape == ()


def test_bwds_seeds_policies_and_determinism_with_0d_tensors(device):
    m = _polynomial(device)
    x = _leaf(1.5, device)
    m.polynomial.bwds(2.0, 8.0, -1.0, x, _result=1.0)  # a number as the seed
    assert x.grad.shape == () and x.grad.item() == pytest.approx(2 * 2.0 * 1.5 + 8.0)
    xs = pydiff.tensor([0.5, 1.5, -2.0], device=device)
    want = 0.25 + 2.25 + 4.0  # d/da of sum(a x^2 + 8x - 1)
    a = _leaf(2.0, device)
    with pydiff.deterministic():
        m.polynomial.bwds(a, 8.0, -1.0, xs, _result=1.0)
    assert a.grad.shape == () and a.grad.item() == pytest.approx(want, rel=RTOL)
    for policy in ("reset", "strict"):
        pydiff.set_zero_policy(policy)
        a = _leaf(2.0, device)
        _, (g,) = _backward(lambda a_: m.polynomial(a_, 8.0, -1.0, xs).sum(), a)
        assert g.shape == () and g == pytest.approx(want, rel=RTOL)


def test_an_inout_0d_tensor_on_a_tape(device):
    mm = pydiff.load_module_from_source(
        "zero_dim_inout",
        "[Differentiable] void scale(inout float v, float k) { v = v * k; }",
        device=device,
    )
    w, k = _leaf(3.0, device), _leaf(2.0, device)
    with pydiff.Tape() as tape:
        mm.scale(w, k)
        loss = w * 1.0
    assert w.shape == () and w.item() == 6.0
    tape.backward(loss)
    # loss = w0 k: d/dw0 = k, d/dk = w0 (the value before the call)
    assert w.grad.shape == () and k.grad.shape == ()
    np.testing.assert_allclose([w.grad.item(), k.grad.item()], [2.0, 3.0], rtol=RTOL)


def test_whole_element_call_shape_is_0d_off_a_tape_too(device):
    """energy(float3 p) of one (3,) tensor: call shape (), so a 0-d tensor each time (the
    second call runs through the remembered plan), and 0-d with _result='numpy'."""
    fw = pydiff.load_module("tests/shaders/forward.slang", device=device)
    p = pydiff.tensor([1.0, 2.0, 3.0], device=device)
    want = 1.0 * 2.0 * 3.0 + np.sin(1.0)
    for _ in range(3):
        e = fw.energy(p)
        assert isinstance(e, pydiff.Tensor) and e.shape == ()
        np.testing.assert_allclose(float(e), want, rtol=RTOL)
    r = fw.energy(p, _result="numpy")
    assert isinstance(r, np.ndarray) and r.shape == ()
    np.testing.assert_allclose(r, want, rtol=RTOL)
    rows = fw.energy(pydiff.tensor([[1.0, 2.0, 3.0]], device=device))  # a call axis: (1,)
    assert rows.shape == (1,)


def test_tensor_equality_is_refused_and_hashing_stays_by_identity(device):
    s, t = pydiff.tensor(4.0, device=device), pydiff.tensor(4.0, device=device)
    for op in (lambda: s == 4.0, lambda: s != 4.0, lambda: s == t, lambda: 4.0 == s):
        with pytest.raises(TypeError, match=r"x\.numpy\(\) (==|!=) v"):
            op()
    assert {s: 1, t: 2}[s] == 1 and len({s, t}) == 2 and s in [s] and float(s) == 4.0


def test_fwds_and_bwds_refuse_written_and_result_torch_tensors(device):
    fw = pydiff.load_module("tests/shaders/forward.slang", device=device)
    m = pydiff.load_module("samples/polynomial.slang", device=device)
    with pytest.raises(TypeError, match="parameter 'y' is a torch tensor, which the call writes"):
        fw.cube_out.bwds(pydiff.tensor([1.0], device=device), torch.tensor([1.0]))
    x = pydiff.tensor([1.0], device=device, requires_grad=True)
    with pytest.raises(TypeError, match="_result is a torch tensor"):
        m.polynomial.bwds(2.0, 0.0, 0.0, x, _result=torch.tensor([1.0]))
    # a (value, tangent) pair of torch tensors: 2 x^2 and its derivative 4 x along 1
    y, dy = m.polynomial.fwds(2.0, 0.0, 0.0, (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])))
    np.testing.assert_allclose(np.asarray(y), [2.0, 8.0], rtol=RTOL)
    np.testing.assert_allclose(np.asarray(dy), [4.0, 8.0], rtol=RTOL)
