"""Session 42, breaker42: forward mode on a recording tape, `.fwds` results in the ops,
serialisation of tensors and `Function.apply` keywords, each checked against closed forms,
float64 central differences or PyTorch float64."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

SRC = """
[Differentiable] float cube(float a) { return a * a * a; }
[Differentiable] float mul2(float a, float b) { return a * b * b; }
[Differentiable] float3 sq3(float3 v) { return v * v; }
[Differentiable] void cube_out(float a, out float y) { y = a * a * a; }
"""

X = np.array([0.5, 1.0, 2.0], np.float32)
U = np.array([1.0, 2.0, 3.0], np.float32)
X64 = X.astype(np.float64)


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s42_breaker42", SRC, device=device)


def _central(f, x, eps=1e-6):
    """float64 central differences of a scalar function of a vector."""
    g = np.zeros_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = eps
        g[i] = (f(x + e) - f(x - e)) / (2 * eps)
    return g


# --- .fwds results are contiguous tensors the ops take --------------------------------------


@pytest.mark.parametrize("n", [3, 5000])
def test_fwds_results_work_in_every_op_at_any_size(m, device, n):
    # Before: below 4096 elements (SlangPy's path) .fwds returned strided views of one buffer
    # of (value, tangent) pairs, and ops.sum, softmax, matmul, layer_norm and reshape raised
    # "reshape: the tensor is not contiguous" (at 5000, the generated kernels' path, they
    # worked).
    xs = np.linspace(0.1, 1.0, n).astype(np.float32)
    x = pydiff.tensor(xs, device=device).with_tangent(np.ones(n))
    y, dy = m.cube.fwds(x)
    want_y, want_dy = xs.astype(np.float64) ** 3, 3 * xs.astype(np.float64) ** 2
    np.testing.assert_allclose(ops.sum(dy).item(), want_dy.sum(), rtol=1e-5)
    np.testing.assert_allclose(ops.sum(y).item(), want_y.sum(), rtol=1e-5)
    np.testing.assert_allclose(dy.mean().item(), want_dy.mean(), rtol=1e-5)
    np.testing.assert_allclose((dy @ y).item(), want_dy @ want_y, rtol=1e-5)
    np.testing.assert_allclose(dy.reshape(n, 1).numpy()[:, 0], want_dy, rtol=1e-5)
    p = ops.softmax(dy).numpy()
    e = np.exp(want_dy - want_dy.max())
    np.testing.assert_allclose(p, e / e.sum(), rtol=1e-4, atol=1e-7)
    _, t = pydiff.jvp(m.cube, (pydiff.tensor(xs, device=device),), (np.ones(n),))
    np.testing.assert_allclose(ops.sum(t).item(), want_dy.sum(), rtol=1e-5)


def test_fwds_vector_results_are_contiguous(m, device):
    v = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], np.float32)
    x = pydiff.tensor(v, dtype="float3", device=device).with_tangent(np.ones((2, 3)))
    y, dy = m.sq3.fwds(x)
    assert dy.native.is_contiguous() and y.native.is_contiguous()
    np.testing.assert_allclose(np.asarray(dy.numpy()).reshape(2, 3), 2 * v, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y.numpy()).reshape(2, 3), v * v, rtol=1e-6)


# --- jvp of a module function on a recording tape: gradients reach primals and tangents -----


@pytest.mark.parametrize("n", [3, 5000])
def test_module_jvp_on_a_tape_carries_the_gradient(m, device, n):
    # Before: pydiff.jvp(m.f, ...) ran fn.fwds on a detached primal, so its tangent was a
    # constant to the recording tape: loss = sum(J u) + sum(x^2) gave x.grad = 2x, silently
    # without the 6x u of the tangent's share (the Python-function form was right).
    xs = np.linspace(0.1, 1.0, n).astype(np.float32)
    x = pydiff.tensor(xs, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        _, t = pydiff.jvp(m.cube, (x,), (np.ones(n),))
        loss = ops.sum(t) + ops.sum(x * x)
    tape.backward(loss)
    x64 = xs.astype(np.float64)
    want = _central(lambda a: np.sum(3 * a**2) + np.sum(a * a), x64)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-4, atol=1e-5)


def test_module_jvp_on_a_tape_same_tensor_twice(m, device):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        _, t = pydiff.jvp(m.mul2, (x, x), (np.ones(3), np.ones(3)))  # d(a b^2) at a = b = x
        loss = ops.sum(t)
    tape.backward(loss)
    want = _central(lambda a: np.sum(a * a + 2 * a * a), X64)  # t = b^2 + 2ab
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("module_fn", [True, False])
def test_jvp_tangent_that_requires_grad_gets_its_gradient(m, device, module_fn):
    # Before: a pydiff tensor given as the tangent was copied to the host, so on a tape its
    # gradient was silently 0 (torch.func.jvp gives d<J u>/du = J^T 1 = 3 x^2).
    x = pydiff.tensor(X, requires_grad=True, device=device)
    u = pydiff.tensor(U, requires_grad=True, device=device)
    fn = m.cube if module_fn else (lambda a: ops.mul(ops.mul(a, a), a))
    with pydiff.Tape() as tape:
        _, t = pydiff.jvp(fn, (x,), (u,))
        loss = ops.sum(t)
    tape.backward(loss)
    np.testing.assert_allclose(u.grad.numpy(), 3 * X64**2, rtol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), 6 * X64 * U, rtol=1e-5)


def test_jvp_tangent_requiring_grad_of_another_dtype_is_refused(device):
    x = pydiff.tensor(X.astype(np.float16), dtype="half", device=device)
    u = pydiff.tensor(U, requires_grad=True, device=device)
    with pydiff.Tape():
        with pytest.raises(TypeError, match=r"jvp: tangents\[0\]: a pydiff.Tensor of shape"):
            pydiff.jvp(lambda a: a * 2.0, (x,), (u,))


def test_module_jvp_writing_arguments_on_a_tape_is_refused(m, device):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    y = pydiff.zeros((3,), device=device)
    with pydiff.Tape():
        with pytest.raises(RuntimeError, match=r"jvp: .*cube_out writes its arguments"):
            pydiff.jvp(m.cube_out, (x, y), (np.ones(3), None))
    # off the tape it works as before
    (w,), (tw,) = pydiff.jvp(m.cube_out, (x, y), (np.ones(3), None))
    np.testing.assert_allclose(tw.numpy(), 3 * X64**2, rtol=1e-6)


def test_module_jvp_off_the_tape_is_unchanged(m, device):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    y, t = pydiff.jvp(m.cube, (x,), (U,))
    np.testing.assert_allclose(t.numpy(), 3 * X64**2 * U, rtol=1e-6)
    assert x.grad is None or not np.any(x.grad.numpy())


# --- copy.deepcopy and pickle of tensors, layers and optimizers --------------------------------


def test_deepcopy_of_a_layer_gives_independent_parameters(device):
    # Before: copy.deepcopy of a tensor, an nn.Linear or an optimizer raised SlangPy's
    # "cannot pickle 'Tensor' object" (an EMA / target network copy is a deepcopy in torch).
    import copy

    layer = pydiff.nn.Linear(3, 2, seed=0, device=device)
    twin = copy.deepcopy(layer)
    w0 = layer.weight.numpy().copy()
    assert twin.weight is not layer.weight and twin.weight.requires_grad
    np.testing.assert_array_equal(twin.weight.numpy(), w0)
    assert twin.weight.device is layer.weight.device
    x = pydiff.tensor(np.ones((4, 3), np.float32), device=device)
    opt = pydiff.optim.SGD(twin.parameters(), lr=0.5)
    with pydiff.Tape() as tape:
        loss = ops.sum(twin(x))
    opt.zero_grad()
    tape.backward(loss)
    opt.step()
    np.testing.assert_array_equal(layer.weight.numpy(), w0)  # the original is untouched
    np.testing.assert_allclose(twin.weight.numpy(), w0 - 0.5 * 4.0, rtol=1e-6)  # dL/dW = 4
    assert not np.any(layer.weight.grad.numpy())
    opt2 = copy.deepcopy(opt)
    assert opt2.params[0] is not twin.weight
    np.testing.assert_array_equal(opt2.params[0].numpy(), twin.weight.numpy())


@pytest.mark.parametrize(
    "dtype, values",
    [
        ("float", np.float32([[1.5, -2.0], [3.0, 1e-30]])),
        ("float", np.float32(2.5)),  # 0-d
        ("half", np.float16([1.0, -0.5])),
        ("int", np.int32([1, -7])),
        ("uint", np.uint32([4000000000])),
        ("bool", np.array([True, False])),
        ("float3", np.arange(6, dtype=np.float32).reshape(2, 3)),
        ("float2x2", np.arange(8, dtype=np.float32).reshape(2, 2, 2)),
        ("double", np.float64([1.5, 1e300])),
        ("int64_t", np.int64([2**40, -3])),
    ],
)
def test_pickle_and_deepcopy_keep_values_dtype_and_shape(device, dtype, values):
    import copy
    import pickle

    t = pydiff.tensor(values, dtype=dtype, device=device)
    for other in (pickle.loads(pickle.dumps(t)), copy.deepcopy(t)):
        assert (other.dtype, other.shape) == (t.dtype, t.shape)
        np.testing.assert_array_equal(np.asarray(other.numpy()), values)
    w = pydiff.tensor(np.float32([1.0, 2.0]), requires_grad=True, device=device)
    back = pickle.loads(pickle.dumps({"w": w, "n": 3}))
    assert back["n"] == 3 and back["w"].requires_grad
    np.testing.assert_array_equal(back["w"].numpy(), [1.0, 2.0])


def test_deepcopy_refused_on_a_tape_and_copy_still_shares(device):
    import copy

    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape():
        with pytest.raises(TypeError, match="copy.deepcopy: a pydiff.Tensor of shape"):
            copy.deepcopy(x)
    shallow = copy.copy(x)  # as before (and as torch): the same storage
    assert shallow.storage is x.storage


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_deepcopy_and_pickle_of_an_optimizer_after_steps_continue_as_torch(device, name):
    # Before: after a step an optimizer held bound kernel objects, and deepcopy/pickle
    # raised "cannot pickle 'ComputeKernel' object". The copies continue like the original
    # (checked against torch.optim, float32, on the same gradients).
    import copy
    import pickle

    torch = pytest.importorskip("torch")
    kw = {"lr": 0.1, "weight_decay": 0.05} | ({"momentum": 0.9} if name == "SGD" else {})
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(3).astype(np.float32) for _ in range(6)]
    w = pydiff.tensor(X, requires_grad=True, device=device)
    tw = torch.tensor(X, requires_grad=True)
    opt, topt = getattr(pydiff.optim, name)([w], **kw), getattr(torch.optim, name)([tw], **kw)
    for k, g in enumerate(grads):
        if k == 3:
            opt = copy.deepcopy(opt) if name != "Adam" else pickle.loads(pickle.dumps(opt))
            w = opt.params[0]
        w.grad.copy_from_numpy(g)
        tw.grad = torch.tensor(g)
        opt.step()
        topt.step()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-5, atol=1e-6)


# --- Function.apply takes keyword arguments, as torch's does ----------------------------------


class _Scaled(pydiff.Function):
    @staticmethod
    def forward(ctx, a, b=None, k=2.0):
        ctx.save_for_backward(a, b)
        ctx.k = k
        return ops.mul(ops.mul(a, b), k)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return ops.mul(ops.mul(g, b), ctx.k), ops.mul(ops.mul(g, a), ctx.k)


def test_function_apply_binds_keyword_arguments(device):
    # Before: Scaled.apply(a, b=b, k=3.0) raised "apply() got an unexpected keyword argument"
    # (torch's Function.apply binds keywords to forward's parameters).
    a = pydiff.tensor(X, requires_grad=True, device=device)
    b = pydiff.tensor(U, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        loss = ops.sum(_Scaled.apply(a, b=b, k=3.0)) + ops.sum(_Scaled.apply(b, a))
    tape.backward(loss)
    np.testing.assert_allclose(a.grad.numpy(), 3 * U + 2 * U, rtol=1e-6)  # d/da (3ab + 2ba)
    np.testing.assert_allclose(b.grad.numpy(), 3 * X + 2 * X, rtol=1e-6)
    with pytest.raises(TypeError, match=r"_Scaled.apply: .*unexpected keyword argument 'kk'"):
        _Scaled.apply(a, b=b, kk=3.0)
    assert pydiff.gradcheck(lambda a, b: _Scaled.apply(a, k=0.5, b=b), (a, b))


def test_module_jvp_on_a_tape_with_an_array_parameter(device):
    # A host array given a direction for an array parameter stays one value on the tape too.
    m = pydiff.load_module_from_source(
        "s42_breaker42_arr",
        "[Differentiable] float fa(float a[3], float x) { return a[0]*x + a[1]*x*x + a[2]; }",
        device=device,
    )
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        _, t = pydiff.jvp(m.fa, ([1.0, 2.0, 3.0], x), ([1.0, 0.5, 0.0], np.ones(3)))
        loss = ops.sum(t)
    tape.backward(loss)
    # t = x + 0.5 x^2 + (1 + 4 x): dt/dx = 1 + x + 4
    np.testing.assert_allclose(t.numpy(), X64 + 0.5 * X64**2 + 1 + 4 * X64, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 5 + X64, rtol=1e-6)


def test_fwds_on_a_recording_tape_refuses_a_tensor_that_requires_grad(m, device):
    # Before: fn.fwds on a tape with x requiring grad returned a constant tangent: a loss
    # sum(dy) + sum(x^2) gave x.grad = 2x, silently without dy's share (6x).
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape():
        with pytest.raises(RuntimeError, match=r"cube.fwds: parameter 'a' .* requires a gradient"):
            m.cube.fwds(x.with_tangent(np.ones(3)))
        with pytest.raises(RuntimeError, match=r"mul2.fwds: parameter 'b'"):
            m.mul2.fwds((2.0, 1.0), x)  # held fixed, but its gradient through y would be lost
        y, dy = m.cube.fwds(x.detach().with_tangent(np.ones(3)))  # on purpose: fine
    np.testing.assert_allclose(dy.numpy(), 3 * X64**2, rtol=1e-6)
    y, dy = m.cube.fwds(x.with_tangent(np.ones(3)))  # off the tape, as before
    np.testing.assert_allclose(dy.numpy(), 3 * X64**2, rtol=1e-6)


def test_gradient_of_a_module_jvp_by_grad_and_gradcheck(m, device):
    # d/dx sum(J(x) 1) = 6x, by the transforms that run their own tape
    g = pydiff.grad(lambda x: ops.sum(pydiff.jvp(m.cube, (x,), (np.ones(3),))[1]))(X)
    np.testing.assert_allclose(g, _central(lambda a: np.sum(3 * a**2), X64), rtol=1e-5)
    x = pydiff.tensor(X, requires_grad=True, device=device)
    assert pydiff.gradcheck(lambda x: pydiff.jvp(m.cube, (x,), (np.ones(3),))[1], (x,))


def test_struct_tensors_deepcopy_but_refuse_pickle_by_name(device):
    import copy
    import pickle

    m = pydiff.load_module_from_source(
        "s42_breaker42_struct",
        "struct S { float a; int b; };\nS mk(float x) { S s; s.a = x; s.b = 2; return s; }",
        device=device,
    )
    t = m.mk(pydiff.tensor(np.float32([1.0, 2.0]), device=device), _result="tensor")
    with pytest.raises(TypeError, match=r"pickle: a pydiff.Tensor of dtype 'S' cannot be pickled"):
        pickle.dumps(t)
    d = copy.deepcopy(t)
    assert d.dtype == "S" and d.storage is not t.storage
    np.testing.assert_array_equal(d.numpy(), t.numpy())


def test_grad_and_gradcheck_with_respect_to_a_jvp_tangent(m, device):
    # Before: pydiff.grad of a function of the tangent it gives pydiff.jvp returned zeros
    # (the tangent was copied to the host): d/du sum(J u) = J^T 1 = 3 x^2.
    x = pydiff.tensor(X, device=device)
    for fn in (m.cube, lambda a: a * a * a):
        g = pydiff.grad(lambda u, fn=fn: ops.sum(pydiff.jvp(fn, (x,), (u,))[1]))(U)
        np.testing.assert_allclose(g, 3 * X64**2, rtol=1e-5)
    xx = pydiff.tensor(X, requires_grad=True, device=device)
    uu = pydiff.tensor(U, requires_grad=True, device=device)
    assert pydiff.gradcheck(lambda a, u: pydiff.jvp(m.cube, (a,), (u,))[1], (xx, uu))


# --- a Function's integer and bool NumPy outputs are integer tensors without gradient --------


class _Sort(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        v = x.numpy()
        ctx.order = np.argsort(v)
        return pydiff.tensor(v[ctx.order], device=x.device), ctx.order, v > 0, 16777217

    @staticmethod
    def backward(ctx, g, g_order, g_mask, g_n):
        assert g_order is None and g_mask is None and g_n is None
        out = np.zeros(g.shape, np.float32)
        out[ctx.order] = g.numpy()
        return out


def test_function_integer_numpy_outputs_keep_their_values_and_carry_no_gradient(device):
    # Before: NumPy int/bool outputs (an argsort, a mask) and a Python int became float32
    # tensors that required a gradient: 16777217 came back 16777216, against the documented
    # "integer and bool outputs ... have no gradient".
    x = pydiff.tensor(np.float32([3.0, -1.0, 2.0]), requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        s, order, mask, n = _Sort.apply(x)
        loss = ops.sum(ops.mul(s, pydiff.tensor(np.float32([1, 2, 3]), device=device)))
    tape.backward(loss)
    assert (order.dtype, mask.dtype, n.dtype) == ("int", "bool", "int")
    assert not (order.requires_grad or mask.requires_grad or n.requires_grad)
    np.testing.assert_array_equal(order.numpy(), [1, 2, 0])
    np.testing.assert_array_equal(mask.numpy(), [True, False, True])
    assert int(n) == 16777217
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 1.0, 2.0])  # sorted [-1, 2, 3] * [1, 2, 3]


class _Out(pydiff.Function):
    @staticmethod
    def forward(ctx, x, value):
        return value

    @staticmethod
    def backward(ctx, g):
        return g


@pytest.mark.parametrize(
    "value, error",
    [(np.array([1e39]), "beyond the largest float32"), (np.array([1 + 2j]), "complex values")],
)
def test_function_float_outputs_are_checked_as_pydiff_tensor_checks_them(device, value, error):
    # Before: 1e39 came back inf (a NumPy RuntimeWarning only) and 1+2j came back 1 (the
    # imaginary part dropped), where pydiff.tensor refuses both.
    x = pydiff.tensor(np.float32([1.0]), requires_grad=True, device=device)
    with pytest.raises((ValueError, TypeError), match=error):
        _Out.apply(x, value)
    out = _Out.apply(x, np.array([np.inf, np.nan, 2.5]))  # IEEE values as they are
    np.testing.assert_array_equal(out.numpy(), [np.inf, np.nan, 2.5])
