"""pydiff.capture: a replayed step computes what the same step run eagerly computes (new data,
changing hyper-parameters, optimizer step counts), and what cannot be replayed is refused."""

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim

RNG = np.random.default_rng(5)


def _batches(n, batch=32, features=8, classes=3):
    return [
        (
            RNG.standard_normal((batch, features)).astype(np.float32),
            RNG.integers(0, classes, batch).astype(np.int32),
        )
        for _ in range(n)
    ]


def _mlp(device, make_opt):
    layers = [
        nn.Linear(8, 16, seed=0, activation="relu", device=device),
        nn.Linear(16, 3, seed=1, device=device),
    ]
    return layers, make_opt([p for layer in layers for p in layer.parameters()])


def _step_fn(layers, opt, xb, yb):
    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss)
        opt.step()
        return loss

    return step


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
        lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["adamw", "sgd"],
)
def test_replay_matches_eager_steps_with_new_batches(device, make_opt):
    data = _batches(6)
    eager_layers, eager_opt = _mlp(device, make_opt)
    xb, yb = pydiff.tensor(data[0][0], device=device), pydiff.tensor(data[0][1], device=device)
    eager = _step_fn(eager_layers, eager_opt, xb, yb)
    expected = []
    for x, y in data:
        xb.copy_from_numpy(x)
        yb.copy_from_numpy(y)
        expected.append(eager().item())

    layers, opt = _mlp(device, make_opt)
    xc, yc = pydiff.tensor(data[0][0], device=device), pydiff.tensor(data[0][1], device=device)
    step = _step_fn(layers, opt, xc, yc)
    got = [step().item()]  # an ordinary first step creates the optimizer state
    xc.copy_from_numpy(data[1][0])
    yc.copy_from_numpy(data[1][1])
    captured = pydiff.capture(step)  # the second step, run and recorded
    got.append(captured.result.item())
    for x, y in data[2:]:
        clutter = [
            pydiff.zeros((32, 16), device=device) for _ in range(4)
        ]  # new tensors between replays
        xc.copy_from_numpy(x)
        yc.copy_from_numpy(y)
        got.append(captured.replay().item())
        del clutter
    np.testing.assert_array_equal(got, expected)  # same kernels, same order: the same bits
    for a, b in zip(layers + [None], eager_layers + [None]):
        if a is not None:
            np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())
    assert opt.step_count == eager_opt.step_count == len(data)


def test_replay_reads_changed_hyper_parameters(device):
    """The learning rate is read at every replay: a schedule set between replays applies."""
    X = RNG.standard_normal((8, 4)).astype(np.float32)
    W0 = RNG.standard_normal((4, 4)).astype(np.float32)
    G = RNG.standard_normal((8, 4)).astype(np.float32)
    x = pydiff.tensor(X, device=device)
    w = pydiff.tensor(W0, device=device, requires_grad=True)
    opt = optim.SGD([w], lr=0.1)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            y = ops.linear(x, w)
        tape.backward(y, grad=G)  # dL/dW = G^T X, a constant
        opt.step()

    step()
    captured = pydiff.capture(step)
    dw = G.astype(np.float64).T @ X
    expected = W0 - 0.1 * dw - 0.1 * dw
    for lr in (0.05, 0.01):
        opt.defaults["lr"] = lr
        captured.replay()
        expected = expected - lr * dw
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_replay_rechecks_changed_labels(device):
    layers, opt = _mlp(device, lambda ps: optim.AdamW(ps))
    ((x, y),) = _batches(1)
    xb, yb = pydiff.tensor(x, device=device), pydiff.tensor(y, device=device)
    step = _step_fn(layers, opt, xb, yb)
    step()
    captured = pydiff.capture(step)
    yb.copy_from_numpy(np.full(32, 7, np.int32))  # class 7 of 3
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        captured.replay()


