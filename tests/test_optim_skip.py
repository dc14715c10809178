"""A step updates only the parameters that got a gradient since the last zero_grad(), as
torch.optim skips a ``.grad`` of None (breaker C, F1): their values, moments and per-parameter
step counts (Adam's bias correction) stay as they are. Checked against torch.optim in float64
over many steps with parameters left out of the loss in different patterns."""

import numpy as np
import pytest

import pydiff
from pydiff import CaptureError, ops, optim

torch = pytest.importorskip("torch")

SHAPES = [(3, 4), (5,), (1,), (7,), (2, 2)]


def _used(k, step):
    """Whether parameter k is in step's loss: always; not every third step; step 0 only;
    from step 10 on (its first update comes late: bias correction from its own count 1);
    never."""
    return [True, step % 3 != 2, step == 0, step >= 10, False][k]


OPTIMIZERS = {
    "sgd": ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.05)),
    "adam": ("Adam", dict(lr=0.02, weight_decay=0.05)),
    "adamw": ("AdamW", dict(lr=0.02, weight_decay=0.1)),
}


def _data(steps):
    rng = np.random.default_rng(26)
    starts = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    targets = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(steps)]
    return starts, targets


def _torch_run(kind, kw, starts, targets, steps, used=_used):
    ps = [torch.tensor(p0.astype(np.float64), requires_grad=True) for p0 in starts]
    opt = getattr(torch.optim, kind)(ps, **kw)
    for step in range(steps):
        opt.zero_grad()  # set_to_none: a parameter out of the loss keeps grad None
        loss = sum(
            ((p * p).sum() + (p * torch.tensor(x.astype(np.float64))).sum())
            for k, (p, x) in enumerate(zip(ps, targets[step]))
            if used(k, step)
        )
        loss.backward()
        opt.step()
    return [p.detach().numpy() for p in ps], opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parameters_out_of_the_loss_are_skipped_as_in_torch(device, name):
    kind, kw = OPTIMIZERS[name]
    steps = 45
    starts, targets = _data(steps)
    params = [pydiff.tensor(p0, device=device, requires_grad=True) for p0 in starts]
    xs = [[pydiff.tensor(x, device=device) for x in row] for row in targets]
    opt = getattr(optim, kind)(params, **kw)
    for step in range(steps):
        opt.zero_grad()
        with pydiff.Tape() as tape:
            terms = [
                ops.add(ops.sum(ops.mul(p, p)), ops.sum(ops.mul(p, x)))
                for k, (p, x) in enumerate(zip(params, xs[step]))
                if _used(k, step)
            ]
            loss = terms[0]
            for t in terms[1:]:
                loss = ops.add(loss, t)
        tape.backward(loss)
        opt.step()
    want, topt = _torch_run(kind, kw, starts, targets, steps)
    for k, (p, w) in enumerate(zip(params, want)):
        np.testing.assert_allclose(p.numpy(), w, rtol=2e-5, atol=2e-5, err_msg=f"param {k}")
    np.testing.assert_array_equal(params[4].numpy(), starts[4])  # never in a loss: untouched
    if kind != "SGD":  # torch's per-parameter step counts (bias correction)
        tsteps = [
            int(topt.state[p]["step"]) if p in topt.state else 0
            for p in topt.param_groups[0]["params"]
        ]
        assert opt.param_steps == tsteps
        assert [s["step"] for s in opt.state_dict()["state"]] == tsteps
    assert opt.step_count == steps


def _host_run(device, kind, kw, starts, grads_of, steps):
    """pydiff with gradients written by the caller: ``grads_of(step, params)``."""
    params = [pydiff.tensor(p0, device=device, requires_grad=True) for p0 in starts]
    opt = getattr(optim, kind)(params, **kw)
    for step in range(steps):
        grads_of(step, params, opt)
        opt.step()
    return [p.numpy() for p in params], opt


def _torch_host(kind, kw, starts, grads, steps):
    """torch with .grad set to ``grads[step][k]`` (None: no gradient)."""
    ps = [torch.tensor(p0.astype(np.float64)) for p0 in starts]
    opt = getattr(torch.optim, kind)(ps, **kw)
    for step in range(steps):
        for p, g in zip(ps, grads[step]):
            p.grad = None if g is None else torch.tensor(np.asarray(g, np.float64))
        opt.step()
    return [p.numpy() for p in ps]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_micro_batches_and_host_written_gradients(device, name):
    """Gradient accumulation over two micro-batches without zero_grad in between (a parameter
    used in one micro-batch only is updated with that gradient); a gradient written by the
    host (copy_from_numpy, fill: fill(0.0) is a zero gradient, not none) counts."""
    kind, kw = OPTIMIZERS[name]
    steps = 12
    starts, targets = _data(steps)
    rng = np.random.default_rng(3)
    host = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(steps)]
    expect = []

    def grads_of(step, params, opt):
        opt.zero_grad()
        row = [None] * len(params)
        for micro in range(2):
            with pydiff.Tape() as tape:
                used = [k for k in (0, 1) if micro == 0 or k == 0]  # param 1: micro-batch 0
                loss = None
                for k in used:
                    x = pydiff.tensor(targets[step][k], device=device)
                    term = ops.sum(ops.mul(params[k], x))
                    loss = term if loss is None else ops.add(loss, term)
                    row[k] = targets[step][k] if row[k] is None else row[k] + targets[step][k]
            tape.backward(loss)
        if step % 2 == 0:
            params[2].grad.copy_from_numpy(host[step][2])
            row[2] = host[step][2]
        if step % 3 == 0:
            params[3].grad.fill(0.0)
            row[3] = np.zeros(SHAPES[3])
        expect.append(row)

    got, _ = _host_run(device, kind, kw, starts, grads_of, steps)
    want = _torch_host(kind, kw, starts, expect, steps)
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"param {k}")
    np.testing.assert_array_equal(got[4], starts[4])


