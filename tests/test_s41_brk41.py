"""Session 41, brk41: a new user's edge cases in the transforms, gradcheck, custom Functions,
torch interop and optimizers, each checked against closed forms or float64 references."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")

SRC = """
[Differentiable] float poly(float a, float x) { return a * x * x * x + sin(x); }
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] [BackwardDerivative(bsq_bwd)] float bsq(float x) { return x * x; }
void bsq_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 3.0 * x.p * d); }
"""

X = np.array([0.3, -0.7, 1.1])
U = np.array([1.0, 2.0, -1.0])
A = 1.5


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s41_brk41", SRC, device=device)


def _t(values, **kw):
    return torch.tensor(np.asarray(values, np.float32), **kw)


# --- module-function transforms take torch primals as Python functions' do ---------------


def test_module_jvp_refuses_a_torch_primal_given_a_direction(m, device):
    # Before: jvp of a module function differentiated a torch primal given a tangent, while
    # vjp (and jvp of a Python function) refused it: now both refuse it by name.
    with pytest.raises(TypeError, match=r"jvp: primal 1 \('x' of .*poly\) is a torch tensor.*"):
        pydiff.jvp(m.poly, (A, _t(X)), (None, U))
    with pytest.raises(TypeError, match=r"jvp: primal 0 is a torch tensor; give directions"):
        pydiff.jvp(lambda x: x * 2.0, (_t(X),), (U,))
    # held fixed (no direction): d/da (a x^3 + sin x) = x^3, x torch data
    y, t = pydiff.jvp(m.poly, (A, _t(X)), (1.0, None))
    np.testing.assert_allclose(y.numpy(), A * X**3 + np.sin(X), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t.numpy(), X**3, rtol=1e-5, atol=1e-6)


def test_module_hvp_holds_a_torch_primal_fixed(m, device):
    # Before: hvp returned H v for the torch primal as for a float array; now None (held
    # fixed, as hvp of a Python function gives), a direction for it refused by name.
    x32 = X.astype(np.float32).astype(np.float64)
    ha, hx = pydiff.hvp(m.poly, (A, _t(X)), (1.0, None))
    assert hx is None
    np.testing.assert_allclose(ha, 0.0, atol=1e-6)  # d2/da2 = 0
    with pytest.raises(TypeError, match=r"hvp: primal 1 \('x' of .*\) is a torch tensor"):
        pydiff.hvp(m.poly, (A, _t(X)), (0.0, U))
    # the torch tensor held fixed at a float parameter, a pydiff x differentiated
    ha, hx = pydiff.hvp(m.poly, (A, pydiff.tensor(X, device=device)), (0.0, U))
    np.testing.assert_allclose(hx.numpy(), (6 * A * x32 - np.sin(x32)) * U, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ha, np.sum(3 * x32**2 * U), rtol=1e-4)


def test_module_transforms_name_a_torch_primal_that_requires_grad(m, device):
    # Before: hvp raised torch's "Can't call numpy() on Tensor that requires grad", jvp a
    # message naming .fwds.
    t = _t(X, requires_grad=True)
    for run in (
        lambda: pydiff.hvp(m.poly, (A, t), (1.0, None)),
        lambda: pydiff.jvp(m.poly, (A, t), (1.0, None)),
    ):
        with pytest.raises(TypeError, match=r"primal 1 is a torch tensor that requires grad"):
            run()


def test_module_hessian_refuses_a_torch_primal(m, device):
    # Before: differentiated it, while hessian of a Python function refused it.
    with pytest.raises(TypeError, match=r"hessian: primal 1 \('x' of .*\) is a torch tensor"):
        pydiff.hessian(m.poly, (A, _t(X)))
    H = pydiff.hessian(m.poly, (A, pydiff.tensor(X, device=device)))
    x32 = X.astype(np.float32).astype(np.float64)
    want = np.zeros((4, 4))
    want[0, 1:] = want[1:, 0] = 3 * x32**2
    want[1:, 1:] = np.diag(6 * A * x32 - np.sin(x32))
    np.testing.assert_allclose(H, want, rtol=1e-4, atol=1e-5)


# --- seeds, booleans ---------------------------------------------------------------------


def test_torch_seed_that_requires_grad_is_named(device):
    # Before: torch's own "Can't call numpy() on Tensor that requires grad".
    t = _t([1.0, 1.0, 1.0], requires_grad=True)
    with pytest.raises(TypeError, match=r"vjp: cotangents: a torch tensor that requires grad"):
        pydiff.vjp(lambda x: x * x, (X,), t)
    with pytest.raises(TypeError, match=r"jvp: tangents\[0\]: a torch tensor that requires grad"):
        pydiff.jvp(lambda x: x * x, (X,), (t,))
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        y = x * x
    with pytest.raises(TypeError, match=r"tape.backward: grad: a torch tensor that requires"):
        tape.backward(y, grad=t)
    tape.backward(y, grad=t.detach())  # the values: the same as NumPy's
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)


def test_boolean_arrays_are_refused_as_differentiated_arguments(device):
    # docs/transforms.md: bools are refused as differentiated arguments. Before, a bool was
    # but an array or list of them was differentiated as 0/1 without a word.
    f = lambda x: ops.sum(ops.mul(x, x))  # noqa: E731
    for b in (np.array([True, False]), [True, False]):
        with pytest.raises(TypeError, match=r"argument 0 holds booleans"):
            pydiff.grad(f)(b)
    with pytest.raises(TypeError, match=r"jvp: primal 0 holds booleans"):
        pydiff.jvp(lambda x: x * x, (np.array([True, False]),), (np.ones(2),))
    with pytest.raises(TypeError, match=r"jacfwd: primal 0 holds booleans"):
        pydiff.jacfwd(lambda x: x * x)(np.array([True, False]))
    np.testing.assert_allclose(pydiff.grad(f)(np.array([1.0, 0.0])), [2.0, 0.0])


# --- torch interop ---------------------------------------------------------------------


def test_torch_negated_views_convert(device):
    # torch's lazy negation (t._neg_view(), conj().imag of a complex tensor): before,
    # from_torch and pydiff.tensor raised torch's "negative bit set" error.
    nv = torch._neg_view(_t(X))
    np.testing.assert_array_equal(pydiff.from_torch(nv, device=device).numpy(), -_t(X).numpy())
    np.testing.assert_array_equal(pydiff.tensor(nv, device=device).numpy(), -_t(X).numpy())
    imag = torch.tensor(X + 1j * U, dtype=torch.complex64).conj().imag
    np.testing.assert_allclose(pydiff.from_torch(imag, device=device).numpy(), -U)


def test_torch_noncontiguous_and_expanded_inputs_get_exact_gradients(m, device):
    # a transposed leaf and a stride-0 expanded one: torch's gradients match float64 torch
    base = torch.tensor(X, dtype=torch.float32, requires_grad=True)
    xt = torch.arange(6.0).reshape(2, 3).t().detach().requires_grad_(True)
    y = m.poly(A, base.expand(4, 3))
    z = m.poly(A, xt)
    (y.sum() + z.sum()).backward()
    b64 = base.detach().double()
    np.testing.assert_allclose(
        base.grad.numpy(), 4 * (3 * A * b64**2 + torch.cos(b64)).numpy(), rtol=1e-5
    )
    x64 = xt.detach().double()
    np.testing.assert_allclose(xt.grad.numpy(), (3 * A * x64**2 + torch.cos(x64)).numpy(), 1e-5)


# --- gradcheck, Function ------------------------------------------------------------------


def test_gradcheck_takes_one_tensor_as_inputs(m, device):
    # Before: gradcheck(m.sq, x) said "no input has requires_grad=True" (it iterated over
    # x's elements); torch.autograd.gradcheck takes a lone tensor too.
    x = pydiff.tensor([-0.8, 0.5], requires_grad=True, device=device)
    assert pydiff.gradcheck(m.sq, x)
    assert not pydiff.gradcheck(m.bsq, x, raise_exception=False)  # 3x where 2x is right
    with pytest.raises(TypeError, match=r"gradcheck: inputs must be a tuple"):
        pydiff.gradcheck(m.sq, 3.0)


class _Twice(pydiff.Function):
    result: object = None

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return _Twice.result


def test_function_backward_gradients_checked(device):
    x = pydiff.tensor([0.5, -1.5], requires_grad=True, device=device)

    def run(result):
        _Twice.result = result
        with pydiff.Tape() as tape:
            y = _Twice.apply(x)
        tape.backward(y, grad=np.ones(2))

    # Before: 1e39 became inf without a word (seeds refuse it); a torch tensor was "a Tensor".
    with pytest.raises(
        pydiff.GradientOverflowError, match=r"_Twice.backward\(\) gradient 0 .*1e\+39"
    ):
        run(np.array([1e39, 1.0]))
    with pytest.raises(TypeError, match=r"gradient 0 is a torch tensor.*from_torch"):
        run(torch.ones(2))
    run(np.array([3, 4]))  # integers are numbers
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 4.0])


# --- optimizers and threads (passing probes of real risks) ---------------------------------


@pytest.mark.parametrize(
    "kind, hp",
    [
        ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
        ("Adam", dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
        ("AdamW", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
    ],
)
def test_optimizers_follow_torch_optim_over_many_steps(device, kind, hp):
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((8, 5)).astype(np.float32)
    b_np = rng.standard_normal(8).astype(np.float32)
    w0 = (rng.standard_normal(5) * 0.5).astype(np.float32)
    w = pydiff.tensor(w0, requires_grad=True, device=device)
    a, b = pydiff.tensor(a_np, device=device), pydiff.tensor(b_np, device=device)
    opt = getattr(pydiff.optim, kind)([w], **hp)
    tw = torch.tensor(w0.astype(np.float64), requires_grad=True)
    topt = getattr(torch.optim, kind)([tw], **hp)
    at, bt = torch.tensor(a_np, dtype=torch.float64), torch.tensor(b_np, dtype=torch.float64)
    for _ in range(60):
        opt.zero_grad()
        with pydiff.Tape() as tape:
            r = ops.sum(a * w.reshape((1, 5)), axis=1) - b
            loss = ops.mean(ops.mul(r, r))
        tape.backward(loss)
        opt.step()
        topt.zero_grad()
        ((at @ tw - bt) ** 2).mean().backward()
        topt.step()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-5, atol=2e-6)


def test_transforms_in_threads_agree_with_closed_forms(m, device):
    bad, errors = [], []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(4):
                x = rng.standard_normal(5)
                g = pydiff.grad(lambda t: ops.sum(ops.tanh(t) * t))(x)
                if not np.allclose(g, np.tanh(x) + x / np.cosh(x) ** 2, rtol=1e-4, atol=1e-5):
                    bad.append(("grad", seed))
                xt = pydiff.tensor(x, device=device)
                _, t = pydiff.jvp(m.poly, (A, xt), (None, np.ones(5)))
                if not np.allclose(t.numpy(), 3 * A * x**2 + np.cos(x), rtol=1e-4, atol=1e-5):
                    bad.append(("jvp", seed))
                (hv,) = pydiff.hvp(lambda t: ops.sum(t * t * t), (xt,), (np.ones(5),))
                if not np.allclose(hv.numpy(), 6 * x, rtol=1e-4, atol=1e-5):
                    bad.append(("hvp", seed))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads)
    assert not errors and not bad, (errors, bad)


def test_module_vjp_hvp_hessian_take_one_host_array_for_an_array_parameter(device):
    # .fwds and jvp took [a0, a1, a2] for a float[3] parameter; vjp, hvp and hessian raised
    # "(float[3]) got a float tensor of shape (3,) ... after at least one call axis" (hvp
    # and hessian naming the generated wrapper).
    m = pydiff.load_module_from_source(
        "s41_brk41_arr",
        "[Differentiable] float arrs(float a[3], float s) { return s * a[0] * a[1] * a[2]; }",
        device=device,
    )
    a, s = np.array([1.0, 2.0, 3.0]), 2.0
    _, (ga, gs) = pydiff.vjp(m.arrs, (a, s), 1.0)
    np.testing.assert_allclose(ga, s * np.array([6.0, 3.0, 2.0]), rtol=1e-6)
    np.testing.assert_allclose(gs, 6.0, rtol=1e-6)
    ha, hs = pydiff.hvp(m.arrs, (a, s), (np.array([1.0, 0.0, 0.0]), 0.0))
    np.testing.assert_allclose(ha, s * np.array([0.0, 3.0, 2.0]), rtol=1e-6)
    np.testing.assert_allclose(hs, 6.0, rtol=1e-6)
    want = np.zeros((4, 4))
    want[:3, :3] = s * np.array([[0, 3, 2], [3, 0, 1], [2, 1, 0]])
    want[3, :3] = want[:3, 3] = [6.0, 3.0, 2.0]
    np.testing.assert_allclose(pydiff.hessian(m.arrs, (a, s)), want, rtol=1e-6)


def test_optimizer_params_of_other_kinds_say_what_to_do(device):
    # Before: "params[0] is a Tensor, not a pydiff.Tensor" (torch's), "is a dict" (torch's
    # parameter groups), and a half or float3 parameter "must be a float tensor with
    # requires_grad=True" although it had requires_grad.
    with pytest.raises(TypeError, match=r"params\[0\] is a torch tensor.*torch\.optim"):
        pydiff.optim.Adam([torch.ones(2, requires_grad=True)], lr=0.1)
    with pytest.raises(TypeError, match=r"parameter groups \(dicts\) are not supported"):
        pydiff.optim.SGD([{"params": [pydiff.zeros((2,), device=device)]}], lr=0.1)
    h = pydiff.tensor(np.ones(3, np.float16), dtype="half", requires_grad=True, device=device)
    with pytest.raises(ValueError, match=r"params\[0\] has dtype 'half'"):
        pydiff.optim.AdamW([h], lr=0.1)


def test_module_vjp_hvp_hessian_hold_a_double_parameter_fixed(device):
    # Before: vjp and hvp made a float tensor for it and SlangPy refused it ("got a tensor of
    # dtype float, which SlangPy does not convert to double", hvp naming the generated
    # wrapper); jvp and gradcheck already held it fixed. Double values have no gradient
    # buffers: held fixed (None), a direction for one refused by name.
    m = pydiff.load_module_from_source(
        "s41_brk41_dbl",
        "[Differentiable] float dd(double d, float x) { return float(d) * x * x * x; }",
        device=device,
    )
    _, (gd, gx) = pydiff.vjp(m.dd, (2.0, X), np.ones(3))
    assert gd is None
    np.testing.assert_allclose(gx, 6 * X**2, rtol=1e-5)
    hd, hx = pydiff.hvp(m.dd, (2.0, X), (None, np.ones(3)))
    assert hd is None
    np.testing.assert_allclose(hx, 12 * X, rtol=1e-5)
    np.testing.assert_allclose(pydiff.hessian(m.dd, (2.0, X)), np.diag(12 * X), rtol=1e-5)
    with pytest.raises(ValueError, match=r"hvp: parameter 'd' \(double\) is double"):
        pydiff.hvp(m.dd, (2.0, X), (1.0, np.ones(3)))


def test_module_vjp_of_a_void_function_differentiates_what_it_writes(device):
    # Before: "vjp: fn returned a NoneType", while jvp returns the tensors it writes.
    m = pydiff.load_module_from_source(
        "s41_brk41_void",
        """
