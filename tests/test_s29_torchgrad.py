"""torch.autograd.grad and backward(inputs=...) through pydiff calls write no pydiff tensor's
.grad, as torch writes no .grad but its named tensors'; backward() without inputs= still adds
into them under every zeroing policy. References: the same model in torch float64. Skipped
without torch (an optional extra)."""

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")

POLICIES = ["accumulate", "reset", "strict"]
RNG = np.random.default_rng(2929)
X0 = RNG.standard_normal((5, 3)).astype(np.float32)
W0 = RNG.standard_normal((2, 3)).astype(np.float32)
TOL = dict(rtol=1e-4, atol=1e-5)


def _model(x, w):
    return ops.tanh(ops.linear(x, w))


def _reference():
    """(d sum(out)/dx, d sum(out**2)/dx, d sum(out**2)/dW) in float64 torch."""
    x = torch.tensor(X0, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(W0, dtype=torch.float64, requires_grad=True)
    out = torch.tanh(x @ w.T)
    (saliency,) = torch.autograd.grad(out.sum(), [x], retain_graph=True)
    gx, gw = torch.autograd.grad((out**2).sum(), [x, w])
    return saliency.numpy(), gx.numpy(), gw.numpy()


def _setup(device):
    w = pydiff.tensor(W0, device=device, requires_grad=True)
    x = torch.tensor(X0, requires_grad=True)
    return x, w


@pytest.mark.parametrize("policy", POLICIES)
def test_autograd_grad_leaves_pydiff_grad_then_backward_is_right(device, policy):
    saliency_ref, _, gw_ref = _reference()
    x, w = _setup(device)
    with pydiff.zero_policy(policy):
        out = _model(x, w)
        (saliency,) = torch.autograd.grad(out.sum(), [x], retain_graph=True)
        np.testing.assert_array_equal(w.grad.numpy(), 0.0)
        assert x.grad is None
        np.testing.assert_allclose(saliency.numpy(), saliency_ref, **TOL)
        (out**2).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), gw_ref, **TOL)


@pytest.mark.parametrize("policy", POLICIES)
def test_autograd_grad_after_a_backward_keeps_its_result(device, policy):
    """The gradient of an earlier backward() stays as it was (STRICT: no stale refusal)."""
    saliency_ref, _, gw_ref = _reference()
    x, w = _setup(device)
    with pydiff.zero_policy(policy):
        out = _model(x, w)
        (out**2).sum().backward(retain_graph=True)
        (saliency,) = torch.autograd.grad(out.sum(), [x])
    np.testing.assert_allclose(w.grad.numpy(), gw_ref, **TOL)
    np.testing.assert_allclose(saliency.numpy(), saliency_ref, **TOL)


@pytest.mark.parametrize("policy", POLICIES)
def test_backward_with_inputs_writes_the_named_tensors_only(device, policy):
    _, gx_ref, _ = _reference()
    x, w = _setup(device)
    with pydiff.zero_policy(policy):
        (_model(x, w) ** 2).sum().backward(inputs=[x])
    np.testing.assert_array_equal(w.grad.numpy(), 0.0)
    np.testing.assert_allclose(x.grad.numpy(), gx_ref, **TOL)


@pytest.mark.parametrize("policy", POLICIES)
def test_plain_backward_still_writes_pydiff_leaves(device, policy):
    _, gx_ref, gw_ref = _reference()
    x, w = _setup(device)
    with pydiff.zero_policy(policy):
        (_model(x, w) ** 2).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), gw_ref, **TOL)
    np.testing.assert_allclose(x.grad.numpy(), gx_ref, **TOL)


@pytest.mark.parametrize("policy", ["accumulate", "reset"])
def test_retained_graph_backward_grad_backward(device, policy):
    """backward, autograd.grad, backward over one kept graph: the middle pass adds nothing."""
    _, _, gw_ref = _reference()
    x, w = _setup(device)
    with pydiff.zero_policy(policy):
        loss = (_model(x, w) ** 2).sum()
        loss.backward(retain_graph=True)
        torch.autograd.grad(loss, [x], retain_graph=True)
        loss.backward()
    times = 2 if policy == "accumulate" else 1
    np.testing.assert_allclose(w.grad.numpy(), times * gw_ref, **TOL)


def test_create_graph_is_refused_and_changes_nothing(device):
    x, w = _setup(device)
    out = _model(x, w)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(out.sum(), [x], create_graph=True)
    np.testing.assert_array_equal(w.grad.numpy(), 0.0)


def test_closed_over_parameter_and_shared_weights(device):
    """A pydiff parameter closed over by a torch_function and also given to a second call."""
    w = pydiff.tensor(W0, device=device, requires_grad=True)
    x = torch.tensor(X0, requires_grad=True)
    layer = pydiff.torch_function(lambda a: ops.tanh(ops.linear(a, w)))
    out = layer(x) + _model(x, w)
    (gx,) = torch.autograd.grad((out**2).sum(), [x], retain_graph=True)
    np.testing.assert_array_equal(w.grad.numpy(), 0.0)

    x64 = torch.tensor(X0, dtype=torch.float64, requires_grad=True)
    w64 = torch.tensor(W0, dtype=torch.float64, requires_grad=True)
    ref = (2 * torch.tanh(x64 @ w64.T)) ** 2
    gx_ref, gw_ref = torch.autograd.grad(ref.sum(), [x64, w64])
    np.testing.assert_allclose(gx.numpy(), gx_ref.numpy(), **TOL)
    (out**2).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), gw_ref.numpy(), **TOL)


def test_mixed_with_a_torch_parameter(device):
    """autograd.grad for a torch parameter alone: neither x nor the pydiff weight is written."""
    w = pydiff.tensor(W0, device=device, requires_grad=True)
    v = torch.ones(2, requires_grad=True)
    x = torch.tensor(X0, requires_grad=True)
    out = (_model(x, w) * v).sum()
    (gv,) = torch.autograd.grad(out, [v])
    w64 = torch.tensor(W0, dtype=torch.float64)
    want = torch.tanh(torch.tensor(X0, dtype=torch.float64) @ w64.T).sum(0)
    np.testing.assert_allclose(gv.numpy(), want.numpy(), **TOL)
    np.testing.assert_array_equal(w.grad.numpy(), 0.0)
    assert x.grad is None and v.grad is None


def test_torch_that_cannot_tell_keeps_the_old_behaviour_and_warns(device, monkeypatch):
    from pydiff import errors, torch_passes

    monkeypatch.setattr(torch_passes, "_WILL_EXECUTE", "_no_such_function_in_torch")
    monkeypatch.setattr(errors, "_warned", set())  # once per process: here once per device
    saliency_ref, _, _ = _reference()
    x, w = _setup(device)
    with pytest.warns(pydiff.GradientFlowWarning, match="autograd.grad"):
        (saliency,) = torch.autograd.grad(_model(x, w).sum(), [x])
    np.testing.assert_allclose(saliency.numpy(), saliency_ref, **TOL)
    assert np.abs(w.grad.numpy()).max() > 0  # added into, as before
