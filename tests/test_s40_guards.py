"""A refused call changes nothing; a replay honours the modes an eager step would.

- Under the RESET zeroing policy a ``.bwds`` zeroes each gradient buffer as it binds the
  parameter. A call refused after that (a later argument that does not broadcast, a
  ``_result`` of the wrong kind, a raw SlangPy tensor) must leave every gradient as it was:
  the buffers it zeroed are kept first and put back (pydiff.bwds_binding).
- A step captured with deterministic mode off and replayed with it on would run kernels
  deterministic mode refuses to record: replay() refuses, naming the mode.

Values against closed forms and NumPy, never against pydiff's own output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import slangpy as spy

import pydiff
from refused_calls import AlwaysRaises, N, bad_broadcast, fresh_module, upstream, with_grad

SOURCE = """
[Differentiable] float prod2(float a, float b) { return a * b; }
[Differentiable] float cube(float a) { return a * a * a; }
"""


@pytest.fixture
def mod(device):
    return fresh_module(device, "s40_guards", SOURCE)


def _parts(device):
    a = np.arange(1, N + 1, dtype=np.float32)
    b = np.arange(2, N + 2, dtype=np.float32)
    x, w = with_grad(device, a, 7.0), with_grad(device, b, 9.0)
    return a, b, x, w, upstream(device)


def _on_other_device(device):  # a later argument pydiff refuses as it binds it
    other = pydiff.create_device(device.type, include_paths=[str(Path(__file__).parent)])
    assert other is not device
    return with_grad(other, np.arange(N), 5.0)


BAD_LATER = {
    "broadcast": bad_broadcast,
    "other device": _on_other_device,
    "raw slangpy tensor": lambda device: spy.Tensor.from_numpy(
        device.native, np.ones(N, np.float32)
    ),
}


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
@pytest.mark.parametrize("bad", sorted(BAD_LATER))
def test_bwds_refused_after_binding_leaves_gradients(device, mod, policy, bad):
    a, b, x, w, y = _parts(device)
    marks = [(t.grad.storage.version, t.grad.storage.holds_result_of) for t in (x, w, y)]
    with pydiff.zero_policy(policy):
        with pytest.raises((ValueError, TypeError)):
            mod.prod2.bwds(x, BAD_LATER[bad](device), _result=y)
    assert [(t.grad.storage.version, t.grad.storage.holds_result_of) for t in (x, w, y)] == marks
    np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(N, 9.0, np.float32))
    np.testing.assert_array_equal(y.grad.numpy(), np.ones(N, np.float32))
    with pydiff.zero_policy(policy):  # a valid call afterwards: d(ab)/da = b, d/db = a
        mod.prod2.bwds(x, w, _result=y)
    base_x, base_w = (0.0, 0.0) if policy == "reset" else (7.0, 9.0)
    np.testing.assert_allclose(x.grad.numpy(), base_x + b, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), base_w + a, rtol=1e-6)


@pytest.mark.parametrize("result", ["numpy", "string"])
def test_bwds_refused_result_under_reset_leaves_gradients(device, mod, result):
    a, b, x, w, _ = _parts(device)
    bad = np.ones(N, np.float32) if result == "numpy" else "tensor"
    with pydiff.zero_policy("reset"):
        with pytest.raises((TypeError, ValueError)):
            mod.prod2.bwds(x, w, _result=bad)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(N, 9.0, np.float32))


def test_bwds_refused_under_tensor_reset_policy(device, mod):
    """The tensor's own policy (``x.zero_policy = "reset"``) under a global ACCUMULATE."""
    a, b, x, w, y = _parts(device)
    x.zero_policy = "reset"
    with pytest.raises(ValueError, match="broadcast"):
        mod.prod2.bwds(x, bad_broadcast(device), _result=y)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
    mod.prod2.bwds(x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), b, rtol=1e-6)


# --- deterministic mode at replay ---------------------------------------------------------


