"""Optimizers and the all-reduce, against torch.optim and torch's DDP rules:

- hyper-parameters given as 0-d (or one-element) pydiff/torch tensors and NumPy scalars are
  taken, their value read once as a float; NaN, negatives and other sizes are still refused;
- ``load_state_dict`` refuses what this optimizer could not have saved (other counts, keys,
  step counts, part of the buffers) and leaves the optimizer as it was;
- ``zero_grad(set_to_none=False)`` steps a parameter that had a gradient with a zero one,
  as torch does (float64 torch.optim over several steps);
- ``all_reduce_grads`` leaves a gradient no rank wrote unwritten (its parameter skipped, as
  DDP leaves it None), in a group of one and in two gloo ranks.

The two-rank workers are this file run as a script (tests/ranks.py)."""

from __future__ import annotations


import numpy as np
import pytest

import pydiff
from pydiff import optim


X0 = np.array([1.0, -2.0, 0.5, 3.0, -1.5], np.float32)


# --- 0-d tensors and NumPy scalars as hyper-parameters ----------------------------------


def test_tensor_and_numpy_scalar_hyper_parameters_are_taken_as_floats(device):
    torch = pytest.importorskip("torch")
    p = pydiff.tensor(X0, device=device, requires_grad=True)
    lr = pydiff.tensor(np.float32(0.25), device=device)  # 0-d, as torch.optim takes
    opt = optim.SGD([p], lr=lr, momentum=np.float64(0.5), weight_decay=np.array(0.1))
    assert opt.defaults == {"lr": 0.25, "momentum": 0.5, "weight_decay": 0.1}
    assert all(type(v) is float for v in opt.defaults.values())
    lr.copy_from_numpy(np.float32(9.0))  # read once, when given: the optimizer keeps 0.25
    assert opt.defaults["lr"] == 0.25
    for value, want in [
        (pydiff.tensor(np.array([0.125], np.float32), device=device), 0.125),  # one element
        (pydiff.tensor(np.array([[0.5]], np.float32), device=device), 0.5),
        (torch.tensor(0.375, dtype=torch.float64), 0.375),
        (torch.tensor([0.0625], requires_grad=True), 0.0625),
        (np.float16(0.5), 0.5),
        (np.array(0.75), 0.75),
        (pydiff.tensor(np.array(2, np.int32), dtype="int", device=device), 2.0),
    ]:
        opt.defaults["lr"] = value
        assert opt.defaults["lr"] == want and type(opt.defaults["lr"]) is float
    adam = optim.Adam(
        [p],
        lr=pydiff.tensor(np.float32(0.5), device=device),
        betas=(pydiff.tensor(np.float32(0.5), device=device), np.float64(0.75)),
        eps=np.array(1e-6),
        weight_decay=torch.tensor(0.0),
    )
    assert adam.defaults == {"lr": 0.5, "betas": (0.5, 0.75), "eps": 1e-6, "weight_decay": 0.0}
    adam.defaults["betas"] = pydiff.tensor(np.array([0.25, 0.5], np.float32), device=device)
    assert adam.defaults["betas"] == (0.25, 0.5)
    adam.defaults["betas"] = torch.tensor([0.5, 0.75])  # torch.optim takes this too
    assert adam.defaults["betas"] == (0.5, 0.75)


def test_tensor_hyper_parameters_step_as_torchs(device):
    """Steps with tensor hyper-parameters are the steps torch takes with tensor ones."""
    torch = pytest.importorskip("torch")
    grads = [np.random.default_rng(k).standard_normal(X0.shape) for k in range(4)]
    p = pydiff.tensor(X0, device=device, requires_grad=True)
    q = pydiff.tensor(X0, device=device, requires_grad=True)
    sgd = optim.SGD([p], lr=pydiff.tensor(np.float32(0.125), device=device), momentum=0.5)
    adam = optim.Adam(
        [q], lr=pydiff.tensor(np.array([0.0625], np.float32), device=device), betas=(0.5, 0.75)
    )
    tp, tq = (torch.tensor(X0.astype(np.float64)) for _ in range(2))
    tsgd = torch.optim.SGD([tp], lr=torch.tensor(0.125, dtype=torch.float64), momentum=0.5)
    tadam = torch.optim.Adam(
        [tq], lr=torch.tensor([0.0625], dtype=torch.float64), betas=(0.5, 0.75)
    )
    for g in grads:
        for t in (p, q):
            t.grad.copy_from_numpy(g.astype(np.float32))
        sgd.step()
        adam.step()
        tp.grad, tq.grad = torch.tensor(g), torch.tensor(g)
        tsgd.step()
        tadam.step()
    np.testing.assert_allclose(p.numpy(), tp.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(q.numpy(), tq.numpy(), rtol=1e-5, atol=1e-6)


def test_bad_tensor_hyper_parameters_are_refused(device):
    p = pydiff.tensor(X0, device=device, requires_grad=True)

    def t(values, dtype="float"):
        return pydiff.tensor(np.array(values), dtype=dtype, device=device)

    cases = [
        ("lr", t(np.float32("nan")), ValueError, "lr=.*finite number >= 0"),
        ("lr", t(np.float32(-0.5)), ValueError, "lr=.*>= 0"),  # torch refuses it too
        ("lr", t([0.1, 0.2]), TypeError, r"lr=.*shape \(2,\).*one element"),
        ("lr", t([[0.1, 0.2]]), TypeError, r"lr=.*shape \(1, 2\)"),
        ("lr", np.array([0.25]), TypeError, r"lr=.*ndarray of shape \(1,\)"),
        ("lr", t([True], "bool"), TypeError, "lr=.*bool values"),
        ("lr", np.array("0.1"), TypeError, "lr=.*<U3 values"),
        ("weight_decay", t(np.float32(-1)), ValueError, "weight_decay="),
        ("eps", t(np.float32("inf")), ValueError, "eps="),
        ("betas", (t(np.float32(1.0)), 0.5), ValueError, r"betas=.*\[0, 1\)"),
        ("betas", t([0.5, 0.6, 0.7]), ValueError, "betas="),
        ("betas", t(np.float32(0.5)), TypeError, "betas="),
    ]
    for key, value, error, match in cases:
        opt = optim.Adam([p], lr=0.1)
        before = dict(opt.defaults)
        with pytest.raises(error, match=rf"Adam.defaults: {match}"):
            opt.defaults[key] = value
        with pytest.raises(error, match=rf"Adam: {match}"):
            optim.Adam([p], **{"lr": 0.1, key: value})
        assert dict(opt.defaults) == before
