"""The eager MLP step's cross-entropy forward without a dispatch of its own (twenty-fourth
session): the head's product is held back in the device's queue (``CommandQueue.hold``) and
the cross-entropy that reads its logits records one fused kernel (matmul.slang's ``mm_nt``
with ``CE``; ``pydiff.head_fusion``). Checked against float64 NumPy, against the two-kernel
path bit for bit, and for every other use of the held product (reads, writes, other ops,
captures, threads, the buffer pool) getting the eager order's values.
"""

import hashlib
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import head_fusion, kernels, nn, ops, optim, products
from pydiff import ops_reduce

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from mlp_step import make_batch, make_mlp_step  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_shape_counts():
    """Each test starts with no hot shapes (other tests' fill ``FIXED_SHAPES_MAX``)."""
    kernels = pydiff.default_device().kernels
    kernels.fixed_shapes.clear()
    kernels.shape_uses.clear()
    kernels.plans.clear()


@pytest.fixture
def hot(monkeypatch):
    """Every product shape's kernels take constant sizes at once (a training loop's after
    three steps), with room for many shapes; returns the fused calls' outcomes."""
    monkeypatch.setattr(products, "HOT_SHAPE_USES", 1)
    monkeypatch.setattr(products, "FIXED_SHAPES_MAX", 1 << 10)
    outcomes: list[bool] = []
    real = ops_reduce.with_cross_entropy

    def spy(*args):
        outcomes.append(real(*args))
        return outcomes[-1]

    monkeypatch.setattr(ops_reduce, "with_cross_entropy", spy)
    return outcomes


