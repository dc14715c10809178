"""Issue 18: forward mode through Python functions of ops, operators, slicing and shader calls
(pydiff.jvp), reverse over forward (pydiff.hvp), Jacobians (jacfwd, jacrev) and Hessians of
composed functions, against torch.func in float64 and central differences in float64."""

from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")
tf = pytest.importorskip("torch.func")

RNG = np.random.default_rng(18)
POLY = Path(__file__).resolve().parents[1] / "samples" / "polynomial.slang"
RTOL, ATOL = 2e-4, 2e-5


def _t(a):
    return pydiff.tensor(np.asarray(a, np.float32))


def _torch(a):
    return torch.tensor(np.asarray(a, np.float64))


def _np(v):
    return v.numpy() if isinstance(v, pydiff.Tensor) else np.asarray(v)


def _check_jvp_hvp(f_pd, f_th, xs, us, hvp=True, rtol=RTOL, atol=ATOL):
    """pydiff.jvp (and, for scalar f, pydiff.hvp) against torch.func in float64."""
    y, t = pydiff.jvp(f_pd, [_t(x) for x in xs], us)
    ry, rt = tf.jvp(f_th, tuple(_torch(x) for x in xs), tuple(_torch(u) for u in us))
    np.testing.assert_allclose(_np(y), ry.numpy().reshape(_np(y).shape), rtol=rtol, atol=atol)
    np.testing.assert_allclose(_np(t), rt.numpy().reshape(_np(t).shape), rtol=rtol, atol=atol)
    if not hvp:
        return

    def scalar(*a):
        return f_th(*a).sum()

    got = pydiff.hvp(lambda *a: f_pd(*a).sum(), [_t(x) for x in xs], us)
    _, want = tf.jvp(
        tf.grad(scalar, argnums=tuple(range(len(xs)))),
        tuple(_torch(x) for x in xs),
        tuple(_torch(u) for u in us),
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(_np(g), w.numpy(), rtol=10 * rtol, atol=10 * atol)


def test_composition_of_ops_operators_slicing_and_a_shader_call(device):
    pydiff.set_default_device(device)
    m = pydiff.load_module(POLY, device=device)
    X, W = RNG.uniform(-1, 1, (3, 4)), RNG.uniform(-1, 1, (4, 2))
    U, V = RNG.uniform(-1, 1, (3, 4)), RNG.uniform(-1, 1, (4, 2))

    def f(x, w):
        p = m.polynomial(0.5, -1.0, 0.25, x, _result="tensor")  # 0.5 x^2 - x + 0.25
        h = (p * x.tanh())[1:, ::2] @ w[::2] - w.T[:, :2].sum(axis=0) / 3.0
        return ops.sigmoid(h) ** 2 + h.exp()

    def g(x, w):
        p = 0.5 * x * x - x + 0.25
        h = (p * torch.tanh(x))[1:, ::2] @ w[::2] - w.T[:, :2].sum(dim=0) / 3.0
        return torch.sigmoid(h) ** 2 + torch.exp(h)

    _check_jvp_hvp(f, g, (X, W), (U, V))


def test_mlp_jvp_hvp_jacobians_and_hessian(device):
    pydiff.set_default_device(device)
    X, T = RNG.standard_normal((5, 3)), RNG.standard_normal((5, 2))
    W1, B1, W2 = RNG.standard_normal((4, 3)), RNG.standard_normal(4), RNG.standard_normal((2, 4))
    x, t = _t(X), _t(T)

    def f(w1, b1, w2):
        return ops.mse_loss(ops.linear(ops.tanh(ops.linear(x, w1, b1)), w2), t)

    def g(w1, b1, w2):
        h = torch.tanh(_torch(X) @ w1.T + b1)
        return ((h @ w2.T - _torch(T)) ** 2).mean()

    xs = (W1, B1, W2)
    us = tuple(RNG.standard_normal(a.shape) for a in xs)
    _check_jvp_hvp(f, g, xs, us)

    # Jacobians of a vector function, by forward and by reverse mode, two argnums
    def fv(w1, b1):
        return ops.tanh(ops.linear(x, w1, b1))[:, 1]

    def gv(w1, b1):
        return torch.tanh(_torch(X) @ w1.T + b1)[:, 1]

    want = tf.jacfwd(gv, argnums=(0, 1))(_torch(W1), _torch(B1))
    for jac in (pydiff.jacfwd, pydiff.jacrev):
        got = jac(fv, argnums=(0, 1))(_t(W1), _t(B1))
        assert got[0].shape == (5, 4, 3) and got[1].shape == (5, 4)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b.numpy(), rtol=RTOL, atol=ATOL)
    # the Hessian over (b1, w2) flattened and concatenated, as for shader functions
    H = pydiff.hessian(lambda b1, w2: f(_t(W1), b1, w2), (B1.astype(np.float32), W2))
    Ht = tf.hessian(lambda z: g(_torch(W1), z[:4], z[4:].reshape(2, 4)))(
        _torch(np.concatenate([B1, W2.ravel()]))
    )
    np.testing.assert_allclose(H, Ht.numpy(), rtol=1e-3, atol=1e-4)


