"""A tape's backward takes each node's ``.bwds`` call plan (``backward_plan.BackwardPlan`` run
inside the tape's backward scope), joining the tape's batch, with the zeroing policy acting
once per gradient buffer through the scope as on the full path. Before, every node took the
full path (~40 us of Python a node on lavapipe: a tape's backward cost 2.0x the same
``.bwds`` calls by hand; now 1.1x, benchmarks/bench_tape.py). Gradients are checked against
closed forms; the policy's refusals against the full path's.
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

SOURCE = """import slangpy;
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float sn(float x) { return sin(x); }
[Differentiable] float mix(float a, float b, float k) { return a * b + k * a; }
"""
XS = np.array([0.5, -1.0, 2.0, 0.25, 1.5, -0.75], np.float64)


def _module(device, tag):
    return pydiff.load_module_from_source(f"s36_tape_plans_{tag}", SOURCE, device=device)


def _step(m, x, w, k=0.5):
    """loss = sum(mix(sq(x), sn(w), k)); x and w leaves."""
    with pydiff.Tape() as tape:
        a = m.sq(x, _result="tensor")
        b = m.sn(w, _result="tensor")
        c = m.mix(a, b, k, _result="tensor")
    tape.backward(c, grad=np.ones(len(XS)), retain_graph=False)


def _want(xs, ws, k=0.5):
    a, b = xs * xs, np.sin(ws)
    return (b + k) * 2 * xs, a * np.cos(ws)


def test_training_loop_of_fresh_tapes_matches_the_closed_form(device):
    m = _module(device, "loop")
    x = pydiff.tensor(XS.astype(np.float32), device=device, requires_grad=True)
    ws = XS[::-1] * 0.7
    w = pydiff.tensor(ws.astype(np.float32), device=device, requires_grad=True)
    dx, dw = _want(XS, ws)
    for step in range(4):
        _step(m, x, w)
        np.testing.assert_allclose(x.grad.numpy(), (step + 1) * dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(w.grad.numpy(), (step + 1) * dw, rtol=1e-5, atol=1e-6)
    assert m.sq.bwds_plans and m.mix.bwds_plans  # (the nodes' plans were made and taken)
    with pydiff.zero_policy("reset"):
        for _ in range(2):
            _step(m, x, w)
            np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(w.grad.numpy(), dw, rtol=1e-5, atol=1e-6)


def test_strict_refuses_before_any_gradient_changes(device):
    """Before, the nodes ahead of the refused one (sn's, into w.grad) had already added."""
    m = _module(device, "strict")
    x = pydiff.tensor(XS.astype(np.float32), device=device, requires_grad=True)
    w = pydiff.tensor(XS.astype(np.float32), device=device, requires_grad=True)
    for _ in range(2):  # plans made, and taken
        x.zero_grad()
        w.zero_grad()
        _step(m, x, w)
    w.zero_grad()  # w is fresh, x still holds the last backward's result
    before = x.grad.numpy().copy()
    with pydiff.zero_policy("strict"), pytest.raises(pydiff.StaleGradientError, match="'x'"):
        _step(m, x, w)
    np.testing.assert_array_equal(x.grad.numpy(), before)
    np.testing.assert_array_equal(w.grad.numpy(), np.zeros(len(XS)))


def test_a_tensors_own_policy_acts_once_per_backward(device):
    """x feeds two nodes under its own RESET: zeroed before the first adds, not the second."""
    m = _module(device, "own")
    x = pydiff.tensor(XS.astype(np.float32), device=device, requires_grad=True)
    x.zero_policy = "reset"
    for _ in range(3):
        with pydiff.Tape() as tape:
            a = m.sq(x, _result="tensor")
            b = m.sn(x, _result="tensor")
            c = m.mix(a, b, 2.0, _result="tensor")
        tape.backward(c, grad=np.ones(len(XS)), retain_graph=False)
        # d/dx [x^2 sin x + 2 x^2] = 2x sin x + x^2 cos x + 4x
        want = 2 * XS * np.sin(XS) + XS**2 * np.cos(XS) + 4 * XS
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)