@pytest.fixture
def recorded(monkeypatch):
    """Counts the kernel dispatches recorded natively (held-back ones when recorded)."""
    count = [0]
    real = kernels.KernelCache._record

    def record(self, *args, **kwargs):
        count[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(kernels.KernelCache, "_record", record)
    return count


def _ce64(z, labels):
    """Mean cross-entropy of float64 logits and its gradient (PyTorch's definition)."""
    z = z.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    loss = np.mean(lse - z[np.arange(len(z)), labels])
    p = np.exp(z - lse[:, None])
    p[np.arange(len(z)), labels] -= 1.0
    return loss, p / len(z)


def _head_step(device, x, w, b, labels):
    """loss = cross_entropy(x W^T + b, labels) on a tape, its backward; (loss, dx, dW, db)."""
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    wt = pydiff.tensor(w, device=device, requires_grad=True)
    bt = pydiff.tensor(b, device=device, requires_grad=True)
    yt = _checked(device, labels, w.shape[0])
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(ops.linear(xt, wt, bt), yt)
    tape.backward(loss)
    return loss.item(), xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy()


def _checked(device, labels, classes):
    """A label tensor whose range check is done (a first check reads it: a flush, which
    records a held product, as every read does)."""
    yt = pydiff.tensor(labels.astype(np.int32), device=device)
    ops_reduce._check_labels(yt, (len(labels), classes))
    return yt


def _data(batch, n_in, classes, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    w = (rng.standard_normal((classes, n_in)) / np.sqrt(n_in)).astype(np.float32)
    b = rng.standard_normal(classes).astype(np.float32)
    return x, w, b, rng.integers(0, classes, batch)


@pytest.mark.parametrize(
    "batch, n_in, classes",
    [
        (256, 64, 10),
        (1, 4, 1),
        (1, 64, 10),
        (7, 8, 3),
        (300, 64, 16),
        (2048, 64, 10),
        (64, 128, 7),
        (33, 12, 2),
        (5, 4, 33),
    ],
)
def test_loss_and_gradients_match_float64(device, hot, batch, n_in, classes):
    """The fused forward (where it applies) and the backward against float64 NumPy; 33 classes
    (not fused: a thread's block is not a whole row) and batches past the limit as before."""
    x, w, b, labels = _data(batch, n_in, classes, batch + n_in + classes)
    loss, dx, dw, db = _head_step(device, x, w, b, labels)
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    want, dz = _ce64(z, labels)
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(dx, dz @ w.astype(np.float64), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dw, dz.T @ x.astype(np.float64), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(db, dz.sum(0), rtol=1e-4, atol=1e-6)
    fused = device.kernels.gpu is False and classes <= 16 and batch <= 2048
    assert hot == [fused]


def _bits(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("batch, n_in, classes", [(256, 64, 10), (1, 4, 1), (300, 64, 16)])
def test_fused_and_two_kernels_give_the_same_bits(device, hot, monkeypatch, batch, n_in, classes):
    """The fused kernel writes ce_forward's bits (loss, row statistics, gradients), with NaN,
    inf and huge logits among finite ones."""
    x, w, b, labels = _data(batch, n_in, classes, 7)
    if batch > 3:
        x[1, 0] = np.nan  # a NaN row
        x[2, 0] = 1e30  # huge finite logits of both signs
        x[3, 1] = np.inf  # +inf and -inf logits
    runs = []
    for hold in (True, False, True):
        monkeypatch.setattr(head_fusion, "HOLD_HEADS", hold)
        runs.append(_bits(*_head_step(device, x, w, b, labels)))
    assert runs[0] == runs[1] == runs[2]
    assert hot == [True, False, True] if not device.kernels.gpu else True


def test_nan_and_inf_logits_against_float64(device, hot):
    """Rows holding NaN or +inf give NaN, rows with -inf elsewhere finite values, as NumPy."""
    x, w, b, labels = _data(8, 4, 5, 3)
    x[:] = 0.0
    b[:] = [0.0, 1.0, -np.inf, 2.0, 0.5]
    labels[:] = [0, 1, 3, 4, 0, 1, 3, 4]
    loss, *_ = _head_step(device, x, w, b, labels)
    want, _ = _ce64(np.broadcast_to(b, (8, 5)), labels)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    b[1] = np.nan
    assert np.isnan(_head_step(device, x, w, b, labels)[0])
    assert hot[-2:] == [True, True] or device.kernels.gpu


def _steps(n, read_every=0, retain_graph=False):
    xb, yb = make_batch()
    layers, step = make_mlp_step(xb, yb, retain_graph=retain_graph)
    losses = []
    for i in range(n):
        loss = step()
        if read_every and i % read_every == 0:
            losses.append(loss.item())
    losses.append(loss.item())
    return _bits(*[p.numpy() for layer in layers for p in layer.parameters()]), losses


def test_mlp_step_has_five_dispatches(recorded):
    """The benchmarks' MLP step: 6 dispatches (the two products, ce_forward, the narrow
    backward, dW1, AdamW) until its shapes are hot, then 5 (the head with the loss)."""
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    counts = []
    for _ in range(5):
        recorded[0] = 0
        step()
        counts.append(recorded[0])
    assert counts[-2:] == [5, 5], counts


def test_mlp_steps_bit_identical_fused_or_not(monkeypatch):
    """60 steps twice, and with the head never held back: the same parameters and losses to
    the bit; the loss read before each backward (then not fused) too."""
    a = _steps(60, read_every=7)
    assert _steps(60, read_every=7) == a
    monkeypatch.setattr(head_fusion, "HOLD_HEADS", False)
    assert _steps(60, read_every=7) == a


@pytest.mark.parametrize("hold", [True, False])
def test_capture_replays_match_eager(monkeypatch, hold):
    """A captured step (5 dispatches: the fused head recorded, the product it replaced
    dropped; 6 with HOLD_HEADS False) replayed against eager fused steps: the same bits."""
    monkeypatch.setattr(head_fusion, "HOLD_HEADS", hold)
    xb, yb = make_batch()
    layers, step = make_mlp_step(xb, yb)
    for _ in range(4):
        step()
    captured = pydiff.capture(step)
    monkeypatch.setattr(head_fusion, "HOLD_HEADS", True)
    assert sum(c[0] == "dispatch" for c in captured._commands) == (5 if hold else 6)
    for _ in range(5):
        captured.replay()
    got = _bits(*[p.numpy() for layer in layers for p in layer.parameters()])
    assert got == _steps(10)[0]
    assert captured.result.item() == _steps(10)[1][-1]


def _head(device):
    """A hot 256 x 64 -> 10 head with its input and labels."""
    rng = np.random.default_rng(5)
    h = pydiff.tensor(rng.standard_normal((256, 64)).astype(np.float32), device=device)
    head = nn.Linear(64, 10, seed=1, device=device)
    labels = rng.integers(0, 10, 256)
    return h, head, labels, _checked(device, labels, 10)


def _want(h, head, labels):
    z = h.numpy().astype(np.float64) @ head.weight.numpy().T.astype(np.float64)
    z += head.bias.numpy()
    return z, _ce64(z, labels)[0]


def test_held_product_read_written_or_used_first(device, hot):
    """Whatever comes between the head and the cross-entropy records the product first, in
    the eager order: a read of the logits, a host write of its input or weight, another op,
    another head, a reshaped view; the values are those of the eager order."""
    h, head, labels, yt = _head(device)
    z0, want0 = _want(h, head, labels)
    # a read of the logits
    z = head(h)
    np.testing.assert_allclose(z.numpy(), z0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.cross_entropy(z, yt).item(), want0, rtol=1e-5)
    # the input written from the host after the product: the product read the old values
    z = head(h)
    old = h.numpy()
    h.copy_from_numpy(old * 2.0)
    loss = ops.cross_entropy(z, yt)
    np.testing.assert_allclose(z.numpy(), z0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss.item(), want0, rtol=1e-5)
    h.copy_from_numpy(old)
    # the weight written in place on the device (a kernel: AdamW) after the product
    opt = optim.SGD(head.parameters(), lr=0.5)
    head.weight.grad.copy_from_numpy(np.ones((10, 64), np.float32))
    z = head(h)
    opt.step()
    np.testing.assert_allclose(z.numpy(), z0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.cross_entropy(z, yt).item(), want0, rtol=1e-5)
    z1, want1 = _want(h, head, labels)
    # another op, then another head's product, before the cross-entropy
    z = head(h)
    r = ops.relu(h)
    z2 = head(r)
    np.testing.assert_allclose(ops.cross_entropy(z, yt).item(), want1, rtol=1e-5)
    want2 = _ce64(_want(r, head, labels)[0], labels)[0]
    np.testing.assert_allclose(ops.cross_entropy(z2, yt).item(), want2, rtol=1e-5)
    # a reshaped view of the logits (another shape): not claimed; the product as issued first
    labels_v = _checked(device, labels[:128] * 2, 20)
    z = head(h)
    view = z.reshape((128, 20))
    got = ops.cross_entropy(view, labels_v)
    np.testing.assert_allclose(
        got.item(), _ce64(z1.reshape(128, 20), labels[:128] * 2)[0], rtol=1e-5
    )
    np.testing.assert_allclose(z.numpy(), z1, rtol=1e-5, atol=1e-5)
    # nothing in between: claimed
    np.testing.assert_allclose(ops.cross_entropy(head(h), yt).item(), want1, rtol=1e-5)
    assert device.kernels.gpu or hot == [False] * 6 + [True]


def test_held_product_never_consumed(device, hot):
    """A held product that no cross-entropy reads: recorded at the next flush, its buffer
    never handed out meanwhile (the queue holds it), its values right."""
    h, head, labels, yt = _head(device)
    z0, _ = _want(h, head, labels)
    z = head(h)
    held = [buffer for _, buffer in device.queue.held[1]] if not device.kernels.gpu else []
    del z  # only the held command refers to its buffer now
    fresh = [pydiff.empty((256, 10), device=device) for _ in range(4)]
    assert not any(t.buffer is b for t in fresh for b in held)
    assert device.queue.held is not None or device.kernels.gpu
    z = head(h)
    device.flush()
    np.testing.assert_allclose(z.numpy(), z0, rtol=1e-5, atol=1e-5)
    z = head(h)
    np.testing.assert_allclose(ops.mse_loss(z, z).item(), 0.0)
    assert device.queue.held is None


def test_held_product_before_a_capture(device, hot):
    """A product held when a capture starts is recorded with the capture's first command,
    not into the capture: its replays run only the step's own work (fused: 5 dispatches)."""
    xb, yb = make_batch()
    layers, step = make_mlp_step(xb, yb)
    for _ in range(4):
        step()
    h, head, labels, yt = _head(pydiff.default_device())
    z0, want0 = _want(h, head, labels)
    z = head(h)
    captured = pydiff.capture(step)
    np.testing.assert_allclose(z.numpy(), z0, rtol=1e-5, atol=1e-5)
    dispatches = [c for c in captured._commands if c[0] == "dispatch"]
    assert len(dispatches) == 5  # the step's own, no head of this test
    captured.replay()
    assert _bits(*[p.numpy() for layer in layers for p in layer.parameters()]) == _steps(6)[0]


def test_held_product_taken_by_another_thread(device, hot):
    """Another thread's op records the held product first; this thread's cross-entropy then
    runs its own kernel on the right logits."""
    h, head, labels, yt = _head(device)
    z0, want0 = _want(h, head, labels)
    z = head(h)
    other = threading.Thread(target=lambda: ops.relu(h).numpy())
    other.start()
    other.join()
    np.testing.assert_allclose(ops.cross_entropy(z, yt).item(), want0, rtol=1e-5)
    np.testing.assert_allclose(z.numpy(), z0, rtol=1e-5, atol=1e-5)
    assert hot[-1] is False


def test_retained_graph_second_backward_and_no_backward(device, hot):
    """The fused forward's loss and statistics serve a second backward (retain_graph), a
    loss never backpropagated, a loss read only after the backward."""
    x, w, b, labels = _data(256, 64, 10, 11)
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    want, dz = _ce64(z, labels)
    xt = pydiff.tensor(x, device=device)
    wt = pydiff.tensor(w, device=device, requires_grad=True)
    bt = pydiff.tensor(b, device=device, requires_grad=True)
    yt = _checked(device, labels, 10)
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(ops.linear(xt, wt, bt), yt)
    tape.backward(loss)
    tape.backward(loss)
    np.testing.assert_allclose(wt.grad.numpy(), 2 * dz.T @ x, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(loss.item(), want, rtol=1e-5)
    lone = ops.cross_entropy(ops.linear(xt, wt, bt), yt)  # no tape, no backward
    np.testing.assert_allclose(lone.item(), want, rtol=1e-5)
    wt.grad.zero_()
    with pydiff.Tape() as tape:  # the loss read before its backward
        loss = ops.cross_entropy(ops.linear(xt, wt, bt), yt)
    np.testing.assert_allclose(loss.item(), want, rtol=1e-5)
    tape.backward(loss, retain_graph=False)
    np.testing.assert_allclose(wt.grad.numpy(), dz.T @ x, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(bt.grad.numpy(), 3 * dz.sum(0), rtol=1e-4, atol=1e-6)
    assert hot[-3:] == [True, True, True] or device.kernels.gpu


def test_no_holding_without_deferral(monkeypatch, recorded):
    """PYDIFF_DEFER=0 (each command submitted at once): nothing is held back."""
    from pydiff import command_queue

    monkeypatch.setattr(command_queue, "DEFER", False)
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    for _ in range(4):
        recorded[0] = 0
        step()
    assert recorded[0] == 6


def _loop_with_new_batches(recorded, steps=8):
    """The MLP step with new inputs and labels copied in before each step (a training
    loop's): the dispatches of the last step, the parameters' bits, the losses."""
    xb, yb = make_batch()
    layers, step = make_mlp_step(xb, yb)
    rng = np.random.default_rng(3)
    losses = []
    for _ in range(steps):
        xb.copy_from_numpy(rng.standard_normal((256, 64)).astype(np.float32))
        yb.copy_from_numpy(rng.integers(0, 10, 256).astype(np.int32))
        recorded[0] = 0
        losses.append(step().item())
    return recorded[0], _bits(*[p.numpy() for layer in layers for p in layer.parameters()]), losses


def test_new_labels_each_step_still_fused(recorded, monkeypatch):
    """Labels copied in before each step are range-checked by a host read between the head
    and its loss: the head stays held (5 dispatches), the same bits as the two kernels."""
    count, bits, losses = _loop_with_new_batches(recorded)
    assert count == 5
    monkeypatch.setattr(head_fusion, "HOLD_HEADS", False)
    assert _loop_with_new_batches(recorded) == (6, bits, losses)


def test_labels_refused_with_a_product_held(device, hot):
    """Labels out of range, checked while the head is held: refused, and the product still
    runs in the eager order (its values right, the next op's too)."""
    h, head, labels, yt = _head(device)
    z0, want0 = _want(h, head, labels)
    bad = pydiff.tensor(np.full(256, 10, np.int32), device=device)
    z = head(h)
    with pytest.raises(ValueError, match="labels must lie in"):
        ops.cross_entropy(z, bad)
    assert device.queue.held is not None or device.kernels.gpu  # (the check read no logits)
    np.testing.assert_allclose(ops.cross_entropy(z, yt).item(), want0, rtol=1e-5)
    np.testing.assert_allclose(z.numpy(), z0, rtol=1e-5, atol=1e-5)
    assert device.kernels.gpu or hot[-1] is True


@pytest.mark.parametrize("bias, activation", [(False, None), (True, "relu"), (False, "relu")])
def test_heads_without_bias_or_with_relu(device, hot, bias, activation):
    """A head without bias, or with the relu fused (the loss of relu(x W^T + b)): fused, and
    the loss and the weight's gradient against float64 NumPy."""
    x, w, b, labels = _data(64, 16, 6, 21)
    xt = pydiff.tensor(x, device=device)
    wt = pydiff.tensor(w, device=device, requires_grad=True)
    bt = pydiff.tensor(b, device=device) if bias else None
    yt = _checked(device, labels, 6)
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(ops.linear(xt, wt, bt, activation=activation), yt)
    tape.backward(loss)
    pre = x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0.0)
    z = np.maximum(pre, 0.0) if activation else pre
    want, dz = _ce64(z, labels)
    if activation:
        dz = np.where(pre > 0, dz, 0.0)
    np.testing.assert_allclose(loss.item(), want, rtol=1e-5)
    np.testing.assert_allclose(wt.grad.numpy(), dz.T @ x, rtol=1e-4, atol=1e-6)
    assert device.kernels.gpu or hot == [True]


def test_capture_claims_only_its_own_held_product(device, hot):
    """A product held before a capture is not fused into it (a replay would recompute logits
    made outside the step): the capture records the cross-entropy's own kernel; a capture that
    ends with its head held records the product (its replays recompute the logits)."""
    h, head, labels, yt = _head(pydiff.default_device())
    z0, want0 = _want(h, head, labels)
    z = head(h)
    captured = pydiff.capture(lambda: ops.cross_entropy(z, yt))
    assert [c[0] for c in captured._commands if c[0] != "host"] == ["dispatch"]
    np.testing.assert_allclose(captured.result.item(), want0, rtol=1e-5)
    np.testing.assert_allclose(z.numpy(), z0, rtol=1e-5, atol=1e-5)
    only = pydiff.capture(lambda: head(h))  # held at the capture's end
    assert [c[0] for c in only._commands] == ["dispatch"]
    np.testing.assert_allclose(only.result.numpy(), z0, rtol=1e-5, atol=1e-5)
    h.copy_from_numpy(h.numpy() * 2.0)
    only.replay()
    np.testing.assert_allclose(
        only.result.numpy(),
        2.0 * (z0 - head.bias.numpy()) + head.bias.numpy(),
        rtol=1e-5,
        atol=1e-4,
    )
    both = pydiff.capture(lambda: ops.cross_entropy(head(h), yt))  # fused inside
    assert [c[0] for c in both._commands if c[0] != "host"] == ["dispatch"]
    h.copy_from_numpy(h.numpy() / 2.0)
    both.replay()
    np.testing.assert_allclose(both.result.item(), want0, rtol=1e-5)


def test_fused_head_labels_out_of_range_behind_the_counter_give_nan(device, hot):
    """Labels written where the host's once-per-version range check cannot see them (through
    SlangPy's own handle): the fused head's loss and those rows' gradients are NaN, as
    ce_forward makes them (breakB44), not a finite loss from logit 0 (before the merge)."""
    x, w, b, labels = _data(16, 8, 5, 6)
    xt = pydiff.tensor(x, device=device, requires_grad=True)
    wt = pydiff.tensor(w, device=device, requires_grad=True)
    bt = pydiff.tensor(b, device=device, requires_grad=True)
    yt = _checked(device, labels, 5)
    bad = labels.astype(np.int32).copy()
    bad[[3, 9]] = [5, 1 << 20]
    yt.native.copy_from_numpy(bad)  # (unseen by the version counter)
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(ops.linear(xt, wt, bt), yt)
    tape.backward(loss)
    assert hot[-1:] == [True] or device.kernels.gpu  # (the fused kernel ran)
    assert np.isnan(loss.item())
    g = xt.grad.numpy()
    assert np.isnan(g[[3, 9]]).all()
    keep = [i for i in range(16) if i not in (3, 9)]
    _, dz = _ce64(x @ w.T + b, labels)
    np.testing.assert_allclose(g[keep], (dz @ w)[keep] * 16 / 16, rtol=1e-4, atol=1e-6)


def test_numpy_labels_are_fused_too(device, hot):
    """Labels given as a NumPy array (the docs' first training example) are uploaded after the
    head was issued; the upload, of a new buffer the product neither reads nor writes, leaves
    it held, so the loss is fused as with a label tensor (twenty-fifth session)."""
    x, w, b, labels = _data(256, 64, 10, 25)
    xt, wt, bt = (pydiff.tensor(v, device=device, requires_grad=True) for v in (x, w, b))
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(ops.linear(xt, wt, bt), labels.astype(np.int64))
    tape.backward(loss)
    want, dz = _ce64(x.astype(np.float64) @ w.T.astype(np.float64) + b, labels)
    np.testing.assert_allclose(loss.item(), want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(wt.grad.numpy(), dz.T @ x.astype(np.float64), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(xt.grad.numpy(), dz @ w.astype(np.float64), rtol=1e-4, atol=1e-6)
    assert hot == [device.kernels.gpu is False]
