"""breakB44: a new user's training steps against PyTorch float64 (issue 16, items 2-3).

Defects found and fixed here:
- a model split over two devices: the ops' mixed-device error told the user to copy with
  ``pydiff.tensor(t.numpy(), device=...)``, which on a tape silently gives every layer before
  the copy no gradient (the optimizer then skips them). ``Tensor.to(device)`` is a copy the
  tape differentiates (the gradient goes back to the source device), and the error names it.
- cross_entropy labels out of range written where the host's once-per-version range check
  cannot see them (``t.native``, torch's CUDA view): a finite loss from another logit (or
  read past the row) and a gradient without its -1. The kernel now makes such a row NaN.
- a captured forward + backward replayed after ``opt.zero_grad()``, then an eager
  ``opt.step()``: the replay did not mark the gradients it wrote, so the step skipped every
  parameter (the model silently stopped training). A replay now marks them as the eager
  step does.

Checked against PyTorch float64 and held (not kept as tests, see the report): odd widths,
batch 1, one class, one feature, 4097 wide, 70,000 rows; SGD/Adam/AdamW with lr, momentum,
betas and weight decay changed mid-run, freeze/unfreeze, state_dict round trips, two captures
of two batch sizes interleaved with eager steps, replays from another thread, four trainings
in four threads, the fused classifier head's variants, NaN/inf through fused and unfused
paths, views at odd offsets, torch autograd both ways, flat memory over thousands of steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def second_device():
    # Devices are cached per (type, include paths, cache folder): another include path is
    # another device (a fixed one: the persistent compile cache serves its kernels next time).
    return pydiff.create_device("vulkan", include_paths=[str(Path(__file__).parent)])


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


def _native_write(t, values):
    # A write through SlangPy itself, which pydiff's version counter does not see (docs/tape.md);
    # on CUDA, a torch tensor from to_torch(t) writing the shared memory is the same.
    t.native.copy_from_numpy(np.asarray(values, np.int32))


@pytest.mark.parametrize("classes", [3, 40])  # registers (C <= 32) and the looped rows
def test_labels_out_of_range_behind_the_version_counter_give_nan(classes):
    rng = np.random.default_rng(1)
    zv = rng.standard_normal((4, classes)).astype(np.float32)
    z = pydiff.tensor(zv, requires_grad=True)
    labels = pydiff.tensor(np.array([0, 1, 2, 0], np.int32))
    ops.cross_entropy(z, labels).item()  # range-checked once for this version of the values
    _native_write(labels, [0, classes + 5, 2, -1])  # unseen: the host check is skipped
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(z, labels)
    tape.backward(loss)
    # Before: a finite loss (an out-of-range row read logit 0, or past the row) and a gradient
    # of softmax alone in those rows: silently wrong. Now the kernel makes such a row NaN.
    assert np.isnan(loss.item())
    g = z.grad.numpy()
    assert np.isnan(g[1]).all() and np.isnan(g[3]).all()
    # rows 0 and 2 are not NaN (the mean's gradient is the same per row)
    zt = torch.tensor(zv, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.cross_entropy(zt[[0, 2]], torch.tensor([0, 2])).backward()
    np.testing.assert_allclose(g[[0, 2]], zt.grad.numpy()[[0, 2]] / 2, rtol=1e-5, atol=1e-7)


def test_fused_head_and_replay_with_labels_out_of_range_behind_the_counter():
    rng = np.random.default_rng(2)
    layer = nn.Linear(64, 10, seed=0)  # a classifier head: its backward fuses the loss's
    opt = optim.SGD(layer.parameters(), lr=0.1)
    xb = pydiff.tensor(rng.standard_normal((8, 64)).astype(np.float32))
    yb = pydiff.tensor(rng.integers(0, 10, 8).astype(np.int32))

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layer(xb), yb)
        tape.backward(loss, retain_graph=False)
        opt.step()
        return loss

    step()
    captured = pydiff.capture(step)
    assert np.isfinite(captured.replay().item())
    _native_write(yb, [0, 1, 2, 3, 4, 5, 6, 99])
    assert np.isnan(captured.replay().item())
    assert np.isnan(layer.weight.numpy()).any()  # the step's update is NaN, not silently off


def test_slangpy_path_labels_out_of_range_give_nan():
    # logits that are a view off the start of their buffer take SlangPy's cross_entropy_rows
    base = pydiff.tensor(np.random.default_rng(3).standard_normal(13).astype(np.float32))
    logits = pydiff.Tensor(base.native.view((4, 3), (3, 1), 1), base.device)
    labels = pydiff.tensor(np.array([0, 1, 2, 0], np.int32))
    zv = base.numpy()[1:].reshape(4, 3).astype(np.float64)
    lse = np.log(np.exp(zv).sum(1))
    want = np.mean(lse - zv[range(4), [0, 1, 2, 0]])
    assert abs(ops.cross_entropy(logits, labels).item() - want) < 1e-6
    _native_write(labels, [0, 7, 2, -3])
    assert np.isnan(ops.cross_entropy(logits, labels).item())  # before: 1.31, from other logits


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_captured_backward_then_eager_step_after_zero_grad(micro_batches):
    """A capture of the forward + backward only (gradient accumulation, clipping or a
    schedule between backward and step), replayed after the default zero_grad(): the replay
    did not mark the gradients it wrote, so the eager opt.step() skipped every parameter as
    if none had a gradient. The parameters silently never moved again."""
    rng = np.random.default_rng(4)
    layers = [nn.Linear(8, 12, seed=0, activation="relu"), nn.Linear(12, 3, seed=1)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = optim.SGD(params, lr=0.05, momentum=0.9)
    tparams = [torch.tensor(p.numpy(), dtype=torch.float64, requires_grad=True) for p in params]
    topt = torch.optim.SGD(tparams, lr=0.05, momentum=0.9)
    xb, yb = pydiff.empty((16, 8)), pydiff.empty((16,), dtype="int")

    def forward_backward():
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss, retain_graph=False)
        return loss

    captured = None
    for i in range(5):
        opt.zero_grad()  # set_to_none=True: a parameter nothing writes is skipped
        topt.zero_grad()
        for _ in range(micro_batches):
            x = rng.standard_normal((16, 8)).astype(np.float32)
            y = rng.integers(0, 3, 16).astype(np.int32)
            xb.copy_from_numpy(x)
            yb.copy_from_numpy(y)
            if i == 0:
                forward_backward()
            elif captured is None:
                captured = pydiff.capture(forward_backward)
            else:
                captured.replay()
            w1, b1, w2, b2 = tparams
            h = torch.relu(torch.tensor(x, dtype=torch.float64) @ w1.T + b1)
            z = h @ w2.T + b2
            torch.nn.functional.cross_entropy(z, torch.tensor(y, dtype=torch.int64)).backward()
        opt.step()
        topt.step()
    assert opt.param_steps == [5, 5, 5, 5]
    for p, t in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=0, atol=1e-6)


def test_captured_user_function_backward_then_eager_step_after_zero_grad():
    # a .bwds in Tape.backward marks its gradient without a version move (no Storage.wrote)
    m = pydiff.load_module_from_source(
        "breakb44_sq",
        "[Differentiable] float sq_err(float w, float x) { return (w - x) * (w - x); }",
    )
    n = 64
    w = pydiff.zeros((n,), requires_grad=True)
    x = pydiff.tensor(np.linspace(-1, 1, n).astype(np.float32))
    seed = pydiff.ones((n,))
    opt = optim.SGD([w], lr=0.25)

    def forward_backward():
        with pydiff.Tape() as tape:
            y = m.sq_err(w, x, _result="tensor")
        tape.backward(y, grad=seed, retain_graph=False)

    opt.zero_grad()
    forward_backward()
    opt.step()
    opt.zero_grad()
    captured = pydiff.capture(forward_backward)
    opt.step()
    for _ in range(3):
        opt.zero_grad()
        captured.replay()
        opt.step()
    # w <- w - 0.25 * 2 (w - x): halves the distance to x each step; five steps
    want = np.linspace(-1, 1, n) * (1 - 0.5**5)
    assert opt.param_steps == [5]
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-6, atol=1e-7)