def test_what_cannot_be_replayed_is_refused(device, load):
    m = load("calls", device)
    x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
    with pytest.raises(pydiff.CaptureError, match=r"pydiff.op_exp through SlangPy"):
        pydiff.capture(lambda: ops.exp(x))  # (m.square(x) captures: test_s39_capuser)
    v = pydiff.tensor(np.ones(4, np.float32), device=device)
    with pytest.raises(pydiff.CaptureError, match=r"calls.scale_inout .*no call plan"):
        pydiff.capture(lambda: m.scale_inout(2.0, v))
    with pytest.raises(pydiff.CaptureError, match=r"host write"):
        pydiff.capture(lambda: ops.relu(pydiff.tensor(np.ones(4, np.float32), device=device)))
    w = pydiff.tensor(np.ones((2, 4), np.float32), device=device, requires_grad=True)
    opt = optim.AdamW([w])
    with pytest.raises(pydiff.CaptureError, match=r"run one step before capturing"):
        pydiff.capture(opt.step)
    with pytest.raises(pydiff.CaptureError, match=r"no GPU work"):
        pydiff.capture(lambda: None)
    with pytest.raises(pydiff.CaptureError, match=r"nested"):
        pydiff.capture(lambda: pydiff.capture(lambda: ops.relu(x)))
    captured = pydiff.capture(lambda: ops.relu(x))
    with pytest.raises(pydiff.CaptureError, match=r"replay\(\) inside a capture"):
        pydiff.capture(captured.replay)
    np.testing.assert_array_equal(captured.replay().numpy(), np.ones(4, np.float32))


@pytest.mark.parametrize(
    "m, k, n, captures", [(4, 7, 8, True), (5, 7, 12, True), (4, 8, 6, False), (7, 8, 8, True)]
)
def test_matmul_shapes_that_capture(device, m, k, n, captures):
    """matmul(a, b) runs on pydiff's kernels (and so captures) when b's columns are a
    multiple of 4; otherwise the capture is refused with a message that says so. The
    replay equals the eager step (NumPy's product as the independent reference)."""
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    A, B = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n))
    a = pydiff.tensor(A, device=device, requires_grad=True)
    b = pydiff.tensor(B.astype(np.float32), device=device, requires_grad=True)
    opt = optim.SGD([a, b], lr=0.0)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            y = ops.matmul(a, b)
        tape.backward(y, grad=np.ones((m, n), np.float32))
        opt.step()
        return y

    step()
    if not captures:
        with pytest.raises(pydiff.CaptureError, match=r"b's columns are"):
            pydiff.capture(step)
        return
    captured = pydiff.capture(step)
    captured.replay()
    y = captured.result.numpy()
    np.testing.assert_allclose(y, A.astype(np.float64) @ B.astype(np.float32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.grad.numpy(), np.ones((m, n)) @ B.T, rtol=1e-5, atol=1e-5)


def test_linear_with_in_features_not_a_multiple_of_4_is_refused_clearly(device):
    layer = nn.Linear(7, 13, seed=0, device=device)
    opt = optim.AdamW(layer.parameters(), lr=1e-3)
    x = pydiff.tensor(np.ones((4, 7), np.float32), device=device)
    labels = pydiff.tensor(np.zeros(4, np.int32), device=device)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layer(x), labels)
        tape.backward(loss)
        opt.step()

    step()
    with pytest.raises(pydiff.CaptureError, match=r"in_features is a multiple of 4"):
        pydiff.capture(step)


def test_replay_matches_eager_with_the_backward_unbatched(device, monkeypatch):
    """PYDIFF_TAPE_BATCH=0 (each backward kernel submitted on its own, for measurements) made
    capture refuse the step: its seed became a host write. A captured backward is batched
    anyway; the eager steps, unbatched, give the same bits."""
    import pydiff.tape as tape_module

    monkeypatch.setattr(tape_module, "_BATCH", False)
    test_replay_matches_eager_steps_with_new_batches(
        device, lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.01)
    )