def test_bwds_captured_without_deterministic_mode_refuses_replay_in_it(device, mod):
    """cube's backward given one tensor twice (``prod2(x, x)`` = x^2): captured with the mode
    off, the recorded kernel adds both parameters' gradients into x's one buffer; the mode
    sums them apart (and refuses to capture .bwds). Replayed in the mode: refused, naming
    it, nothing run; with the mode off again it replays: d(x^2)/dx = 2x per replay."""
    xs = np.linspace(0.5, 1.5, 16).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    out = upstream(device, 16)

    def step():
        mod.prod2(x, x, _result=out)
        mod.prod2.bwds(x, x, _result=out)

    captured = pydiff.capture(step)
    got = x.grad.numpy().copy()
    np.testing.assert_allclose(got, 2 * xs.astype(np.float64), rtol=1e-6)
    with pydiff.deterministic():
        with pytest.raises(pydiff.CaptureError, match="deterministic mode is on"):
            captured.replay()
    np.testing.assert_array_equal(x.grad.numpy(), got)  # nothing ran
    pydiff.set_deterministic(True)
    try:
        with pytest.raises(pydiff.CaptureError, match="deterministic mode"):
            captured.replay()
    finally:
        pydiff.set_deterministic(False)
    captured.replay()  # the mode off, as at the capture
    np.testing.assert_allclose(x.grad.numpy(), 4 * xs.astype(np.float64), rtol=1e-6)


def test_tape_bwds_captured_without_deterministic_mode_refuses_replay_in_it(device, mod):
    xs = np.linspace(0.5, 1.5, 16).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)

    def step():
        with pydiff.Tape() as tape:
            y = mod.cube(x, _result="tensor")
        tape.backward(y, grad=np.ones(16, np.float32), retain_graph=False)

    step()  # (eager once: the layouts' plans)
    x.grad.zero_()
    captured = pydiff.capture(step)
    np.testing.assert_allclose(x.grad.numpy(), 3 * xs.astype(np.float64) ** 2, rtol=1e-6)
    with pydiff.deterministic():
        with pytest.raises(pydiff.CaptureError, match="deterministic mode is on"):
            captured.replay()
    captured.replay()
    np.testing.assert_allclose(x.grad.numpy(), 6 * xs.astype(np.float64) ** 2, rtol=1e-6)


def _linear_step(device, det: bool):
    from pydiff import nn, ops

    rng = np.random.default_rng(40)
    X = rng.standard_normal((8, 4)).astype(np.float32)
    Y = rng.integers(0, 3, 8).astype(np.int32)
    layer = nn.Linear(4, 3, seed=0, device=device)
    xb, yb = pydiff.tensor(X, device=device), pydiff.tensor(Y, device=device)

    def step():
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layer(xb), yb)
        tape.backward(loss, retain_graph=False)

    step()
    layer.weight.zero_grad()
    with pydiff.deterministic(det):
        captured = pydiff.capture(step)
    W, b = layer.weight.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)
    z = X.astype(np.float64) @ W.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = ((p - np.eye(3)[Y]) / len(Y)).T @ X.astype(np.float64)
    return layer, captured, g


@pytest.mark.parametrize("det_at_capture", [False, True])
def test_ops_step_replays_whatever_the_mode(device, det_at_capture):
    """pydiff's ops take the same kernels (no atomics, fixed order) in either mode: a step of
    them replays under the other mode too (the weight's gradient adds once per run)."""
    layer, captured, g = _linear_step(device, det_at_capture)
    with pydiff.deterministic(not det_at_capture):
        captured.replay()
    np.testing.assert_allclose(layer.weight.grad.numpy(), 2 * g, rtol=1e-4, atol=1e-6)


# --- a tape's backward refused part-way --------------------------------------------------


