"""Gradients routed through another tensor's buffers: a tensor made by ``share_grads`` (the
tape's copy of an in-place argument) follows the zeroing policy and the current gradient
buffers of the tensor it shares, as a view follows its base; ``nn.Linear.zero_grad``
matches the optimizers'; ``fixed_point`` with overlapping or repeated parameters. References:
closed forms in float64, float64 NumPy solves of the fixed point and their central
differences, torch.optim."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

TIMES = "[Differentiable] float times(float a, float b) { return a * b; }"
A0 = np.array([0.5, -1.5, 2.0])
B0 = np.array([3.0, 0.25, -2.0])
STALE = 100.0


@pytest.fixture(scope="module")
def times(device):
    return pydiff.load_module_from_source("s28_viewfix_times", TIMES, device=device).times


def _f32(values, device, **kw):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, **kw)


def _stale_leaf(device, shape=(3,)):
    """A leaf holding A0 whose gradient buffer holds a stale STALE in every element."""
    x = _f32(A0.reshape(shape), device, requires_grad=True)
    x.grad.copy_from_numpy(np.full(shape, STALE, np.float32))
    return x


def _times_bwds(times, a, device):
    """d(a * b)/da = b = B0 (closed form), added under a's policy into a's gradient."""
    b = _f32(B0.reshape(a.shape), device)
    times.bwds(a, b, _result=pydiff.zeros(a.shape, device=device).with_grads(ones=True))


# --- share_grads: the policy and buffers of the tensor shared, not copies of them --------


def test_shared_grads_follow_the_policy_of_the_tensor_shared(times, device):
    x = _stale_leaf(device)
    x.zero_policy = "reset"
    before = x.copy_values()
    before.share_grads(x)
    assert before.zero_policy is pydiff.ZeroPolicy.RESET
    _times_bwds(times, before, device)
    # RESET: the stale gradient dropped, this backward's alone (no policy: STALE + B0)
    np.testing.assert_allclose(x.grad.numpy(), B0, rtol=1e-6)


def test_shared_grads_follow_a_policy_set_after_sharing(times, device):
    x = _f32(A0, device, requires_grad=True)
    before = x.copy_values()
    before.share_grads(x)
    x.zero_policy = "strict"
    _times_bwds(times, before, device)
    np.testing.assert_allclose(x.grad.numpy(), B0, rtol=1e-6)
    with pytest.raises(pydiff.StaleGradientError):
        _times_bwds(times, before, device)  # (no policy: a silent 2 * B0)
    np.testing.assert_allclose(x.grad.numpy(), B0, rtol=1e-6)
    before.zero_policy = None  # sets x's, as a view's does
    assert x.zero_policy is None


def test_shared_grads_of_a_view_follow_its_base(times, device):
    x = _stale_leaf(device)
    x.zero_policy = "reset"
    view = x.reshape((3, 1))
    before = view.copy_values()
    before.share_grads(view)
    assert before.zero_policy is pydiff.ZeroPolicy.RESET
    _times_bwds(times, before, device)
    np.testing.assert_allclose(x.grad.numpy(), B0, rtol=1e-6)


def test_shared_grads_follow_buffers_lent_after_sharing(times, device):
    # A transform lends a closure tensor a fresh buffer for its backward: what goes through
    # the copy must land there, and the tensor's own gradient stay as it was.
    x = _stale_leaf(device)
    before = x.copy_values()
    before.share_grads(x)
    give_back = x.lend_grads()
    try:
        _times_bwds(times, before, device)
        np.testing.assert_allclose(x.grad.numpy(), B0, rtol=1e-6)
    finally:
        give_back()
    np.testing.assert_array_equal(x.grad.numpy(), np.full(3, STALE))


def test_shared_grads_follow_buffers_attached_after_sharing(times, device):
    x = _f32(A0, device)
    before = x.copy_values()
    before.share_grads(x)
    assert not before.requires_grad
    x.requires_grad_(True)
    assert before.requires_grad and before.grad.storage is x.grad.storage
    _times_bwds(times, before, device)
    np.testing.assert_allclose(x.grad.numpy(), B0, rtol=1e-6)


def test_share_grads_refuses_another_shape(device):
    x = _f32(A0, device, requires_grad=True)
    other = _f32(np.zeros((3, 1)), device)
    with pytest.raises(ValueError, match=r"share_grads: .*\(3, 1\).*\(3,\)"):
        other.share_grads(x)


def test_in_place_call_on_a_tape_follows_the_policy_set_after_recording(device):
    # The tape's copy of an in-place argument (share_grads): the policy given to the
    # argument between the recording and the backward is the one its gradient gets.
    src = """
    import slangpy;
    [Differentiable]
    void sq_at(int i, IRWDiffTensor<float, 1> d) { float v = d[i]; d[i] = v * v; }
    """
    m = pydiff.load_module_from_source("s28_viewfix_sq_at", src, device=device)
    idx = pydiff.tensor(np.arange(3, dtype=np.int32), device=device)
    for policy, want in (("reset", 2 * A0), ("accumulate", 2 * A0 + STALE)):
        x = _stale_leaf(device)
        with pydiff.Tape() as tape:
            m.sq_at(idx, x)
        x.zero_policy = policy
        tape.backward(x, grad=np.ones(3))
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6)


# --- nn.Linear.zero_grad: the optimizers' zero_grad over the layer's parameters ----------


def _linear_backward(layer, x0, g, device):
    x = _f32(x0, device)
    with pydiff.Tape() as tape:
        y = layer(x)
    tape.backward(y, grad=g)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_zero_grad_leaves_the_next_backward_its_own_gradient(device, bias):
    rng = np.random.default_rng(0)
    x0 = rng.uniform(-1, 1, (5, 4)).astype(np.float32)
    g = rng.uniform(-1, 1, (5, 3))
    layer = pydiff.nn.Linear(4, 3, bias=bias, device=device, seed=0)
    _linear_backward(layer, x0, g, device)
    _linear_backward(layer, x0, g, device)  # accumulates: twice the gradient
    x64 = x0.astype(np.float64)
    np.testing.assert_allclose(layer.weight.grad.numpy(), 2 * g.T @ x64, rtol=1e-5, atol=1e-6)
    layer.zero_grad()
    np.testing.assert_array_equal(layer.weight.grad.numpy(), np.zeros((3, 4)))
    _linear_backward(layer, x0, g, device)
    # y = x W^T + b: dW = g^T x, db = sum of g over the batch (float64 closed forms)
    np.testing.assert_allclose(layer.weight.grad.numpy(), g.T @ x64, rtol=1e-5, atol=1e-6)
    if bias:
        np.testing.assert_allclose(layer.bias.grad.numpy(), g.sum(axis=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_linear_zero_grad_steps_as_torch_module_zero_grad(device, set_to_none):
    # After a step, zero_grad and a step with no backward between: torch skips every
    # parameter after set_to_none=True (grad None), and applies a zero gradient after False
    # (momentum and weight decay move the parameters, the step counts grow).
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x0 = rng.uniform(-1, 1, (6, 4)).astype(np.float32)
    g = rng.uniform(-1, 1, (6, 3))
    layer = pydiff.nn.Linear(4, 3, device=device, seed=1)
    ref = torch.nn.Linear(4, 3).double()
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(layer.weight.numpy().astype(np.float64)))
        ref.bias.copy_(torch.from_numpy(layer.bias.numpy().astype(np.float64)))
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    opt = pydiff.optim.SGD(layer.parameters(), **hyper)
    ref_opt = torch.optim.SGD(ref.parameters(), **hyper)

    _linear_backward(layer, x0, g, device)
    ref(torch.from_numpy(x0.astype(np.float64))).backward(torch.from_numpy(g))
    opt.step()
    ref_opt.step()
    after_first = layer.weight.numpy().copy()

    layer.zero_grad(set_to_none=set_to_none)
    ref.zero_grad(set_to_none=set_to_none)
    opt.step()
    ref_opt.step()
    for mine, theirs in ((layer.weight, ref.weight), (layer.bias, ref.bias)):
        np.testing.assert_allclose(mine.numpy(), theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
    moved = not np.array_equal(layer.weight.numpy(), after_first)
    assert moved is (not set_to_none)
    assert opt.param_steps == ([1, 1] if set_to_none else [2, 2])


def test_linear_zero_grad_default_and_refusal_are_the_optimizers(device):
    import inspect

    layer = pydiff.nn.Linear(2, 2, device=device, seed=0)
    mine = inspect.signature(pydiff.nn.Linear.zero_grad).parameters["set_to_none"].default
    theirs = inspect.signature(pydiff.optim.SGD.zero_grad).parameters["set_to_none"].default
    assert mine is theirs is True
    with pytest.raises(TypeError, match=r"Linear\.zero_grad: set_to_none='no'"):
        layer.zero_grad(set_to_none="no")
    opt = pydiff.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"SGD\.zero_grad: set_to_none=1"):
        opt.zero_grad(set_to_none=1)


# --- fixed_point: parameters that are one tensor, views of one, or read through f's closure


BASE = np.array([0.5, -0.3, 0.4, 0.8])
UPSTREAM = np.array([1.0, -2.0, 0.5])


def _solve64(w, u):
    """x* = w tanh(x*) + u in float64 (|w| < 1: a contraction), by iteration."""
    x = np.zeros(3)
    for _ in range(2000):
        x = w * np.tanh(x) + u
    return x


def _fd_gradient(coefficients, base):
    """float64 central differences of <UPSTREAM, x*(base)> with respect to base, where
    (w, u) = coefficients(base)."""
    out = np.zeros(base.size)
    for k in range(base.size):
        e = np.zeros(base.size)
        e[k] = 1e-6
        hi = UPSTREAM @ _solve64(*coefficients(base + e))
        lo = UPSTREAM @ _solve64(*coefficients(base - e))
        out[k] = (hi - lo) / 2e-6
    return out


def _overlapping_slices(device):
    base = _f32(BASE, device, requires_grad=True)
    with pydiff.Tape() as tape:
        w, u = base[0:3], base[1:4]  # overlapping at base[1:3]
        x = pydiff.fixed_point(lambda x, w, u: w * ops.tanh(x) + u, np.zeros(3), w, u, tol=1e-7)
    return base, tape, x, lambda b: (b[0:3], b[1:4])


def _one_tensor_twice_and_from_the_closure(device):
    a = _f32(BASE[:3], device, requires_grad=True)

    def f(x, p, q):  # p and q are a; a is read through the closure too
        return 0.25 * (p + q + a) * ops.tanh(x) + a

    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(f, np.zeros(3), a, a, tol=1e-7)
    return a, tape, x, lambda b: (0.75 * b, b)


def _two_views_of_one_base(device):
    base = _f32(BASE[:3], device, requires_grad=True)
    column, row = base.reshape((3, 1)), base.reshape((1, 3))

    def f(x, column, row):
        return 0.5 * column.reshape(3) * ops.tanh(x) + row.reshape(3) + base

    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(f, np.zeros(3), column, row, tol=1e-7)
    return base, tape, x, lambda b: (0.5 * b, 2 * b)


def _struct_holding_one_tensor_twice(device):
    a = _f32(BASE[:3], device, requires_grad=True)

    def f(x, s):
        return 0.5 * s["w"] * ops.tanh(x) + s["u"]

    with pydiff.Tape() as tape:
        x = pydiff.fixed_point(f, np.zeros(3), {"w": a, "u": a}, tol=1e-7)
    return a, tape, x, lambda b: (0.5 * b, b)


@pytest.mark.parametrize(
    "make",
    [
        _overlapping_slices,
        _one_tensor_twice_and_from_the_closure,
        _two_views_of_one_base,
        _struct_holding_one_tensor_twice,
    ],
)
def test_fixed_point_parameters_sharing_values_get_each_use_once(device, make):
    # Every use of the shared values is a separate share of dL/dbase, counted once each.
    base, tape, x, coefficients = make(device)
    tape.backward(x, grad=UPSTREAM)
    b64 = base.numpy().astype(np.float64).reshape(-1)
    np.testing.assert_allclose(x.numpy(), _solve64(*coefficients(b64)), rtol=1e-5, atol=1e-6)
    want = _fd_gradient(coefficients, b64)
    np.testing.assert_allclose(base.grad.numpy().reshape(-1), want, rtol=1e-4, atol=1e-6)


def test_fixed_point_overlapping_parameters_under_grad_and_jvp(device):
    b32 = BASE.astype(np.float32)
    b64 = b32.astype(np.float64)

    def solve(b):
        w, u = b[0:3], b[1:4]
        return pydiff.fixed_point(lambda x, w, u: w * ops.tanh(x) + u, np.zeros(3), w, u, tol=1e-7)

    def coefficients(b):
        return b[0:3], b[1:4]

    upstream = _f32(UPSTREAM, device)
    g = pydiff.grad(lambda b: ops.sum(solve(b) * upstream))(_f32(b32, device))
    np.testing.assert_allclose(np.asarray(g), _fd_gradient(coefficients, b64), rtol=1e-4, atol=1e-6)
    d = np.array([0.3, -1.0, 0.7, 0.2])
    _, tangent = pydiff.jvp(solve, (_f32(b32, device),), (d,))
    e = 1e-6
    hi, lo = _solve64(*coefficients(b64 + e * d)), _solve64(*coefficients(b64 - e * d))
    np.testing.assert_allclose(tangent.numpy(), (hi - lo) / (2 * e), rtol=1e-4, atol=1e-6)