def _softmax_case(axis, log):
    op = ops.log_softmax if log else ops.softmax
    ref = torch.log_softmax if log else torch.softmax
    return (lambda x: op(x, axis=axis)), (lambda x: ref(x, dim=axis)), [(3, 4)]


@pytest.mark.parametrize(
    "case",
    [
        "softmax-1",
        "softmax0",
        "log_softmax-1",
        "layer_norm",
        "layer_norm_plain",
        "rms_norm",
        "attention",
        "attention_causal_batched",
        "cross_entropy",
        "silu_and_mul",
        "elementwise",
        "matmul_relu_linear",
        "sum_mean_axes",
    ],
)
def test_ops_rules_against_torch(device, case):
    pydiff.set_default_device(device)
    F = torch.nn.functional
    hvp = True
    if case.startswith("softmax") or case.startswith("log_softmax"):
        f, g, shapes = _softmax_case(int(case.split("softmax")[1]), case.startswith("log"))
    elif case == "layer_norm":
        f, g = ops.layer_norm, lambda x, w, b: F.layer_norm(x, (4,), w, b, 1e-5)
        shapes = [(3, 4), (4,), (4,)]
    elif case == "layer_norm_plain":
        f, g, shapes = ops.layer_norm, lambda x: F.layer_norm(x, (4,), eps=1e-5), [(2, 3, 4)]
    elif case == "rms_norm":
        f, shapes = (lambda x, w: ops.rms_norm(x, w, 1e-6)), [(3, 4), (4,)]

        def g(x, w):
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    elif case == "attention":
        f, g, shapes = ops.attention, F.scaled_dot_product_attention, [(3, 2), (4, 2), (4, 3)]
    elif case == "attention_causal_batched":
        f = lambda q, k, v: ops.attention(q, k, v, causal=True)  # noqa: E731
        g = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        shapes = [(2, 3, 2), (2, 3, 2), (2, 3, 2)]
    elif case == "cross_entropy":
        labels = np.array([2, 0, 1])
        f = lambda z: ops.cross_entropy(z, labels)  # noqa: E731
        g = lambda z: F.cross_entropy(z, torch.tensor(labels))  # noqa: E731
        shapes = [(3, 4)]
    elif case == "silu_and_mul":
        f, shapes = ops.silu_and_mul, [(3, 4)]

        def g(x):
            return F.silu(x[:, :2]) * x[:, 2:]

    elif case == "elementwise":
        shapes = [(2, 3), (2, 3)]

        def f(a, b):
            return (
                ops.add(ops.div(ops.gelu(a), ops.add(ops.exp(b), 1.0)), ops.silu(b))
                * ops.sqrt(ops.add(ops.mul(a, a), 1.0))
                + ops.log(ops.add(ops.sin(a), 2.0))
                - ops.cos(b)
                + ops.swiglu(a, b)
                - ops.neg(b)
            )

        def g(a, b):
            gelu = F.gelu(a, approximate="tanh")
            return (
                (gelu / (torch.exp(b) + 1.0) + F.silu(b)) * torch.sqrt(a * a + 1.0)
                + torch.log(torch.sin(a) + 2.0)
                - torch.cos(b)
                + F.silu(a) * b
                + b
            )

    elif case == "matmul_relu_linear":
        shapes = [(3, 4), (4, 4), (4,)]

        def f(x, w, b):
            return ops.linear(ops.relu(ops.matmul(x, w)), w, b, activation="relu")

        def g(x, w, b):
            return torch.relu(torch.relu(x @ w) @ w.T + b)

    else:  # sum_mean_axes
        shapes = [(2, 3, 4)]

        def f(x):
            return ops.sum(ops.mul(x, x), axis=(0, 2)) + ops.mean(x, axis=2).sum(axis=0)

        def g(x):
            return (x * x).sum(dim=(0, 2)) + x.mean(dim=2).sum(dim=0)

    xs = tuple(RNG.uniform(-1.5, 1.5, s) for s in shapes)
    us = tuple(RNG.standard_normal(s) for s in shapes)
    _check_jvp_hvp(f, g, xs, us, hvp=hvp)