class _BadShape(pydiff.Function):
    """Input 0's gradient fine, input 1's of the wrong shape: refused."""

    @staticmethod
    def forward(ctx, a, b):
        return pydiff.tensor(a.numpy() * b.numpy(), device=a.device)

    @staticmethod
    def backward(ctx, g):
        return np.ones(N, np.float32), np.ones(N - 1, np.float32)


@pytest.mark.parametrize("policy", ["accumulate", "reset"])
def test_function_backward_refused_for_one_input_adds_to_none(device, policy):
    """All of a Function's gradients are checked before any is added: input 1's wrong shape
    leaves input 0's gradient as it was (it was added, or RESET zeroed it)."""
    a, _, x, w, _ = _parts(device)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            y = _BadShape.apply(x, w)
        with pytest.raises(RuntimeError, match="gradient 1 has shape"):
            tape.backward(y, grad=np.ones(N, np.float32))
    np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(N, 9.0, np.float32))


FORWARD_ONLY = """
[Differentiable] float prod2(float a, float b) { return a * b; }
[ForwardDifferentiable] float fsq(float a) { return a * a; }
"""


@pytest.mark.parametrize("policy", ["accumulate", "reset"])
@pytest.mark.parametrize("refuser", ["user Function", "forward-only shader"])
def test_tape_backward_refused_part_way_leaves_every_gradient(device, policy, refuser):
    """h = refuser(x); y = x * h. The backward runs y's entry first (adding x's and h's
    gradients; RESET zeroing x's before), then h's, which refuses: every gradient is put back
    (x's leaf gradient, the intermediate h's, the seed). Then a backward without the refuser
    gives d(x * 2x)/dx = 4x."""
    m = fresh_module(device, "s40_fwdonly", FORWARD_ONLY)
    xs = np.arange(1, N + 1, dtype=np.float32)
    x = with_grad(device, xs, 7.0)
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            h = AlwaysRaises.apply(x) if refuser == "user Function" else m.fsq(x, _result="tensor")
            y = m.prod2(x, h, _result="tensor")
        with pytest.raises((ValueError, TypeError)):
            tape.backward(y, grad=np.ones(N, np.float32))
        np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
        with pydiff.Tape() as tape:
            h = m.prod2(x, 2.0, _result="tensor")
            y = m.prod2(x, h, _result="tensor")
        tape.backward(y, grad=np.ones(N, np.float32))
    base = 0.0 if policy == "reset" else 7.0
    np.testing.assert_allclose(x.grad.numpy(), base + 4 * xs.astype(np.float64), rtol=1e-6)


@pytest.mark.parametrize("ran_before", [False, True])
def test_capture_refused_inside_tape_backward_leaves_every_gradient(device, ran_before):
    """A captured Tape.backward whose entry has no call plan for its layout is refused part-way
    (CaptureError: run the step eagerly first), after y's entry added into w's gradient: put
    back, whether the function's backward never ran or ran for another layout."""
    m = fresh_module(device, "s40_capref", FORWARD_ONLY)
    n = 16
    x = with_grad(device, np.arange(1, n + 1), 7.0)
    w = with_grad(device, np.full(n, 2.0), 9.0)
    other = with_grad(device, np.ones(n), 0.0)
    with pydiff.Tape() as tape:  # (prod2's backward ran: its layout (n,) has a plan)
        z = m.prod2(other, other, _result="tensor")
    tape.backward(z, grad=np.ones(n, np.float32))
    sq = fresh_module(device, "s40_capsq", "[Differentiable] float sq1(float a) { return a * a; }")
    if ran_before:  # another layout's .bwds: the function's backward compiles
        small = with_grad(device, np.ones(8), 0.0)
        sq.sq1.bwds(small, _result=upstream(device, 8))

    def step():
        with pydiff.Tape() as tape:
            h = sq.sq1(x, _result="tensor")
            y = m.prod2(h, w, _result="tensor")
        tape.backward(y, grad=np.ones(n, np.float32), retain_graph=False)

    with pytest.raises(pydiff.CaptureError, match="sq1.bwds"):
        pydiff.capture(step)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(n, 7.0, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(n, 9.0, np.float32))
    step()  # eagerly: dL/dw = x^2, dL/dx = 2 x w
    xs = np.arange(1, n + 1, dtype=np.float64)
    np.testing.assert_allclose(w.grad.numpy(), 9.0 + xs**2, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 7.0 + 4 * xs, rtol=1e-6)