[Differentiable] void wr2(float a, float x, out float y, out float z) { y = a * x * x; z = sin(x); }
[Differentiable] void io(float a, inout float y) { y = a * y * y; }
""",
        device=device,
    )
    y, z = pydiff.zeros((3,), device=device), pydiff.zeros((3,), device=device)
    (oy, oz), (ga, gx, gy, gz) = pydiff.vjp(m.wr2, (A, X, y, z), (np.ones(3), U))
    np.testing.assert_allclose(oy.numpy(), A * X**2, rtol=1e-6)
    np.testing.assert_allclose(ga, np.sum(X**2), rtol=1e-5)
    np.testing.assert_allclose(gx, 2 * A * X + np.cos(X) * U, rtol=1e-5)
    assert gy is None and gz is None
    with pytest.raises(TypeError, match=r"vjp: .*io returns void and writes 'y' \(inout\)"):
        pydiff.vjp(m.io, (A, pydiff.tensor(X, device=device)), np.ones(3))


def test_differentiated_host_values_that_are_not_real_numbers_are_refused(device):
    # Before: a complex array lost its imaginary part (grad of sum(z*z) at [1+2j] gave [2.],
    # a ComplexWarning only), None in an object array became NaN, a Python int beyond
    # float64 raised a bare OverflowError, a ragged list NumPy's message naming nothing.
    f = lambda x: ops.sum(ops.mul(x, x))  # noqa: E731
    with pytest.raises(TypeError, match=r"argument 0 holds complex numbers"):
        pydiff.grad(f)(np.array([1 + 2j]))
    with pytest.raises(TypeError, match=r"jvp: primal 0 holds complex numbers"):
        pydiff.jvp(lambda x: x * x, (np.array([1 + 2j]),), (np.ones(1),))
    with pytest.raises(TypeError, match=r"argument 0 holds None"):
        pydiff.grad(f)(np.array([1.5, None]))
    with pytest.raises(ValueError, match=r"argument 0 holds an integer beyond"):
        pydiff.grad(f)(10**400)
    with pytest.raises(TypeError, match=r"argument 0: cannot be made an array: nested lists"):
        pydiff.grad(f)([[1.0, 2.0], [3.0]])
    np.testing.assert_allclose(pydiff.grad(f)(np.array([1.5, 2], dtype=object)), [3.0, 4.0])


def test_torch_result_of_a_call_with_torch_tensors_is_refused(m, device):
    # Before: _result=buf (a torch tensor) returned a new tensor and left buf zero without a
    # word; _result="numpy" said "<pydiff.ShaderFunction ...> ... returned ndarray".
    buf = torch.zeros(3)
    with pytest.raises(TypeError, match=r"poly: _result=a torch tensor in a call with torch"):
        m.poly(A, _t(X), _result=buf)
    with pytest.raises(TypeError, match=r"poly: _result='numpy' in a call with torch"):
        m.poly(A, _t(X, requires_grad=True), _result="numpy")
    assert torch.equal(buf, torch.zeros(3))
    y = m.poly(A, _t(X), _result="tensor")  # (the default) a torch tensor
    np.testing.assert_allclose(y.numpy(), A * X**3 + np.sin(X), rtol=1e-5, atol=1e-6)


def test_module_hvp_and_hessian_count_the_primals(m, device):
    # Before: hvp with a primal too many left it out without a word (4 results for 5
    # primals); hessian with one too few named the generated wrapper's "x, x__v".
    with pytest.raises(TypeError, match=r"hvp: .*poly takes 2 argument\(s\) \(a, x\); got 3"):
        pydiff.hvp(m.poly, (A, X, 5.0), (None, np.ones(3), None))
    with pytest.raises(TypeError, match=r"hessian: .*poly takes 2 argument\(s\) \(a, x\); got 1"):
        pydiff.hessian(m.poly, (A,))
