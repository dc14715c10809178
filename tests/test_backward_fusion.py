"""A cross-entropy's backward done inside the backward of the linear layer that made its logits
(one kernel, ``FunctionCtx.producer`` / ``tape.Claim``): the gradients against float64 NumPy,
the same bits as the two kernels, and every case where fusing could change a gradient left
to the separate backwards."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pydiff
from pydiff import ops, ops_reduce

from kernel_usage import entries_used


def _problem(seed=5, batch=256, n_in=64, n_out=10):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    w = (rng.standard_normal((n_out, n_in)) * 0.3).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    labels = rng.integers(0, n_out, batch).astype(np.int32)
    return x, w, b, labels


def _reference(x, w, b, labels):
    """Mean softmax cross-entropy of x W^T + b in float64: dL/dz, dW, db, dx."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    z = x64 @ w64.T + (0.0 if b is None else b.astype(np.float64))
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    dz = (p - np.eye(z.shape[1])[labels]) / len(labels)
    return {"z": dz, "w": dz.T @ x64, "b": dz.sum(axis=0), "x": dz @ w64}


def _run(device, x, w, b, labels, x_grad=True, bias=True):
    xt = pydiff.tensor(x, device=device, requires_grad=x_grad)
    wt = pydiff.tensor(w, device=device, requires_grad=True)
    bt = pydiff.tensor(b, device=device, requires_grad=True) if bias else None
    yt = pydiff.tensor(labels, device=device)
    with pydiff.Tape() as tape:
        z = ops.linear(xt, wt, bt)
        loss = ops.cross_entropy(z, yt)
    tape.backward(loss)
    grads = {"z": z.grad.numpy(), "w": wt.grad.numpy()}
    if bias:
        grads["b"] = bt.grad.numpy()
    if x_grad:
        grads["x"] = xt.grad.numpy()
    return grads


def _fused_possible(device) -> bool:
    return not device.kernels.gpu  # the narrow kernel is lavapipe's


@pytest.mark.parametrize(
    "shape, x_grad, bias",
    [
        ((256, 64, 10), True, True),
        ((256, 64, 10), False, True),
        ((256, 64, 10), True, False),
        ((40, 128, 16), True, True),
        ((4096, 64, 3), False, True),
        ((7, 64, 1), True, True),
    ],
)
def test_fused_gradients_match_float64_and_the_two_kernels_bit_for_bit(
    device, monkeypatch, shape, x_grad, bias
):
    x, w, b, labels = _problem(1, *shape)
    used = entries_used(device, monkeypatch)
    fused = _run(device, x, w, b, labels, x_grad, bias)
    if _fused_possible(device):
        assert "ce_backward_acc" not in used and "linear_bwd_narrow" in used
    monkeypatch.setattr(ops_reduce, "CE_PRODUCER_FUSIONS", {})
    del used[:]
    separate = _run(device, x, w, b, labels, x_grad, bias)
    if _fused_possible(device):
        assert "ce_backward_acc" in used
    ref = _reference(x, w, b if bias else None, labels)
    for name, got in fused.items():
        np.testing.assert_allclose(got, ref[name], rtol=2e-5, atol=2e-6, err_msg=name)
        assert np.array_equal(got.view(np.uint32), separate[name].view(np.uint32)), name


def _loss_and_grads(device, build):
    """build(z, labels) -> loss, for z = linear(x, W, b); gradients of x, W, b."""
    x, w, b, labels = _problem(3)
    xt, wt, bt = (pydiff.tensor(a, device=device, requires_grad=True) for a in (x, w, b))
    with pydiff.Tape() as tape:
        loss = build(ops.linear(xt, wt, bt), pydiff.tensor(labels, device=device))
    tape.backward(loss)
    return (x, w, b, labels), (xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy())


def _chain(dz, x, w):
    return dz @ w.astype(np.float64), dz.T @ x.astype(np.float64), dz.sum(axis=0)


