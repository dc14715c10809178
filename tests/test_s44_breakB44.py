"""breakB44: a new user's training steps against PyTorch float64 (issue 16, items 2-3).

Defects found and fixed here:
- a model split over two devices: the ops' mixed-device error told the user to copy with
  ``pydiff.tensor(t.numpy(), device=...)``, which on a tape silently gives every layer before
  the copy no gradient (the optimizer then skips them). ``Tensor.to(device)`` is a copy the
  tape differentiates (the gradient goes back to the source device), and the error names it.
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def second_device(tmp_path_factory):
    # Devices are cached per (type, include paths, cache folder): another include path is
    # another device.
    return pydiff.create_device("vulkan", include_paths=[str(tmp_path_factory.mktemp("dev2"))])


def _torch_mlp_step(tparams, topt, x, y):
    topt.zero_grad()
    w1, b1, w2, b2 = tparams
    h = torch.relu(torch.tensor(x, dtype=torch.float64) @ w1.T + b1)
    loss = torch.nn.functional.cross_entropy(h @ w2.T + b2, torch.tensor(y, dtype=torch.int64))
    loss.backward()
    topt.step()
    return loss.item()


def test_a_model_split_over_two_devices_trains_as_torch(second_device):
    d1, d2 = pydiff.default_device(), second_device
    assert d1 is not d2
    rng = np.random.default_rng(0)
    l1 = nn.Linear(8, 12, seed=0, activation="relu")
    l2 = nn.Linear(12, 3, seed=1, device=d2)
    params = l1.parameters() + l2.parameters()
    opt = optim.AdamW(params, lr=0.01, weight_decay=0.01)
    tparams = [torch.tensor(p.numpy(), dtype=torch.float64, requires_grad=True) for p in params]
    topt = torch.optim.AdamW(tparams, lr=0.01, weight_decay=0.01)
    for _ in range(12):
        x = rng.standard_normal((16, 8)).astype(np.float32)
        y = rng.integers(0, 3, 16).astype(np.int32)
        opt.zero_grad()
        with pydiff.Tape() as tape:
            h = l1(pydiff.tensor(x)).to(d2)  # the activations move to the head's device
            assert h.device is d2
            loss = ops.cross_entropy(l2(h), pydiff.tensor(y, device=d2))
        tape.backward(loss, retain_graph=False)
        assert l1.weight.grad.device is d1 and l2.weight.grad.device is d2
        opt.step()
        want = _torch_mlp_step(tparams, topt, x, y)
        assert abs(loss.item() - want) < 1e-5
    for p, t in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=0, atol=2e-6)


def test_to_device_gradient_and_identity(second_device):
    d2 = second_device
    xv = np.array([[0.5, -1.0, 2.0], [3.0, 0.25, -0.5]], np.float32)
    x = pydiff.tensor(xv, requires_grad=True)
    assert x.to(x.device) is x  # as torch: the same tensor on its own device
    with pydiff.Tape() as tape:
        y = x.to(d2)
        loss = ops.sum(ops.mul(y, y))
    tape.backward(loss)
    np.testing.assert_array_equal(y.numpy(), xv)
    np.testing.assert_allclose(x.grad.numpy(), 2 * xv, rtol=1e-6)
    # int labels and tensors off a tape: a plain copy, no gradient
    lab = pydiff.tensor(np.array([0, 2], np.int32)).to(d2)
    assert lab.device is d2 and lab.dtype == "int" and lab.numpy().tolist() == [0, 2]
    with pytest.raises(TypeError, match="device"):
        x.to(3)


def test_mixed_device_error_names_the_copy_that_keeps_the_gradient(second_device):
    a = pydiff.ones((3,))
    b = pydiff.ones((3,), device=second_device)
    with pytest.raises(ValueError) as err:
        ops.add(a, b)
    msg = str(err.value)
    assert ".to(device)" in msg
    assert "pydiff.tensor(t.numpy()" not in msg or "no gradient" in msg
