"""Session 49, perf49b: the eager MLP step's Python trimmed (Function._run without a
suspend_recording object, refuse_nested only for containers, no forward_writes check for
pydiff's ops, producer read through the storage, generators as lists or loops). Each path
checked against float64 NumPy references (PyTorch float64 where installed)."""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim


def _mlp_reference(x, y, w1, b1, w2, b2):
    """Loss and gradients of mean cross_entropy(relu(x w1' + b1) w2' + b2, y), float64."""
    h_pre = x @ w1.T + b1
    h = np.maximum(h_pre, 0.0)
    z = h @ w2.T + b2
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y]).mean()
    dz = p.copy()
    dz[np.arange(len(y)), y] -= 1.0
    dz /= len(y)
    dh = (dz @ w2) * (h_pre > 0)
    return loss, dh.T @ x, dh.sum(0), dz.T @ h, dz.sum(0)


def _adamw_reference(p, g, m, v, t, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    """torch.optim.AdamW's update in float64 (returns p, m, v)."""
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = lr / (1 - b1**t)
    return p - step * m / (np.sqrt(v / (1 - b2**t)) + eps), m, v


def _batch(seed, rows=256, n_in=64, classes=10):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, n_in)).astype(np.float32), rng.integers(0, classes, rows)


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("widths,rows", [((64, 64, 10), 256), ((128, 64, 16), 33)])
def test_mlp_step_gradients_and_adamw_match_float64(retain, widths, rows):
    x, y = _batch(3, rows, widths[0], widths[2])
    xb, yb = pydiff.tensor(x), pydiff.tensor(y.astype(np.int32))
    l1 = nn.Linear(widths[0], widths[1], seed=0, activation="relu")
    l2 = nn.Linear(widths[1], widths[2], seed=1)
    params = [l1.weight, l1.bias, l2.weight, l2.bias]
    opt = optim.AdamW(params, lr=1e-3)
    host = [p.numpy().astype(np.float64) for p in params]
    moments = [(np.zeros_like(h), np.zeros_like(h)) for h in host]
    for t in range(1, 4):  # three steps: the second and third on the same sites again
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(l2(l1(xb)), yb)
        tape.backward(loss, retain_graph=retain)
        want_loss, *grads = _mlp_reference(x.astype(np.float64), y, *host)
        assert float(loss.numpy()) == pytest.approx(want_loss, rel=1e-5)
        for p, g in zip(params, grads):
            np.testing.assert_allclose(p.grad.numpy(), g, rtol=2e-4, atol=2e-6)
        opt.step()
        for k, g in enumerate(grads):
            g32 = params[k].grad.numpy().astype(np.float64)  # (the update of the step's grads)
            host[k], *moments[k] = _adamw_reference(host[k], g32, *moments[k], t)
            np.testing.assert_allclose(params[k].numpy(), host[k], rtol=1e-5, atol=1e-6)


def test_adamw_with_parameters_at_different_step_counts_matches_float64():
    # _hyper_four's "every step count equal" test (a list now): a parameter without a
    # gradient is skipped, so the counts differ at the next step.
    rng = np.random.default_rng(5)
    values = [rng.standard_normal(8).astype(np.float32) for _ in range(2)]
    a, b = (pydiff.tensor(v, requires_grad=True) for v in values)
    opt = optim.AdamW([a, b], lr=1e-2)
    host = [v.astype(np.float64) for v in values]
    state = [(np.zeros(8), np.zeros(8), 0) for _ in range(2)]
    for step, stepped in enumerate(([0, 1], [0], [0, 1], [0, 1])):
        opt.zero_grad()
        for k in stepped:
            g = rng.standard_normal(8).astype(np.float32)
            (a, b)[k].grad.copy_from_numpy(g)
            m, v, t = state[k]
            host[k], m, v = _adamw_reference(host[k], g.astype(np.float64), m, v, t + 1, lr=1e-2)
            state[k] = (m, v, t + 1)
        opt.step()
        for k in range(2):
            np.testing.assert_allclose((a, b)[k].numpy(), host[k], rtol=1e-5, atol=1e-6)