def test_logits_read_by_another_call_are_not_fused(device, monkeypatch):
    used = entries_used(device, monkeypatch)
    (x, w, b, labels), got = _loss_and_grads(
        device, lambda z, y: ops.add(ops.cross_entropy(z, y), ops.mul(ops.sum(z), 0.5))
    )
    assert "ce_backward_acc" in used or not _fused_possible(device)
    dz = _reference(x, w, b, labels)["z"] + 0.5
    for g, r in zip(got, _chain(dz, x, w)):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)


def test_two_cross_entropies_of_one_logits_add_up(device, monkeypatch):
    used = entries_used(device, monkeypatch)
    (x, w, b, labels), got = _loss_and_grads(
        device, lambda z, y: ops.add(ops.cross_entropy(z, y), ops.cross_entropy(z, y))
    )
    assert "ce_backward_acc" in used or not _fused_possible(device)
    for g, r in zip(got, _chain(2 * _reference(x, w, b, labels)["z"], x, w)):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)


def test_a_view_of_the_logits_is_not_fused(device, monkeypatch):
    used = entries_used(device, monkeypatch)
    (x, w, b, labels), got = _loss_and_grads(
        device, lambda z, y: ops.cross_entropy(z.reshape(z.shape), y)
    )
    assert "ce_backward_acc" in used or not _fused_possible(device)
    for g, r in zip(got, _chain(_reference(x, w, b, labels)["z"], x, w)):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-6)


def test_relu_logits_are_not_fused_and_stay_right(device, monkeypatch):
    x, w, b, labels = _problem(4)
    used = entries_used(device, monkeypatch)
    xt, wt, bt = (pydiff.tensor(a, device=device, requires_grad=True) for a in (x, w, b))
    with pydiff.Tape() as tape:
        z = ops.linear(xt, wt, bt, activation="relu")
        loss = ops.cross_entropy(z, pydiff.tensor(labels, device=device))
    tape.backward(loss)
    assert "ce_backward_acc" in used or not _fused_possible(device)
    pre = x.astype(np.float64) @ w.T.astype(np.float64) + b
    zr = np.maximum(pre, 0.0)
    e = np.exp(zr - zr.max(axis=1, keepdims=True))
    dz = (e / e.sum(axis=1, keepdims=True) - np.eye(10)[labels]) / len(labels) * (pre > 0)
    for g, r in zip((xt.grad, wt.grad, bt.grad), _chain(dz, x, w)):
        np.testing.assert_allclose(g.numpy(), r, rtol=2e-5, atol=2e-6)