def test_batched_attention_rule_in_blocks_of_heads(device, monkeypatch):
    # the rule's heads go in blocks (bounded memory): force blocks of one head and of two
    from pydiff import ops_attention

    pydiff.set_default_device(device)

    def causal(q, k, v):  # torch's fused kernel has no forward AD for 4-D inputs
        s = q @ k.transpose(-1, -2) / np.sqrt(2.0)
        s = s.masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    xs = tuple(RNG.uniform(-1, 1, (3, 2, 3, 2)) for _ in range(3))
    us = tuple(RNG.standard_normal((3, 2, 3, 2)) for _ in range(3))
    for block in (9, 36):
        monkeypatch.setattr(ops_attention, "SCORES_BLOCK", block)
        _check_jvp_hvp(
            lambda q, k, v: ops.attention(q, k, v, causal=True),
            causal,
            xs,
            us,
        )


def test_dropout_tangent_uses_the_same_mask(device):
    pydiff.set_default_device(device)
    X, U = RNG.standard_normal((4, 8)), RNG.standard_normal((4, 8))
    y, t = pydiff.jvp(lambda x: ops.dropout(x, 0.5, 7), (_t(X),), (U,))
    keep = y.numpy() != 0  # the kept elements, scaled by 1 / (1 - p)
    np.testing.assert_allclose(t.numpy(), np.where(keep, U / 0.5, 0.0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y.numpy(), np.where(keep, X / 0.5, 0.0), rtol=1e-6)


def test_fixed_point_tangent_by_the_implicit_function_theorem(device):
    pydiff.set_default_device(device)
    A, B = np.array([0.5, -0.3]), np.array([0.2, 1.0])
    DA, DB = np.array([1.0, 0.5]), np.array([-1.0, 2.0])

    def solve(a, b):
        return pydiff.fixed_point(lambda x, a, b: a * ops.tanh(x) + b, np.zeros(2), a, b, tol=1e-7)

    x, dx = pydiff.jvp(solve, (_t(A), _t(B)), (DA, DB))
    xs = x.numpy().astype(np.float64)
    np.testing.assert_allclose(xs, A * np.tanh(xs) + B, atol=1e-5)
    # (1 - a sech^2 x) dx = da tanh x + db: closed form at the solution
    want = (DA * np.tanh(xs) + DB) / (1 - A * (1 - np.tanh(xs) ** 2))
    np.testing.assert_allclose(dx.numpy(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match=r"FixedPoint: its forward-mode tangent"):
        pydiff.hvp(lambda a, b: solve(a, b).sum(), (_t(A), _t(B)), (DA, DB))


class _Cube(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return pydiff.tensor(x.numpy() ** 3, device=x.device)

    @staticmethod
    def backward(ctx, g):
        return 3 * ctx.saved_tensors[0].numpy() ** 2 * g.numpy()

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return ops.mul(ops.mul(ops.mul(x, x), 3.0), t)


class _NoJvp(_Cube):
    jvp = pydiff.Function.jvp


def test_custom_function_jvp_and_hvp_and_refusal_without_one(device):
    pydiff.set_default_device(device)
    X, U = np.array([1.0, -2.0, 0.5]), np.array([0.3, 1.0, -1.0])
    _, t = pydiff.jvp(lambda x: _Cube.apply(x), (_t(X),), (U,))
    np.testing.assert_allclose(t.numpy(), 3 * X**2 * U, rtol=1e-6)
    (hv,) = pydiff.hvp(lambda x: _Cube.apply(x).sum(), (_t(X),), (U,))
    np.testing.assert_allclose(hv.numpy(), 6 * X * U, rtol=1e-6)
    with pytest.raises(NotImplementedError, match=r"_NoJvp has a backward but no jvp"):
        pydiff.jvp(lambda x: _NoJvp.apply(x), (_t(X),), (U,))
    # gradcheck checks forward mode of composed functions and Functions on request
    x = _t(X).requires_grad_(True)
    assert pydiff.gradcheck(lambda x: ops.tanh(_Cube.apply(x)) * 2.0, (x,), check_forward=True)
    assert pydiff.gradcheck(_Cube, (x,), check_forward=True)


def test_hessian_holds_integer_primals_fixed(device):
    pydiff.set_default_device(device)
    Z, labels = RNG.standard_normal((2, 3)), np.array([2, 0])
    H = pydiff.hessian(ops.cross_entropy, (Z.astype(np.float32), labels))
    want = tf.hessian(lambda z: torch.nn.functional.cross_entropy(z, torch.tensor(labels)))
    np.testing.assert_allclose(H, want(_torch(Z)).numpy(), rtol=1e-4, atol=1e-5)  # (2, 3, 2, 3)


def test_shader_call_on_an_intermediate_with_a_broadcast_argument(device):
    # the call's tangent depends on x through its argument z = x^2 and z's tangent 2 x u:
    # hvp needs both d/dz (bwd_diff of the directional derivative) and d/du (J^T g)
    pydiff.set_default_device(device)
    m = pydiff.load_module(POLY, device=device)

    def f(x, a):
        z = ops.mul(x, x)
        return ops.sum(m.polynomial(a, 1.0, 0.5, z, _result="tensor") * x)

    def g(x, a):
        z = x * x
        return (a * z * z + z + 0.5) * x

    xs = (np.array([0.3, -0.7, 1.1]), np.array([0.5]))
    _check_jvp_hvp(f, lambda x, a: g(x, a).sum(), xs, (np.array([1.0, 0.5, -1.0]), [0.7]))


def test_hessian_of_a_shader_composition_against_finite_differences(device):
    pydiff.set_default_device(device)
    m = pydiff.load_module(POLY, device=device)
    X = np.array([0.3, -0.7, 1.1])

    def f(x):
        y = m.polynomial(1.0, -2.0, 0.5, x, _result="tensor")
        return ops.sum(ops.mul(ops.sin(y), x))

    def fnp(x):
        return np.sum(np.sin(x * x - 2 * x + 0.5) * x)

    H = pydiff.hessian(f, (_t(X),))
    h, Hfd = 1e-4, np.zeros((3, 3))
    for i in range(3):
        for j in range(3):
            ei, ej = np.eye(3)[i] * h, np.eye(3)[j] * h
            Hfd[i, j] = (
                fnp(X + ei + ej) - fnp(X + ei - ej) - fnp(X - ei + ej) + fnp(X - ei - ej)
            ) / (4 * h * h)
    np.testing.assert_allclose(H, Hfd, rtol=1e-3, atol=1e-3)


def test_jacobians_of_several_outputs_nest_as_torch_func(device):
    pydiff.set_default_device(device)
    X, W = RNG.standard_normal(3), RNG.standard_normal((2, 3))

    def f(x, w):
        return ops.tanh(x) * 2.0, ops.sum(ops.mul(w, x), axis=1)

    def g(x, w):
        return torch.tanh(x) * 2.0, (w * x).sum(dim=1)

    want = tf.jacrev(g, argnums=(0, 1))(_torch(X), _torch(W))
    for jac in (pydiff.jacfwd, pydiff.jacrev):
        got = jac(f, argnums=(0, 1))(_t(X), _t(W))
        assert len(got) == 2 and all(len(per) == 2 for per in got)
        for per_got, per_want in zip(got, want):
            for a, b in zip(per_got, per_want):
                assert a.shape == tuple(b.shape)
                np.testing.assert_allclose(a, b.numpy(), rtol=RTOL, atol=ATOL)
        single = jac(f)(_t(X), _t(W))  # argnums=0: one array per output
        np.testing.assert_allclose(single[1], want[1][0].numpy(), rtol=RTOL, atol=ATOL)


def test_jacobians_of_a_module_function(device):
    pydiff.set_default_device(device)
    m = pydiff.load_module(POLY, device=device)
    X = np.array([0.5, -1.0, 2.0])
    for jac in (pydiff.jacfwd, pydiff.jacrev):
        J = jac(m.polynomial, argnums=3)(2.0, 8.0, -1.0, _t(X))
        np.testing.assert_allclose(J, np.diag(4 * X + 8), rtol=1e-6)  # d/dx (2x^2 + 8x - 1)


def test_shader_call_writing_an_argument_is_refused(device, load):
    pydiff.set_default_device(device)
    m = load("forward", device)
    x, y = _t([1.0, 2.0]), pydiff.zeros((2,), device=device)
    with pytest.raises(NotImplementedError, match=r"forward\.cube_out writes its parameter 'y'"):
        pydiff.jvp(lambda x: (m.cube_out(x, y), y)[1], (x,), (np.ones(2),))

    def bwds(x):
        r = m.sine(x, _result="tensor").with_grads(ones=True)
        m.sine.bwds(x, _result=r)
        return r

    with pytest.raises(NotImplementedError, match=r"forward\.sine\.bwds inside pydiff\.jvp"):
        pydiff.jvp(lambda x: bwds(x * 1.0), (x,), (np.ones(2),))


def test_bad_inputs_name_the_argument(device):
    pydiff.set_default_device(device)
    x = _t([1.0, 2.0, 3.0])
    with pytest.raises(
        ValueError, match=r"jvp: tangents\[0\] has shape \(2,\); primal 0 has shape \(3,\)"
    ):
        pydiff.jvp(lambda x: x * 2.0, (x,), (np.ones(2),))
    with pytest.raises(ValueError, match=r"jvp: 1 primals but 2 tangents"):
        pydiff.jvp(lambda x: x * 2.0, (x,), (np.ones(3), None))
    with pytest.raises(ValueError, match=r"hvp: fn must return a one-element tensor"):
        pydiff.hvp(lambda x: x * x, (x,), (np.ones(3),))
    with pytest.raises(ValueError, match=r"hessian: fn must return a one-element tensor"):
        pydiff.hessian(lambda x: x * x, (x,))
    with pytest.raises(ValueError, match=r"hessian: 3 inputs need 3 HVPs; above max_inputs=2"):
        pydiff.hessian(lambda x: (x * x).sum(), (x,), max_inputs=2)
    with pytest.raises(ValueError, match=r"jacfwd: 3 inputs need 3 passes; above max_inputs=2"):
        pydiff.jacfwd(lambda x: x * x, max_inputs=2)(x)
    with pytest.raises(ValueError, match=r"jacrev: 3 output elements need 3 passes"):
        pydiff.jacrev(lambda x: x * x, max_outputs=2)(x)
    with pytest.raises(TypeError, match=r"jacrev: fn returned a str \(output 1\)"):
        pydiff.jacrev(lambda x: (x * 2.0, "no"))(x)
    with pytest.raises(ValueError, match=r"jacfwd: argnums=3 is out of range"):
        pydiff.jacfwd(lambda x: x)(x)  # fine
        pydiff.jacfwd(lambda x: x, argnums=3)(x)
    with pytest.raises(TypeError, match=r"jvp: fn returned a str"):
        pydiff.jvp(lambda x: "no", (x,), (np.ones(3),))
    with pytest.raises(NotImplementedError, match=r"tape\.backward inside pydiff\.jvp"):
        pydiff.jvp(pydiff.grad(lambda x: (x * x * x).sum()), (x,), (np.ones(3),))
    with pytest.raises(NotImplementedError, match=r"hvp inside a function given to pydiff\.jvp"):
        pydiff.jvp(lambda x: pydiff.hvp(lambda y: (y * y).sum(), (x,), (x,))[0], (x,), (x,))
    with pytest.raises(TypeError, match=r"jvp: primal 0 is a torch tensor; .*pydiff\.from_torch"):
        pydiff.jvp(lambda x: x, (torch.ones(3),), (np.ones(3),))
