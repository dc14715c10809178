"""Fused optimizers against NumPy re-implementations of PyTorch's update rules (100 steps)."""

import numpy as np
import pytest

import pydiff
from pydiff import optim

STEPS = 100


def _grads(shape):
    rng = np.random.default_rng(11)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(STEPS)]


def _run(device, make, p0, grads):
    p = pydiff.tensor(p0, device=device, requires_grad=True)
    opt = make([p])
    for g in grads:
        p.grad.copy_from_numpy(g)
        opt.step()
    return p.numpy(), opt


def _numpy_adam(p, grads, lr, b1, b2, eps, wd, decoupled):
    """torch.optim.Adam/AdamW's update, step by step in float32 as PyTorch computes it."""
    f = np.float32
    p = p.astype(f)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.astype(f)
        if decoupled:
            p = p * f(1 - lr * wd)
        else:
            g = g + f(wd) * p
        m = m + f(1 - b1) * (g - m)
        v = v * f(b2) + f(1 - b2) * g * g
        denom = np.sqrt(v) / f(np.sqrt(1 - b2**t)) + f(eps)
        p = p - f(lr / (1 - b1**t)) * (m / denom)
    return p


def _numpy_adam64(p, grads, lr, b1, b2, eps, wd):
    """The same rule in float64: the exact answer float32 kernels approximate."""
    p, m, v = p.astype(np.float64), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g.astype(np.float64) ** 2
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def _numpy_sgd(p, grads, lr, momentum, wd):
    p = p.astype(np.float64)
    buf = None
    for g in grads:
        g = g.astype(np.float64) + wd * p
        if momentum:
            buf = g if buf is None else momentum * buf + g
            g = buf
        p = p - lr * g
    return p


P0 = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adamw_matches_rule(device, wd):
    got, _ = _run(
        device,
        lambda ps: optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd),
        P0,
        _grads(P0.shape),
    )
    want = _numpy_adam(P0, _grads(P0.shape), 1e-2, 0.9, 0.99, 1e-8, wd, decoupled=True)
    # NumPy's step-by-step float32 rounding; CUDA contracts a * b + c into one FMA, which
    # rounds once (1.4e-6 apart after 100 steps on an H200): the float64 check below bounds both.
    np.testing.assert_allclose(got, want, atol=1e-6 if device.type != "cuda" else 4e-6, rtol=0)
    exact = _numpy_adam64(P0, _grads(P0.shape), 1e-2, 0.9, 0.99, 1e-8, wd)
    np.testing.assert_allclose(got, exact, atol=1e-5, rtol=0)  # float32 rounding over 100 steps


def _adamw_each_follows_the_rule(device, seed, shapes, steps):
    """AdamW over parameters of ``shapes`` for ``steps`` steps; each against NumPy's rule."""
    rng = np.random.default_rng(seed)
    starts = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for _ in range(steps)] for s in shapes]
    params = [pydiff.tensor(p0, device=device, requires_grad=True) for p0 in starts]
    opt = optim.AdamW(params, lr=1e-2, weight_decay=0.05)
    for step in range(steps):
        for p, g in zip(params, grads):
            p.grad.copy_from_numpy(g[step])
        opt.step()
    for p, p0, g in zip(params, starts, grads):
        want = _numpy_adam(p0, g, 1e-2, 0.9, 0.999, 1e-8, 0.05, decoupled=True)
        np.testing.assert_allclose(p.numpy(), want, atol=1e-6, rtol=0)


def test_adamw_many_parameters_of_odd_sizes(device):
    """Six parameters (two four-parameter kernels, sizes not whole float4s): each follows the
    rule on its own, untouched by its neighbours' ranges."""
    _adamw_each_follows_the_rule(device, 4, [(3,), (5, 2), (1,), (17,), (4, 4), (2, 3)], 20)


def test_adamw_chunks_of_several_float4s_with_partial_tails(device):
    """The fused kernel updates several float4s per thread (optim.OPTIM_CHUNK): parameters of
    many chunks, whose last chunk is partial, next to small ones, each follow the rule."""
    shapes = [(70,), (33, 3), (16,), (1001,), (5,)]
    _adamw_each_follows_the_rule(device, 5, shapes, 5)
    assert optim.OPTIM_CHUNK > 1 and any(-(-s[0] // 4) % optim.OPTIM_CHUNK for s in shapes)


def test_adam_l2_matches_rule(device):
    got, _ = _run(
        device, lambda ps: optim.Adam(ps, lr=1e-2, weight_decay=0.1), P0, _grads(P0.shape)
    )
    want = _numpy_adam(P0, _grads(P0.shape), 1e-2, 0.9, 0.999, 1e-8, 0.1, decoupled=False)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.01)])