def test_a_second_backward_accumulates_leaves_and_restarts_the_logits(device):
    x, w, b, labels = _problem(6)
    xt, wt, bt = (pydiff.tensor(a, device=device, requires_grad=True) for a in (x, w, b))
    with pydiff.Tape() as tape:
        z = ops.linear(xt, wt, bt)
        loss = ops.cross_entropy(z, pydiff.tensor(labels, device=device))
    tape.backward(loss)
    tape.backward(loss)
    ref = _reference(x, w, b, labels)
    np.testing.assert_allclose(z.grad.numpy(), ref["z"], rtol=2e-5, atol=2e-7)
    np.testing.assert_allclose(wt.grad.numpy(), 2 * ref["w"], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(xt.grad.numpy(), 2 * ref["x"], rtol=2e-5, atol=2e-7)


def test_strict_policy_still_refuses_a_stale_weight_gradient(device):
    x, w, b, labels = _problem(7)
    xt, wt, bt = (pydiff.tensor(a, device=device, requires_grad=True) for a in (x, w, b))
    yt = pydiff.tensor(labels, device=device)

    def step():
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(ops.linear(xt, wt, bt), yt)
        tape.backward(loss)

    pydiff.set_zero_policy("strict")
    step()
    with pytest.raises(RuntimeError, match="(?i)stale|strict|zero"):
        step()


def test_grad_scale_from_the_seed_reaches_the_fused_kernel(device):
    x, w, b, labels = _problem(8)
    xt, wt, bt = (pydiff.tensor(a, device=device, requires_grad=True) for a in (x, w, b))
    with pydiff.Tape() as tape:
        z = ops.linear(xt, wt, bt)
        loss = ops.cross_entropy(z, pydiff.tensor(labels, device=device))
    tape.backward(loss, grad=-3.0)
    ref = _reference(x, w, b, labels)
    np.testing.assert_allclose(z.grad.numpy(), -3 * ref["z"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(bt.grad.numpy(), -3 * ref["b"], rtol=2e-5, atol=1e-6)


def test_captured_steps_replay_the_fused_backward(device):
    x, w, b, labels = _problem(9)
    wt, bt = (pydiff.tensor(a, device=device, requires_grad=True) for a in (w, b))
    xt, yt = pydiff.tensor(x, device=device), pydiff.tensor(labels, device=device)

    def step():
        wt.zero_grad()
        bt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(ops.linear(xt, wt, bt), yt)
        tape.backward(loss, retain_graph=False)
        return loss

    captured = pydiff.capture(step)
    rng = np.random.default_rng(10)
    for _ in range(3):
        new_x = rng.standard_normal(x.shape).astype(np.float32)
        xt.copy_from_numpy(new_x)
        captured.replay()
        ref = _reference(new_x, w, b, labels)
        np.testing.assert_allclose(wt.grad.numpy(), ref["w"], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(bt.grad.numpy(), ref["b"], rtol=2e-5, atol=2e-6)


def test_threads_fuse_their_own_tapes(device):
    problems = [_problem(20 + k) for k in range(4)]
    errors: list = []

    def work(k):
        try:
            x, w, b, labels = problems[k]
            for _ in range(5):
                got = _run(device, x, w, b, labels)
                ref = _reference(x, w, b, labels)
                for name in got:
                    np.testing.assert_allclose(got[name], ref[name], rtol=2e-5, atol=2e-6)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


class _TwoOutputs(pydiff.Function):
    """(2x, 3x); backward takes None for an output without gradient buffers."""

    @staticmethod
    def forward(ctx, x):
        v = x.numpy()
        return pydiff.tensor(2 * v, device=x.device), pydiff.tensor(3 * v, device=x.device)

    @staticmethod
    def backward(ctx, ga, gb):
        g = 2 * ga.numpy()
        return g if gb is None else g + 3 * gb.numpy()


def test_an_output_off_the_path_may_drop_its_gradient_buffers(device):
    x = pydiff.tensor(np.array([1.0, -2.0, 0.5], np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        a, b = _TwoOutputs.apply(x)
        loss = ops.sum(a)
    b.requires_grad_(False)  # not read by anything the loss depends on
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0, 2.0])


def test_an_output_on_the_path_without_gradient_buffers_is_refused(device):
    x = pydiff.tensor(np.array([1.0, -2.0, 0.5], np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        a, b = _TwoOutputs.apply(x)
        loss = ops.add(ops.sum(a), ops.sum(b))
    b.requires_grad_(False)
    with pytest.raises(RuntimeError, match="output 1 of call #1.*requires_grad_"):
        tape.backward(loss)
    assert np.all(x.grad.numpy() == 0)  # refused before any kernel ran


def test_many_heads_on_one_tape_each_fuse(device, monkeypatch):
    """Per-step losses on one tape: each head's claim (the tape indexed once per backward)."""
    used = entries_used(device, monkeypatch)
    heads = [_problem(40 + k, 16, 64, 5) for k in range(6)]
    xt = pydiff.tensor(heads[0][0], device=device, requires_grad=True)
    ws = [pydiff.tensor(h[1], device=device, requires_grad=True) for h in heads]
    with pydiff.Tape() as tape:
        loss = None
        for (_, _, _, labels), w in zip(heads, ws):
            term = ops.cross_entropy(ops.linear(xt, w), pydiff.tensor(labels, device=device))
            loss = term if loss is None else ops.add(loss, term)
    tape.backward(loss)
    if _fused_possible(device):
        assert "ce_backward_acc" not in used and used.count("linear_bwd_narrow") == 6
    dx = np.zeros(heads[0][0].shape)
    for (_, w, _, labels), wt in zip(heads, ws):
        ref = _reference(heads[0][0], w, None, labels)
        np.testing.assert_allclose(wt.grad.numpy(), ref["w"], rtol=2e-5, atol=2e-6)
        dx += ref["x"]
    np.testing.assert_allclose(xt.grad.numpy(), dx, rtol=2e-5, atol=2e-6)