def test_large_nodes_and_mixed_sizes(device):
    """Past the generated kernels' threshold the node declines to the full path's kernel."""
    m = _module(device, "large")
    rng = np.random.default_rng(3)
    for n in (5000, 16, 5000):
        xs = rng.uniform(-2, 2, n)
        x = pydiff.tensor(xs.astype(np.float32), device=device, requires_grad=True)
        w = pydiff.tensor(xs[::-1].astype(np.float32), device=device, requires_grad=True)
        for _ in range(2):
            x.zero_grad()
            w.zero_grad()
            with pydiff.Tape() as tape:
                c = m.mix(m.sq(x, _result="tensor"), m.sn(w, _result="tensor"), 0.5,
                          _result="tensor")  # fmt: skip
            tape.backward(c, grad=np.ones(n), retain_graph=False)
            dx, dw = _want(xs, xs[::-1])
            np.testing.assert_allclose(x.grad.numpy(), dx, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(w.grad.numpy(), dw, rtol=2e-5, atol=2e-5)


def test_a_stale_input_is_still_refused_on_the_planned_node(device):
    m = _module(device, "stale")
    x = pydiff.tensor(XS.astype(np.float32), device=device, requires_grad=True)
    w = pydiff.tensor(XS.astype(np.float32), device=device, requires_grad=True)
    _step(m, x, w)
    _step(m, x, w)
    with pydiff.Tape() as tape:
        a = m.sq(x, _result="tensor")
    x.copy_from_numpy(np.zeros(len(XS)))  # the value sq read is gone
    with pytest.raises(pydiff.StaleInputError, match="overwritten by"):
        tape.backward(a, grad=np.ones(len(XS)))
    # the same class as an explicit .bwds raises (before: RuntimeError here, ValueError there)
    b = m.sq(w)
    w.fill(3.0)
    with pytest.raises(pydiff.StaleInputError, match="wrote it since") as caught:
        m.sq.bwds(w, _result=b.with_grads(ones=True))
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RuntimeError)


def test_forward_calls_on_a_tape_take_their_plan(device):
    """A tape's forward calls (a new result) take the layout's plan and are recorded: before,
    each took the full path on a tape (~2x the cost of a planned call)."""
    m = _module(device, "fwd")
    x = pydiff.tensor(XS.astype(np.float32), device=device, requires_grad=True)
    for step in range(3):
        x.zero_grad()
        with pydiff.Tape() as tape:
            h = x
            for _ in range(3):
                h = m.sn(m.sq(h), _result="tensor")
        np.testing.assert_allclose(
            h.numpy(), np.sin(np.sin(np.sin(XS**2) ** 2) ** 2), rtol=1e-5, atol=1e-6
        )
        tape.backward(h, grad=np.ones(len(XS)), retain_graph=False)
        # d/dx of f(f(f(x))) with f(u) = sin(u^2): f'(u) = 2u cos(u^2)
        u1 = np.sin(XS**2)
        u2 = np.sin(u1**2)
        want = 2 * u2 * np.cos(u2**2) * 2 * u1 * np.cos(u1**2) * 2 * XS * np.cos(XS**2)
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=2e-5, atol=1e-6)
    assert any(p.on_tape for p in m.sq.plans.values())


def test_a_planned_call_on_constants_is_a_constant_to_the_tape(device):
    m = _module(device, "const")
    c = pydiff.tensor(XS.astype(np.float32), device=device)  # no gradient wanted
    m.sq(c)
    m.sq(c)  # (the plan)
    with pydiff.Tape() as tape:
        y = m.sq(c)
    np.testing.assert_allclose(y.numpy(), XS**2, rtol=1e-6)
    with pytest.raises(RuntimeError, match="no input requiring a gradient|constant"):
        tape.backward(y, grad=np.ones(len(XS)))


def test_a_narrowed_result_is_refused_on_a_tape_after_plain_calls(device):
    m = _module(device, "narrow")
    x = pydiff.tensor(XS.astype(np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((len(XS),), dtype="half", device=device)
    m.sq(x, _result=y)
    m.sq(x, _result=y)  # planned off a tape, where a half result is allowed
    with pydiff.Tape(), pytest.raises((ValueError, TypeError), match="half|narrow"):
        m.sq(x, _result=y)


@pytest.mark.parametrize("form", [{}, {"_result": "tensor"}])
def test_first_call_of_a_layout_has_the_bits_of_later_ones(device, form):
    """Deterministic mode promises the same bits run to run: the first call of a layout made
    its new result in SlangPy's own buffer, the later (planned) ones from pydiff's pool, on
    which a linear layer takes another kernel: the first step's values and gradients differed
    from the second's in the last bit (off a tape before; on a tape once tape calls took
    plans)."""
    from pydiff import nn, ops

    m = _module(device, f"bits{len(form)}")
    rng = np.random.default_rng(7)
    X = pydiff.tensor(rng.standard_normal((32, 16)).astype(np.float32), device=device,
                      requires_grad=True)  # fmt: skip
    Y = pydiff.tensor(rng.integers(0, 4, 32).astype(np.int32), device=device)
    layer = nn.Linear(16, 4, seed=1, device=device)
    values, grads = [], []
    with pydiff.deterministic():
        for _ in range(3):
            values.append(layer(m.sn(X, **form)).numpy())  # off a tape
            X.zero_grad()
            for p in layer.parameters():
                p.zero_grad()
            with pydiff.Tape() as tape:
                loss = ops.cross_entropy(layer(m.sn(X, **form)), Y)
            tape.backward(loss, retain_graph=False)
            grads.append((X.grad.numpy(), layer.parameters()[0].grad.numpy()))
    for v, (gx, gw) in zip(values[1:], grads[1:]):
        np.testing.assert_array_equal(v, values[0])
        np.testing.assert_array_equal(gx, grads[0][0])
        np.testing.assert_array_equal(gw, grads[0][1])