def test_sgd_matches_rule(device, momentum, wd):
    got, _ = _run(
        device,
        lambda ps: optim.SGD(ps, lr=0.01, momentum=momentum, weight_decay=wd),
        P0,
        _grads(P0.shape),
    )
    want = _numpy_sgd(P0, _grads(P0.shape), 0.01, momentum, wd)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_matches_torch_when_installed(device):
    torch = pytest.importorskip("torch")
    grads = _grads(P0.shape)
    got, _ = _run(device, lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.01), P0, grads)
    tp = torch.tensor(P0, requires_grad=True)  # float32, as users run it
    topt = torch.optim.AdamW([tp], lr=1e-2, weight_decay=0.01)
    for g in grads:
        tp.grad = torch.tensor(g)
        topt.step()
    np.testing.assert_allclose(got, tp.detach().numpy(), atol=1e-6, rtol=0)


def test_state_dict_round_trip_and_zero_grad(device):
    grads = _grads(P0.shape)
    p = pydiff.tensor(P0, device=device, requires_grad=True)
    opt = optim.AdamW([p], lr=1e-2)
    for g in grads[:50]:
        p.grad.copy_from_numpy(g)
        opt.step()
    saved, p_mid = opt.state_dict(), p.numpy().copy()
    q = pydiff.tensor(p_mid, device=device, requires_grad=True)
    opt2 = optim.AdamW([q], lr=1e-2)
    opt2.load_state_dict(saved)
    for g in grads[50:]:
        for t, o in ((p, opt), (q, opt2)):
            t.grad.copy_from_numpy(g)
            o.step()
    np.testing.assert_array_equal(p.numpy(), q.numpy())
    opt.zero_grad()
    np.testing.assert_array_equal(p.grad.numpy(), np.zeros(P0.shape))


def test_bad_arguments(device):
    with pytest.raises(ValueError, match="params is empty"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match=r"params\[0\] must be a float tensor with requires_grad"):
        optim.SGD([pydiff.zeros((2,), device=device)], lr=0.1)
    with pytest.raises(ValueError, match="betas"):
        optim.Adam([pydiff.zeros((2,), device=device, requires_grad=True)], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="lr=-1.0"):
        optim.SGD([pydiff.zeros((2,), device=device, requires_grad=True)], lr=-1.0)


def test_adamw_follows_a_learning_rate_that_changes_and_returns(device):
    """Each step's uniforms reach the kernel: only the changed ones are set again on the
    cached shader object, so values that go A, B, A (and lr 0, then back) must not go stale."""
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(37).astype(np.float32)
    schedule = [1e-2, 3e-3, 1e-2, 0.0, 1e-2, 1e-2, 2e-2]
    grads = [rng.standard_normal(37).astype(np.float32) for _ in schedule]
    p = pydiff.tensor(p0, device=device, requires_grad=True)
    opt = optim.AdamW([p], lr=schedule[0], weight_decay=0.1)
    ref, m, v = p0.astype(np.float64), 0.0, 0.0
    for t, (lr, g) in enumerate(zip(schedule, grads), start=1):
        opt.defaults["lr"] = lr
        p.grad.copy_from_numpy(g)
        opt.step()
        ref = ref * (1 - lr * 0.1)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g.astype(np.float64) ** 2
        ref = ref - lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        np.testing.assert_allclose(p.numpy(), ref, rtol=2e-5, atol=2e-6, err_msg=f"step {t}")


def test_large_parameters_keep_their_bound_objects_and_follow_the_rules(device):
    """Parameters over 4 MiB: the optimizer keeps each dispatch's bound object itself (the
    device's cache takes only small buffers); values still follow the rules step by step,
    with two parameters sharing a four-slot kernel and a state reloaded midway."""
    rng = np.random.default_rng(3)
    n = (1 << 20) + 5
    starts = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    grads = [[rng.standard_normal(n).astype(np.float32) for _ in range(3)] for _ in range(2)]
    params = [pydiff.tensor(p0, device=device, requires_grad=True) for p0 in starts]
    opt = optim.AdamW(params, lr=1e-2, weight_decay=0.05)
    for step in range(3):
        for p, g in zip(params, grads):
            p.grad.copy_from_numpy(g[step])
        if step == 2:
            opt.load_state_dict(opt.state_dict())  # the same values, copied into the state
        opt.step()
    for p, p0, g in zip(params, starts, grads):
        want = _numpy_adam(p0, g, 1e-2, 0.9, 0.999, 1e-8, 0.05, decoupled=True)
        np.testing.assert_allclose(p.numpy(), want, atol=4e-6, rtol=0)
    q = pydiff.tensor(starts[0], device=device, requires_grad=True)
    sgd = optim.SGD([q], lr=0.01, momentum=0.9)
    for g in grads[0]:
        q.grad.copy_from_numpy(g)
        sgd.step()
    want = _numpy_sgd(starts[0], grads[0], 0.01, 0.9, 0.0)
    np.testing.assert_allclose(q.numpy(), want, atol=1e-6, rtol=0)
