"""A torch_function whose only tensor needing a gradient is a pydiff tensor it closes over
(no argument requires one): torch recorded no node for the call, so the closed-over
tensor's gradient was lost (an error when nothing else required a gradient, silently beside
another path). References: the same model in float64 torch."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")

A0 = np.array([0.5, -1.0, 2.0, 0.25])
W0 = np.array([1.5, 2.0, -3.0, 0.5])


def test_closed_over_parameter_gets_its_gradient_beside_a_torch_path(device):
    w = pydiff.tensor(W0.astype(np.float32), requires_grad=True, device=device)
    p = torch.tensor(W0.astype(np.float32), requires_grad=True)
    a = torch.tensor(A0.astype(np.float32))  # data: no gradient wanted
    f = pydiff.torch_function(lambda t: ops.mul(ops.mul(t, w), w))
    (f(a).sum() + (p * a).sum()).backward()
    # float64 torch: d/dw sum(a w^2) = 2 a w, d/dp sum(p a) = a
    w64 = torch.tensor(W0, requires_grad=True)
    (torch.tensor(A0) * w64 * w64).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), w64.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(p.grad.numpy(), A0, rtol=1e-6)


def test_outputs_nothing_differentiable_reaches_need_no_gradient(device):
    w = pydiff.tensor(W0.astype(np.float32), requires_grad=True, device=device)
    fixed = pydiff.tensor(W0.astype(np.float32), device=device)
    a = torch.tensor(A0.astype(np.float32))
    both = pydiff.torch_function(lambda t: [ops.mul(t, w), ops.mul(t, fixed)])
    u, v = both(a)
    assert u.requires_grad and not v.requires_grad
    np.testing.assert_allclose(v.numpy(), (A0 * W0).astype(np.float32), rtol=1e-6)
    with torch.no_grad():
        assert not both(a)[0].requires_grad