class _Scale(pydiff.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return ops.mul(x, s)

    @staticmethod
    def backward(ctx, g):
        return ops.mul(g, ctx.s)  # (one gradient per tensor input)


class _Raises(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        raise ValueError("forward refused on purpose")

    @staticmethod
    def backward(ctx, g):
        return g


def test_recording_resumes_after_a_forward_that_raises():
    # pause_recording/resume_recording replace `with suspend_recording()`: a forward that
    # raises leaves the tape recording, so later calls still reach the gradient.
    x = pydiff.tensor(np.arange(1.0, 5.0), requires_grad=True)
    with pydiff.Tape() as tape:
        with pytest.raises(ValueError, match="on purpose"):
            _Raises.apply(x)
        assert pydiff.tape.active_tape() is tape
        y = _Scale.apply(x, 3.0)
        loss = ops.sum(ops.mul(y, y))
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 18.0 * np.arange(1.0, 5.0), rtol=1e-6)


def test_inside_forward_nothing_is_recorded_and_outside_everything_is():
    seen = []

    class Probe(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(pydiff.tape.active_tape())
            return ops.mul(x, 2.0)

        @staticmethod
        def backward(ctx, g):
            return ops.mul(g, 2.0)

    x = pydiff.tensor(np.ones(4), requires_grad=True)
    with pydiff.Tape() as tape:
        Probe.apply(x)
        after = pydiff.tape.active_tape()
    assert seen == [None] and after is tape and len(tape) == 1


class _Pair(pydiff.Function):
    @staticmethod
    def forward(ctx, pair):
        return ops.add(pair[0], pair[1])

    @staticmethod
    def backward(ctx, g):
        return (None,)


@pytest.mark.parametrize(
    "wrap",
    [list, tuple, lambda ts: {"a": ts[0], "b": ts[1]}, collections.namedtuple("P", "a b")._make],
)
def test_a_tensor_requiring_grad_inside_a_container_is_still_refused(wrap):
    x = pydiff.tensor(np.ones(3), requires_grad=True)
    y = pydiff.tensor(np.ones(3))
    pair = wrap([x, y])
    with pydiff.Tape(), pytest.raises(TypeError, match="inside a"):
        _Pair.apply(pair if not isinstance(pair, dict) else pair)


def test_containers_without_a_tensor_requiring_grad_pass():
    x, y = pydiff.tensor(np.ones(3)), pydiff.tensor(np.full(3, 2.0))
    with pydiff.Tape():
        out = _Pair.apply([x, y])
    np.testing.assert_array_equal(out.numpy(), np.full(3, 3.0))


class _WritesInput(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        x.fill(0.0)
        return ops.mul(x, 1.0)

    @staticmethod
    def backward(ctx, g):
        return g


def test_a_users_forward_writing_its_input_on_a_tape_is_still_refused():
    # forward_writes is now skipped only for pydiff's own ops and off a tape.
    x = pydiff.tensor(np.ones(3), requires_grad=True)
    with pydiff.Tape(), pytest.raises(RuntimeError, match="wrote input 0"):
        _WritesInput.apply(x)
    _WritesInput.apply(pydiff.tensor(np.ones(3), requires_grad=True))  # off a tape: allowed


def test_grad_target_index_checks_unchanged():
    got = {}

    class Probe(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return ops.mul(x, 1.0)

        @staticmethod
        def backward(ctx, g):
            for bad in (True, -1, 1, 0.0):
                with pytest.raises(IndexError, match="must be the index"):
                    ctx.grad_target(bad)
            target = ctx.grad_target(np.int64(0))  # (a NumPy integer: the slow path)
            got["np"] = target is not None
            target.copy_from_numpy(target.numpy() + g.numpy())
            return None

    x = pydiff.tensor(np.ones(3), requires_grad=True)
    with pydiff.Tape() as tape:
        y = Probe.apply(x)
    tape.backward(y, grad=np.ones(3))
    assert got == {"np": True}
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(3))


class _HostGrad(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return ops.mul(x, x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2.0 * x.numpy() * g.numpy()  # a NumPy array: gradients() converts it


def test_a_backward_returning_numpy_is_converted():
    values = np.array([1.0, -2.0, 3.0])
    x = pydiff.tensor(values, requires_grad=True)
    with pydiff.Tape() as tape:
        y = _HostGrad.apply(x)
    tape.backward(y, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * values, rtol=1e-6)


@pytest.mark.parametrize("bias_grad", [True, False])
def test_linear_backward_with_some_inputs_not_requiring_grad(bias_grad):
    # _in_place_fits' loop over the inputs that want a gradient (a generator before).
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    g = rng.standard_normal((32, 16)).astype(np.float32)
    tx = pydiff.tensor(x, requires_grad=True)
    tw = pydiff.tensor(w, requires_grad=True)
    tb = pydiff.tensor(b, requires_grad=bias_grad)
    with pydiff.Tape() as tape:
        out = ops.linear(tx, tw, tb, activation="relu")
    tape.backward(out, grad=g)
    gm = g.astype(np.float64) * (x.astype(np.float64) @ w.T + b > 0)
    np.testing.assert_allclose(tx.grad.numpy(), gm @ w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tw.grad.numpy(), gm.T @ x, rtol=1e-4, atol=1e-4)
    if bias_grad:
        np.testing.assert_allclose(tb.grad.numpy(), gm.sum(0), rtol=1e-4, atol=1e-5)
    else:
        assert not tb.requires_grad


def test_forgotten_results_refuse_a_backward_and_warn_when_read():
    # Tape._forget and record read the producer through the storage now.
    x = pydiff.tensor(np.ones(4), requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.mul(x, 2.0)
        view = y.reshape((2, 2))
    tape.backward(y, grad=np.ones(4), retain_graph=False)
    assert y.producer is view.producer and type(y.producer).__name__ == "Forgotten"
    with pytest.raises(RuntimeError, match="forgotten"):
        tape.backward(y, grad=np.ones(4))
    with pydiff.Tape() as tape2, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        z = ops.mul(y, 3.0)
    assert any("forgotten" in str(w.message) for w in caught)
    assert z.producer is tape2


def test_zero_under_jvp_drops_the_tangent():
    # zero_ skips forward_trace.replaced outside a trace only.
    x = pydiff.tensor(np.array([1.0, 2.0, 3.0]))

    def f(x):
        y = ops.mul(x, 2.0)
        y.zero_()
        return ops.add(y, x)

    out, tangent = pydiff.jvp(f, (x,), (np.ones(3),))
    np.testing.assert_array_equal(out.numpy(), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(tangent.numpy()), np.ones(3))
    assert x.zero_() is x and np.all(x.numpy() == 0)


def test_mlp_step_matches_torch_float64_when_installed():
    torch = pytest.importorskip("torch")
    x, y = _batch(11)
    l1 = nn.Linear(64, 64, seed=0, activation="relu")
    l2 = nn.Linear(64, 10, seed=1)
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(l2(l1(pydiff.tensor(x))), pydiff.tensor(y.astype(np.int32)))
    tape.backward(loss, retain_graph=False)
    tw = [torch.tensor(p.numpy(), dtype=torch.float64, requires_grad=True) for p in
          (l1.weight, l1.bias, l2.weight, l2.bias)]  # fmt: skip
    h = torch.relu(torch.tensor(x, dtype=torch.float64) @ tw[0].T + tw[1])
    ref = torch.nn.functional.cross_entropy(h @ tw[2].T + tw[3], torch.tensor(y))
    ref.backward()
    assert float(loss.numpy()) == pytest.approx(ref.item(), rel=1e-5)
    for p, t in zip((l1.weight, l1.bias, l2.weight, l2.bias), tw):
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=2e-4, atol=2e-6)
