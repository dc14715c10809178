"""Tape.backward(retain_graph=False): the same gradients as a retained recording (checked
against NumPy), the recording forgotten (a second backward refused, loudly), and the step's
intermediates freed by reference counting alone, without Python's cycle collector."""

import gc
import weakref

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim

XS = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


def test_released_backward_gives_the_closed_form_gradient_and_forgets(device, load):
    """c = x^2 * sin(x), both ways; then every later backward over the recording raises."""
    m = load("chain", device)
    up = np.array([1.0, 2.0, -1.0, 0.5])
    xd = XS.astype(np.float64)
    expected = up * (2 * xd * np.sin(xd) + xd**2 * np.cos(xd))
    for retain in (True, False):
        x = pydiff.tensor(XS, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            a = m.square(x, _result="tensor")
            c = m.times(a, m.sine(x, _result="tensor"), _result="tensor")
        tape.backward(c, grad=up, retain_graph=retain)
        np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-5)
        assert len(tape) == (3 if retain else 0)
    with pytest.raises(RuntimeError, match=r"forgotten by an earlier backward\(retain_graph"):
        tape.backward(c, grad=up)
    with pytest.raises(RuntimeError, match="forgotten"):
        c.backward(grad=up)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-5)  # untouched by the refusals
    with tape:  # the same tape records anew
        y = m.square(x, _result="tensor")
    x.zero_grad()
    y.backward(grad=np.ones(4), retain_graph=False)
    np.testing.assert_allclose(x.grad.numpy(), 2 * xd, rtol=1e-6)


def _step_parts(device, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((32, 8)).astype(np.float32)
    Y = rng.integers(0, 4, 32).astype(np.int32)
    layers = [nn.Linear(8, 16, seed=0, activation="relu", device=device)]
    layers.append(nn.Linear(16, 4, seed=1, device=device))
    return X, Y, layers


def _numpy_grads(X, Y, W1, b1, W2, b2):
    """Cross-entropy (mean) of linear -> relu -> linear: gradients in float64."""
    h = np.maximum(X @ W1.T + b1, 0)
    z = h @ W2.T + b2
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = (p - np.eye(z.shape[1])[Y]) / len(Y)
    dh = (dz @ W2) * (h > 0)
    return dh.T @ X, dh.sum(0), dz.T @ h, dz.sum(0)


def test_a_released_training_step_frees_its_intermediates_without_the_collector(device):
    X, Y, layers = _step_parts(device)
    xb, yb = pydiff.tensor(X, device=device), pydiff.tensor(Y, device=device)
    params = [p for layer in layers for p in layer.parameters()]
    ref = [p.numpy().astype(np.float64) for p in params]
    gc.disable()  # anything freed below is freed by reference counting
    try:
        for retain in (True, False):
            for p in params:
                p.zero_grad()
            with pydiff.Tape() as tape:
                h = layers[0](xb)
                loss = ops.cross_entropy(layers[1](h), yb)
            tape.backward(loss, retain_graph=retain)
            for p, want in zip(params, _numpy_grads(X, Y, *ref)):
                np.testing.assert_allclose(p.grad.numpy(), want, rtol=2e-4, atol=1e-6)
            watched = weakref.ref(h)
            del h, loss, tape
            if not retain:  # (retained, the tape and its tensors form a cycle)
                assert watched() is None
    finally:
        gc.enable()
        gc.collect()


def test_a_captured_step_with_a_released_tape_replays_like_eager_steps(device):
    X, Y, eager_layers = _step_parts(device)
    _, _, captured_layers = _step_parts(device)
    xb, yb = pydiff.tensor(X, device=device), pydiff.tensor(Y, device=device)

    def make_step(layers):
        opt = optim.AdamW([p for layer in layers for p in layer.parameters()], lr=1e-2)

        def step():
            opt.zero_grad()
            with pydiff.Tape() as tape:
                loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
            tape.backward(loss, retain_graph=False)
            opt.step()
            return loss

        return step

    eager, to_capture = make_step(eager_layers), make_step(captured_layers)
    to_capture()  # the optimizer's state is made on its first step
    captured = pydiff.capture(to_capture)  # capturing runs the step: two steps taken
    eager(), eager()
    for _ in range(3):
        got, want = captured.replay().numpy(), eager().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(eager_layers, captured_layers):
        for p, q in zip(a.parameters(), b.parameters()):
            np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-5, atol=1e-7)


def test_zero_after_a_release_reaches_a_parameter_read_through_a_view(device):
    """The recording touched w only through a temporary view: tape.zero() after the release
    still zeroes w.grad (the view shares it), so the next step's gradient is not doubled."""
    w = pydiff.tensor(np.arange(4.0, dtype=np.float32), device=device, requires_grad=True)
    tape = pydiff.Tape()
    for _ in range(2):
        with tape:
            loss = ops.sum(ops.mul(w.reshape(2, 2), w.reshape(2, 2)))
        tape.backward(loss, retain_graph=False)
        np.testing.assert_allclose(w.grad.numpy(), 2 * np.arange(4.0), rtol=1e-6)  # d/dw w.w
        tape.zero()
        np.testing.assert_array_equal(w.grad.numpy(), 0.0)