GRID = """import slangpy;
[Differentiable]
void gsq(int idx, IDiffTensor<float, 1> x, IDiffTensor<float, 1> w, IWDiffTensor<float, 1> y)
{ y[idx] = w[idx] * x[idx] * x[idx]; }
"""


@pytest.mark.parametrize("bad", ["other device", "raw slangpy tensor"])
def test_grid_bwds_refused_under_reset_leaves_gradients(device, bad):
    """A call over a grid (whose kernel may be pydiff's own) keeps the buffers RESET zeroes
    instead of holding the zeroing back: the same promise."""
    m = fresh_module(device, "s40_grid", GRID)
    xs = np.arange(1, N + 1, dtype=np.float32)
    x = with_grad(device, xs, 7.0)
    y = with_grad(device, np.zeros(N), 1.0)
    with pydiff.zero_policy("reset"):
        with pytest.raises((ValueError, TypeError)):
            m.gsq.bwds(spy.grid((N,)), x, BAD_LATER[bad](device), y)
        np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
        w = with_grad(device, np.full(N, 3.0), 9.0)
        m.gsq.bwds(spy.grid((N,)), x, w, y)  # d(w x^2)/dx = 2 w x, d/dw = x^2
    np.testing.assert_allclose(x.grad.numpy(), 6.0 * xs, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), xs.astype(np.float64) ** 2, rtol=1e-6)


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
def test_forward_only_bwds_refused_leaves_gradients(device, policy):
    """Slang refuses the backward of a [ForwardDifferentiable]-only function when SlangPy
    builds the call, after RESET would have zeroed x's gradient: it stays as it was."""
    m = fresh_module(device, "s40_fo", FORWARD_ONLY)
    x = with_grad(device, np.arange(1, N + 1), 7.0)
    y = with_grad(device, np.zeros(N), 1.0)
    with pydiff.zero_policy(policy):
        for _ in range(2):  # (the second refusal: the kept TypeError, before SlangPy)
            with pytest.raises(TypeError, match="cannot differentiate fsq backward"):
                m.fsq.bwds(x, _result=y)
            np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))


def test_a_tape_of_ops_keeps_no_gradient_copies(device, monkeypatch):
    """pydiff's ops refuse nothing part-way: a training step's tape of them copies no
    gradient buffer (the cost stays with backwards that may refuse)."""
    from pydiff import grad_restore

    def refuse(self, grad):
        raise AssertionError("a gradient buffer was kept")

    from pydiff import nn, ops

    monkeypatch.setattr(grad_restore.GradSnapshot, "keep", refuse)
    rng = np.random.default_rng(41)
    X = rng.standard_normal((8, 4)).astype(np.float32)
    Y = rng.integers(0, 3, 8).astype(np.int32)
    layer = nn.Linear(4, 3, seed=0, device=device)
    xb, yb = pydiff.tensor(X, device=device), pydiff.tensor(Y, device=device)
    W, b = layer.weight.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)
    for policy in ("accumulate", "reset"):
        layer.weight.zero_grad()
        with pydiff.zero_policy(policy), pydiff.Tape() as tape:
            loss = ops.cross_entropy(layer(xb), yb)
        with pydiff.zero_policy(policy):
            tape.backward(loss, retain_graph=False)
        z = X.astype(np.float64) @ W.T + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = ((p - np.eye(3)[Y]) / len(Y)).T @ X.astype(np.float64)
        np.testing.assert_allclose(layer.weight.grad.numpy(), g, rtol=1e-4, atol=1e-6)
