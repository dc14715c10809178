"""The eager training step's host shortcuts (twenty-first session), each against an
independent float64 reference:

- AdamW's four-parameter kernel reuses its binding lists while a step binds the very buffers
  of the last one: a parameter whose gradient buffer (or whose state) is replaced between
  steps must be bound anew, or the step would update from the old buffer;
- ``fast_product`` passes its bindings apart (``dispatch_split``);
- ``tape.backward``'s default seed of a one-element output is copied on the device from a
  per-device 1.0 buffer, except under a capture (a recorded upload) and for outputs that are
  not plain floats.
"""

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.01


def _adamw64(p, grads):
    """AdamW's rule in float64, one gradient per step."""
    p, m, v = p.astype(np.float64), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        p = p * (1 - LR * WD)
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g**2
        p = p - LR * (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
    return p


def test_adamw_binds_a_replaced_gradient_buffer(device):
    rng = np.random.default_rng(0)
    shapes = [(64, 64), (64,), (10, 64), (10,)]
    p0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(4)]
    params = [pydiff.tensor(a, device=device, requires_grad=True) for a in p0]
    opt = optim.AdamW(params, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    for step, gs in enumerate(grads):
        if step == 2:  # new gradient buffers for two of the four parameters
            for p in (params[1], params[3]):
                p.requires_grad_(False)
                p.requires_grad_(True)
        for p, g in zip(params, gs):
            p.grad.copy_from_numpy(g)
        opt.step()
    for k, p in enumerate(params):
        want = _adamw64(p0[k], [gs[k] for gs in grads])
        np.testing.assert_allclose(p.numpy(), want, rtol=2e-5, atol=2e-6)


def test_adamw_binds_replaced_parameters_of_a_site(device):
    """Two optimizers' four-parameter sites are their own; one optimizer's site sees its
    parameter set change size (three, then the same site with others)."""
    rng = np.random.default_rng(1)
    a0 = [rng.standard_normal(8).astype(np.float32) for _ in range(3)]
    ga = [rng.standard_normal(8).astype(np.float32) for _ in range(3)]
    pa = [pydiff.tensor(a, device=device, requires_grad=True) for a in a0]
    pb = [pydiff.tensor(a * 2, device=device, requires_grad=True) for a in a0]
    opt_a = optim.AdamW(pa, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    opt_b = optim.AdamW(pb, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    for _ in range(3):
        for p, q, g in zip(pa, pb, ga):
            p.grad.copy_from_numpy(g)
            q.grad.copy_from_numpy(-g)
        opt_a.step()
        opt_b.step()
    for k in range(3):
        np.testing.assert_allclose(pa[k].numpy(), _adamw64(a0[k], [ga[k]] * 3), rtol=2e-5)
        np.testing.assert_allclose(pb[k].numpy(), _adamw64(a0[k] * 2, [-ga[k]] * 3), rtol=2e-5)


def _mlp64(X, Y, W1, b1, W2, b2):
    """Loss and gradients of mean cross-entropy(relu(X W1^T + b1) W2^T + b2) in float64."""
    X, W1, b1, W2, b2 = (a.astype(np.float64) for a in (X, W1, b1, W2, b2))
    h = np.maximum(X @ W1.T + b1, 0)
    z = h @ W2.T + b2
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = -np.log(p[np.arange(len(Y)), Y]).mean()
    dz = (p - np.eye(z.shape[1])[Y]) / len(Y)
    dh = (dz @ W2) * (h > 0)
    return loss, (dh.T @ X, dh.sum(0), dz.T @ h, dz.sum(0))


def test_mlp_step_gradients_and_update_match_float64(device):
    """The benchmark's eager step, written as users write it: every gradient (the default
    seed copied on the device) and the AdamW update against float64 NumPy, over steps."""
    rng = np.random.default_rng(2)
    X = rng.standard_normal((256, 64)).astype(np.float32)
    Y = rng.integers(0, 10, 256)
    xb, yb = pydiff.tensor(X, device=device), pydiff.tensor(Y.astype(np.int32), device=device)
    layers = [nn.Linear(64, 64, seed=0, activation="relu"), nn.Linear(64, 10, seed=1)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = optim.AdamW(params, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    ref = [p.numpy().astype(np.float64) for p in params]
    history = []
    for _ in range(3):
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss, retain_graph=False)
        want_loss, want = _mlp64(X, Y, *[p.numpy() for p in params])
        np.testing.assert_allclose(float(loss.numpy().reshape(-1)[0]), want_loss, rtol=1e-5)
        for p, g in zip(params, want):
            np.testing.assert_allclose(p.grad.numpy(), g, rtol=1e-4, atol=1e-6)
        history.append([p.grad.numpy() for p in params])
        opt.step()
    for k, p in enumerate(params):
        np.testing.assert_allclose(
            p.numpy(), _adamw64(ref[k], [h[k] for h in history]), rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize("shape", [(), (1,)])
def test_default_seed_is_one_each_backward(device, shape):
    x0 = np.array([0.5, -2.0, 3.0], np.float32)
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    for k in range(3):  # the seed's buffer is reused: each backward seeds 1 again
        with pydiff.Tape() as tape:
            s = ops.sum(ops.mul(x, x))
            s = s.reshape(shape)
        tape.backward(s)
        np.testing.assert_allclose(x.grad.numpy(), 2 * x0 * (k + 1), rtol=1e-6)
        np.testing.assert_allclose(s.grad.numpy().reshape(-1), [1.0])


def test_given_seed_still_uploaded(device):
    x0 = np.array([1.5, -1.0], np.float32)
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        s = ops.sum(ops.mul(x, x))
    tape.backward(s, grad=np.array([-3.0]))
    np.testing.assert_allclose(x.grad.numpy(), -6 * x0, rtol=1e-6)
    with pydiff.Tape() as tape:
        s = ops.sum(ops.mul(x, x))
    with pytest.raises(ValueError, match="grad has shape"):
        tape.backward(s, grad=np.ones(2))


def test_default_seed_in_a_capture_replays(device):
    """Under a capture the seed stays a recorded upload: every replay seeds 1."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((16, 8)).astype(np.float32)
    Y = rng.integers(0, 4, 16)
    xb, yb = pydiff.tensor(X, device=device), pydiff.tensor(Y.astype(np.int32), device=device)
    layers = [nn.Linear(8, 8, seed=0, activation="relu"), nn.Linear(8, 4, seed=1)]
    params = [p for layer in layers for p in layer.parameters()]

    def step():
        for p in params:
            p.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss, retain_graph=False)

    step()
    captured = pydiff.capture(step)
    for p in params:
        p.grad.copy_from_numpy(np.full(p.shape, 7.0, np.float32))
    captured.replay()
    _, want = _mlp64(X, Y, *[p.numpy() for p in params])
    for p, g in zip(params, want):
        np.testing.assert_allclose(p.grad.numpy(), g, rtol=1e-4, atol=1e-6)


def test_empty_0d_on_the_fast_path(device):
    """``pydiff.empty(())`` (a cross-entropy's loss) takes the plain-shape path: a 0-d float
    tensor of one element, its gradient buffer 0-d too; other shapes are still refused."""
    t = pydiff.empty((), device=device, requires_grad=True)
    assert t.shape == () and t.dtype == "float" and t.numel == 1
    t.copy_from_numpy(np.float32(2.5))
    assert t.numpy().shape == () and float(t.numpy()) == 2.5
    assert t.grad.shape == () and float(t.grad.numpy()) == 0.0
    for bad in ((0,), (2, -1), (2.0,)):
        with pytest.raises((ValueError, TypeError)):
            pydiff.empty(bad, device=device)