def test_a_leaf_made_from_a_forgotten_result_does_not_warn(device):
    """pydiff.grad at a result of a released step takes a fresh leaf sharing its values: a
    leaf on purpose, so no GradientFlowWarning; reading the result itself on a new tape
    warns (its gradient stops there)."""
    import warnings

    x = pydiff.tensor(XS, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        h = ops.mul(x, x)
        loss = ops.sum(h)
    tape.backward(loss, retain_graph=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydiff.GradientFlowWarning)
        g = pydiff.grad(lambda t: ops.sum(ops.mul(t, t)))(h)
    np.testing.assert_allclose(g.numpy(), 2 * XS.astype(np.float64) ** 2, rtol=1e-6)
    with pytest.warns(pydiff.GradientFlowWarning, match="forgotten"):
        with pydiff.Tape():
            ops.sum(ops.mul(h, h))


def test_reading_a_result_of_another_live_tape_warns_and_chaining_by_hand_is_exact(device):
    """A second tape reading a result the first tape recorded (still live, not forgotten)
    cannot carry the gradient into the first tape's calls: it warns where the read is
    recorded, once per line, and the chain by hand gives the closed form d(3 x^2)/dx = 6x.
    A detached read, the same tape, and a leaf do not warn."""
    import warnings

    xd = XS.astype(np.float64)
    x = pydiff.tensor(XS, device=device, requires_grad=True)
    with pydiff.Tape() as first:
        h = ops.mul(x, x)
    with pytest.warns(pydiff.GradientFlowWarning, match="recorded on another tape"):
        with pydiff.Tape() as second:
            loss = ops.sum(ops.mul(h, pydiff.tensor(np.full(4, 3.0, np.float32), device=device)))
    second.backward(loss)
    np.testing.assert_allclose(h.grad.numpy(), np.full(4, 3.0))
    np.testing.assert_array_equal(x.grad.numpy(), 0.0)  # stopped at h, as the warning says
    first.backward(h, grad=h.grad)
    np.testing.assert_allclose(x.grad.numpy(), 6 * xd, rtol=1e-6)

    with warnings.catch_warnings():
        warnings.simplefilter("error", pydiff.GradientFlowWarning)
        with pydiff.Tape():
            ops.sum(ops.mul(h.detach(), h.detach()))  # a constant on purpose
        with first:  # the tape that made h records on: one graph
            again = ops.sum(ops.mul(h, h))
        first.backward(again)
        with pydiff.Tape():
            ops.sum(ops.mul(x, x))  # a leaf
        with pydiff.Tape(reads_other_tapes=True):  # chained by hand, said so
            ops.sum(ops.mul(h, h))
        leaf = h.detach().requires_grad_(True)  # a new leaf sharing h's storage: on purpose
        with pydiff.Tape() as third:
            total = ops.sum(ops.mul(leaf, leaf))
        third.backward(total)
        np.testing.assert_allclose(leaf.grad.numpy(), 2 * xd**2, rtol=1e-6)
    with pytest.warns(pydiff.GradientFlowWarning, match="recorded on another tape"):
        with pydiff.Tape():
            ops.sum(h.reshape(2, 2))  # a view of the result: the same cut


def test_reentering_a_tape_that_kept_its_recording_warns(device):
    """A tape reused step after step with the default retain_graph=True keeps every step's
    recording: entering it again after a backward warns (TapeReuseWarning, once per line);
    the documented ways to reuse one do not, and the gradients are unchanged."""
    import warnings

    if device.type != "vulkan":
        pytest.skip("warned once per line and process: checked once, on Vulkan")
    w = pydiff.tensor(XS, device=device, requires_grad=True)

    def steps(tape, n, **kw):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(n):
                w.zero_grad()
                with tape:
                    loss = ops.sum(ops.mul(w, w))
                tape.backward(loss, **kw)
                np.testing.assert_allclose(w.grad.numpy(), 2 * XS, rtol=1e-6)
        return [x for x in seen if issubclass(x.category, pydiff.TapeReuseWarning)]

    tape = pydiff.Tape()
    got = steps(tape, 3)
    assert len(got) == 1 and "retain_graph=False" in str(got[0].message)
    assert got[0].filename == __file__  # the user's `with tape:` line
    assert len(tape) == 6  # three steps' recordings, kept
    assert not steps(pydiff.Tape(), 3, retain_graph=False)
    tape = pydiff.Tape()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            tape.reset()  # forgets: the new recording is alone
            with tape:
                loss = ops.sum(ops.mul(w, w))
            tape.backward(loss)
        tape = pydiff.Tape()
        with tape:  # two blocks, one backward: one recording, no backward ran over it yet
            a = ops.mul(w, w)
        with tape:
            loss = ops.sum(a)
        tape.backward(loss)
    assert not [x for x in seen if issubclass(x.category, pydiff.TapeReuseWarning)]