def test_without_zero_grad_every_written_gradient_steps(device):
    """A user who never calls zero_grad: a gradient, once written, stays (as torch's .grad
    does), so the parameter is stepped every time; one never written is never stepped."""
    kind, kw = OPTIMIZERS["adam"]
    steps = 8
    starts, _ = _data(steps)
    g0 = np.full(SHAPES[0], 0.5, np.float32)

    def grads_of(step, params, opt):
        if step == 0:
            params[0].grad.copy_from_numpy(g0)

    got, opt = _host_run(device, kind, kw, starts, grads_of, steps)
    grads = [[g0] + [None] * 4 for _ in range(steps)]
    want = _torch_host(kind, kw, starts, grads, steps)
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"param {k}")
    assert opt.param_steps == [steps, 0, 0, 0, 0]


def test_state_dict_keeps_each_parameters_step_count(device):
    """Saved mid-run (parameters with different counts) and loaded into a new optimizer, the
    run goes on as torch's; a state dict without per-parameter counts (older pydiff) gives
    each parameter the optimizer's count."""
    kind, kw = OPTIMIZERS["adamw"]
    steps = 10
    starts, targets = _data(steps)
    params = [pydiff.tensor(p0, device=device, requires_grad=True) for p0 in starts]
    opt = getattr(optim, kind)(params, **kw)
    for step in range(steps):
        opt.zero_grad()
        for k, p in enumerate(params):
            if _used(k, step):
                p.grad.copy_from_numpy(2 * p.numpy() + targets[step][k])
        opt.step()
        if step == 4:  # a new optimizer from the state dict takes over
            saved = opt.state_dict()
            opt = getattr(optim, kind)(params, **kw)
            opt.load_state_dict(saved)
    want, _ = _torch_run(kind, kw, starts, targets, steps)
    for k, (p, w) in enumerate(zip(params, want)):
        np.testing.assert_allclose(p.numpy(), w, rtol=2e-5, atol=2e-5, err_msg=f"param {k}")
    old = opt.state_dict()
    del old["optimizer"]
    for s in old["state"]:
        del s["step"]
    opt.load_state_dict(old)
    assert opt.param_steps == [steps] * len(params)


def _capture_setup(device, kind, kw):
    rng = np.random.default_rng(8)
    X = rng.standard_normal((8, 4)).astype(np.float32)
    G = rng.standard_normal((8, 4)).astype(np.float32)
    W0 = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2)]
    x = pydiff.tensor(X, device=device)
    ws = [pydiff.tensor(w, device=device, requires_grad=True) for w in W0]
    opt = getattr(optim, kind)(ws, **kw)

    def step():  # the loss uses ws[0] only: ws[1] gets no gradient
        opt.zero_grad()
        with pydiff.Tape() as tape:
            y = ops.linear(x, ws[0])
        tape.backward(y, grad=G)  # dL/dW0 = G^T X
        opt.step()

    return ws, opt, step, W0, (G.astype(np.float64).T @ X)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_captured_step_updates_the_parameters_it_updated_when_captured(device, name):
    """ws[1] has a gradient in the first (eager) step only; the captured step skips it, and
    its replays advance only ws[0]'s step count: both follow torch. A gradient written into
    ws[1] between replays (the eager step would update it) makes replay() refuse."""
    kind, kw = OPTIMIZERS[name]
    ws, opt, step, W0, dw = _capture_setup(device, kind, kw)
    g1 = np.full((4, 4), 0.25, np.float32)
    opt.zero_grad()  # the first step by hand: ws[1] has a gradient too
    ws[0].grad.copy_from_numpy(dw.astype(np.float32))
    ws[1].grad.copy_from_numpy(g1)
    opt.step()
    captured = pydiff.capture(step)
    for _ in range(4):
        captured.replay()
    grads = [[dw, g1]] + [[dw, None]] * 5
    want = _torch_host(kind, kw, W0, grads, 6)
    for k, (w, t) in enumerate(zip(ws, want)):
        np.testing.assert_allclose(w.numpy(), t, rtol=2e-5, atol=2e-5, err_msg=f"ws[{k}]")
    if kind != "SGD":
        assert opt.param_steps == [6, 1]
    ws[1].grad.fill(1.0)
    with pytest.raises(CaptureError, match=r"params\[1\] has a gradient.*capture the step again"):
        captured.replay()
    ws[1].zero_grad()  # no gradient again: the replay is the eager step once more
    captured.replay()
    assert opt.step_count == 7
