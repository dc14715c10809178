"""perf48h: the four-parameter AdamW step keeps its kernel across steps (rebuilt once the
cache drops it), makes its replay uniforms only in a capture, and a dispatch site's held
object reads no buffer handles it does not need. Every value is checked against float64
NumPy (torch.optim.AdamW's rule, written out), never against pydiff's own output."""

import numpy as np

import pydiff
from pydiff import nn, ops, optim

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.01
SHAPES = [(8, 4), (8,), (3, 8), (3,)]  # the four-parameter kernel (an odd-sized one too)


def _reference(p0, grads):
    """AdamW (decoupled decay, bias correction) in float64, one gradient list per step."""
    p = [a.astype(np.float64) for a in p0]
    m = [np.zeros_like(a) for a in p]
    v = [np.zeros_like(a) for a in p]
    for t, gs in enumerate(grads, start=1):
        for k, g in enumerate(gs):
            g = g.astype(np.float64)
            p[k] *= 1.0 - LR * WD
            m[k] = B1 * m[k] + (1 - B1) * g
            v[k] = B2 * v[k] + (1 - B2) * g * g
            denom = np.sqrt(v[k]) / np.sqrt(1 - B2**t) + EPS
            p[k] -= LR / (1 - B1**t) * m[k] / denom
    return p


def _params(device, rng):
    p0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    return p0, [pydiff.tensor(a, requires_grad=True, device=device) for a in p0]


def test_adamw_steps_with_the_kernel_cache_emptied_between_them(device):
    rng = np.random.default_rng(48)
    p0, ps = _params(device, rng)
    opt = optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(4)]
    for step, gs in enumerate(grads):
        for p, g in zip(ps, gs):
            p.grad.copy_from_numpy(g)  # (a host write: the step updates it)
        if step == 1:
            device.kernels.release()  # the kept kernel is gone: built or found anew
        if step == 2:
            device.kernels.release_objects()  # the site's bound object too
        opt.step()
    for p, want in zip(ps, _reference(p0, grads)):
        np.testing.assert_allclose(p.numpy(), want, rtol=2e-5, atol=2e-6)


def test_adamw_step_after_a_gradient_buffer_is_replaced(device):
    rng = np.random.default_rng(7)
    p0, ps = _params(device, rng)
    opt = optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(3)]
    for step, gs in enumerate(grads):
        if step == 1:  # new gradient buffers for params 0 and 3: the site binds others
            for k in (0, 3):
                ps[k].requires_grad_(False)
                ps[k].requires_grad_(True)
        for p, g in zip(ps, gs):
            p.grad.copy_from_numpy(g)
        opt.step()
    for p, want in zip(ps, _reference(p0, grads)):
        np.testing.assert_allclose(p.numpy(), want, rtol=2e-5, atol=2e-6)


def test_captured_adamw_step_rereads_its_uniforms_at_each_replay(device):
    """Two linear layers and a cross-entropy, captured: each replay's gradients (float64
    NumPy from the current parameters) and bias correction (the uniforms the capture
    re-reads) follow the step count."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = rng.integers(0, 3, 32).astype(np.int32)
    layers = [nn.Linear(8, 16, seed=0, device=device), nn.Linear(16, 3, seed=1, device=device)]
    ps = [t for layer in layers for t in (layer.weight, layer.bias)]
    p = [t.numpy().astype(np.float64) for t in ps]
    opt = optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    xb, yb = pydiff.tensor(x, device=device), pydiff.tensor(y, device=device)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss)
        opt.step()

    step()  # the optimizer's state is made on its first step
    captured = pydiff.capture(step)  # the second step
    for _ in range(3):
        captured.replay()
    m = [np.zeros_like(a) for a in p]
    v = [np.zeros_like(a) for a in p]
    onehot = np.eye(3)[y]
    for t in range(1, 6):
        w1, b1, w2, b2 = p
        h = x @ w1.T + b1
        z = h @ w2.T + b2
        e = np.exp(z - z.max(1, keepdims=True))
        dz = (e / e.sum(1, keepdims=True) - onehot) / len(x)
        dh = dz @ w2
        for k, g in enumerate((dh.T @ x, dh.sum(0), dz.T @ h, dz.sum(0))):
            p[k] *= 1.0 - LR * WD
            m[k] = B1 * m[k] + (1 - B1) * g
            v[k] = B2 * v[k] + (1 - B2) * g * g
            p[k] -= LR / (1 - B1**t) * m[k] / (np.sqrt(v[k]) / np.sqrt(1 - B2**t) + EPS)
    for t, want in zip(ps, p):
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-4, atol=1e-5)


def test_linear_with_new_inputs_and_results_each_call(device):
    """A product site's held object rebinds each call's new buffers (no stale binding)."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((16, 12)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    wt, bt = pydiff.tensor(w, device=device), pydiff.tensor(b, device=device)
    outs, xs = [], []
    for _ in range(4):
        x = rng.standard_normal((32, 12)).astype(np.float32)
        xs.append(x)
        outs.append(ops.linear(pydiff.tensor(x, device=device), wt, bt))
    for x, out in zip(xs, outs):
        want = x.astype(np.float64) @ w.T.astype(np.float64) + b
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
