"""Zeroing policies inside torch autograd: a pydiff parameter used by several pydiff calls of
one torch graph gets the sum of their gradients under every policy, the policy acting once
per torch backward pass (RESET: the pass replaces the earlier result; STRICT: a second
pass refused until zeroed). References: the same model in torch float64. Skipped without
torch (an optional extra)."""

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops

torch = pytest.importorskip("torch")
F = torch.nn.functional

POLICIES = ["accumulate", "reset", "strict"]
RNG = np.random.default_rng(29)
W0 = RNG.standard_normal((2, 3)).astype(np.float32)
B0 = RNG.standard_normal(2).astype(np.float32)
XS = [torch.tensor(RNG.standard_normal((4, 3)), dtype=torch.float32) for _ in range(3)]


def _layer(device):
    layer = nn.Linear(3, 2, device=device)
    layer.weight.copy_from_numpy(W0)
    layer.bias.copy_from_numpy(B0)
    return layer


def _model(linear, uses):
    """A siamese-style loss using ``linear`` ``uses`` times (2: the two uses of b cancel)."""
    out = linear(XS[0]) - linear(XS[1])
    if uses == 3:
        out = out * linear(XS[2])
    return (out**2).sum()


def _reference(uses):
    w = torch.tensor(W0, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(B0, dtype=torch.float64, requires_grad=True)
    _model(lambda x: F.linear(x.double(), w, b), uses).backward()
    return w.grad.numpy(), b.grad.numpy()


def _grads(layer):
    return layer.weight.grad.numpy(), layer.bias.grad.numpy()


def _close(got, want):
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("uses", [2, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_parameter_used_several_times_in_one_backward(device, policy, uses):
    layer = _layer(device)
    with pydiff.zero_policy(policy):
        _model(layer, uses).backward()
    _close(_grads(layer), _reference(uses))


@pytest.mark.parametrize("policy", POLICIES)
def test_global_policy_and_elementwise_ops(device, policy):
    pydiff.set_zero_policy(policy)
    w = pydiff.tensor([2.0, 3.0], device=device, requires_grad=True)
    x1, x2 = torch.tensor([1.0, 10.0]), torch.tensor([100.0, 1000.0])
    (ops.mul(x1, w).sum() + ops.mul(x2, w).sum()).backward()
    np.testing.assert_array_equal(w.grad.numpy(), (x1 + x2).numpy())


@pytest.mark.parametrize("policy", POLICIES)
def test_tensor_policy_without_a_global_one(device, policy):
    layer = _layer(device)
    for p in layer.parameters():
        p.zero_policy = pydiff.ZeroPolicy.parse(policy)
    _model(layer, 3).backward()
    _close(_grads(layer), _reference(3))


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_two_backward_passes(device, policy, retain):
    """Two passes: over two graphs, or one graph kept with retain_graph=True."""
    layer = _layer(device)
    with pydiff.zero_policy(policy):
        loss = _model(layer, 2)
        loss.backward(retain_graph=retain)
        second = loss if retain else _model(layer, 2)
        if policy == "strict":
            with pytest.raises(pydiff.StaleGradientError, match="zero_grad"):
                second.backward(retain_graph=True)  # (a raising pass frees the graph too)
            layer.zero_grad()
            second.backward()
        else:
            second.backward()
    want = _reference(2)
    times = 2 if policy == "accumulate" else 1  # RESET: the second pass replaces the first
    _close(_grads(layer), [times * r for r in want])


class _Square(pydiff.Function):
    """w * w with a hand-written backward (no tape inside)."""

    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return ops.mul(w, w)

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return ops.mul(ops.mul(w, g), 2.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_tape_function_custom_function_and_ops_in_one_graph(device, policy):
    w = pydiff.tensor([0.5, -1.5, 2.0], device=device, requires_grad=True)
    x = torch.tensor([1.0, 2.0, -3.0], requires_grad=True)
    composed = pydiff.torch_function(lambda a, v: ops.mul(ops.tanh(a), v))  # tape-based
    square = pydiff.torch_function(_Square.apply)
    with pydiff.zero_policy(policy):
        loss = (composed(x, w) * ops.mul(x, w)).sum() + square(w).sum()
        loss.backward()
    wt = torch.tensor([0.5, -1.5, 2.0], dtype=torch.float64, requires_grad=True)
    xt = x.detach().double().requires_grad_()
    ((torch.tanh(xt) * wt * (xt * wt)).sum() + (wt * wt).sum()).backward()
    np.testing.assert_allclose(w.grad.numpy(), wt.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_autograd_grad_of_a_torch_input_is_one_pass(device, policy):
    """torch.autograd.grad through two uses of a pydiff parameter: the torch input's
    gradient is right and STRICT does not refuse the pass's second use as stale."""
    layer = _layer(device)
    x = XS[0].clone().requires_grad_()
    with pydiff.zero_policy(policy):
        (gx,) = torch.autograd.grad(((layer(x) - layer(x * 2.0)) ** 2).sum(), [x])
    w = torch.tensor(W0, dtype=torch.float64)
    b = torch.tensor(B0, dtype=torch.float64)
    xt = x.detach().double().requires_grad_()
    ((F.linear(xt, w, b) - F.linear(xt * 2.0, w, b)) ** 2).sum().backward()
    np.testing.assert_allclose(gx.numpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-4)
