"""Session 41, silent: gaps where a gradient could come out silently wrong or a refused
backward could change gradients, each checked against closed forms or NumPy."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff.tensor import Tensor

X = np.array([0.3, -0.7, 1.1])


# --- 1. copy_'s mark through copy_values and the host (non-contiguous) copy_ -------------


def test_copy_values_of_copied_values_keeps_the_mark(device):
    # Before: y.copy_(x); w = y.copy_values() (or of y * 2, no tape records it): grad of
    # (w * x).sum() came out x (resp. 2x), where a copy_ that carried the gradient gives 2x
    # (resp. 4x): silently wrong. Now w stays marked and the recorded call is refused,
    # as a copy_ of y is.
    for scale in (None, 2.0):

        def f(x, scale=scale):
            y = pydiff.zeros((3,), device=device)
            y.copy_(x)
            w = (y if scale is None else y * scale).copy_values()
            return (w * x).sum()

        with pytest.raises(RuntimeError, match=r"copy_ of values with a gradient path"):
            pydiff.grad(f)(X)

    # a snapshot of a tensor that requires a gradient stays a constant on purpose
    np.testing.assert_allclose(pydiff.grad(lambda x: (x.copy_values() * x).sum())(X), X)


def test_host_copy_of_a_non_contiguous_source_keeps_the_mark(device):
    # Before: a.copy_(values with a gradient path); w.copy_(v) for a strided view v of a
    # (copied by the host): w lost the mark, and grad of (w * x).sum() came out x where 2x
    # is right. Now w is marked as a device copy_ would be, and refused.
    def f(x):
        a = pydiff.zeros((3, 2), device=device)
        a.copy_(x.reshape((3, 1)) * pydiff.ones((3, 2), device=device))
        v = Tensor(a.native.view(shape=(3,), strides=(2,)), a.device, storage=a.storage)
        assert not v.native.is_contiguous()
        w = pydiff.zeros((3,), device=device)
        w.copy_(v)
        np.testing.assert_allclose(w.numpy(), X, rtol=1e-6)
        return (w * x).sum()

    with pytest.raises(RuntimeError, match=r"copy_ of values with a gradient path"):
        pydiff.grad(f)(X)

    def g(x):  # the same from a detached source: a constant on purpose, exact
        a = pydiff.tensor(np.repeat(X[:, None], 2, 1), device=device)
        v = Tensor(a.native.view(shape=(3,), strides=(2,)), a.device, storage=a.storage)
        w = pydiff.zeros((3,), device=device)
        w.copy_(v)
        return (w * x).sum()

    np.testing.assert_allclose(pydiff.grad(g)(X), X, rtol=1e-6)


# --- 4/5. a Function's backward: what it wrote before raising; float64 past float32 -------


class _Returns(pydiff.Function):
    ret = None

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        if _Returns.ret == "target":  # adds through grad_target, then raises
            t = ctx.grad_target(0)
            t.copy_from_numpy(t.numpy() + 100.0)
            raise ValueError("the user's backward fails")
        return _Returns.ret() if callable(_Returns.ret) else _Returns.ret


def _backward_of(device, ret, policy="accumulate"):
    _Returns.ret = ret
    x = pydiff.tensor(X.astype(np.float32), device=device, requires_grad=True)
    x.grad.copy_from_numpy(np.ones(3, np.float32))
    with pydiff.zero_policy(policy):
        with pydiff.Tape() as tape:
            s = (_Returns.apply(x * 3.0) + x).sum()
        tape.backward(s)
    return x


@pytest.mark.parametrize("policy", ["reset", "accumulate", "strict"])
def test_function_backward_raising_after_grad_target_changes_nothing(device, policy):
    # A Function's backward runs only inside a tape's backward, which keeps and puts back
    # every gradient it wrote, grad_target's included (checked: x.grad stays all ones).
    with pytest.raises(ValueError, match="the user's backward fails"):
        _backward_of(device, "target", policy)
    x = pydiff.tensor(X.astype(np.float32), device=device, requires_grad=True)
    x.grad.copy_from_numpy(np.ones(3, np.float32))
    _Returns.ret = "target"
    with pydiff.Tape() as tape:
        s = (_Returns.apply(x * 3.0) + x).sum()
    with pytest.raises(ValueError):
        tape.backward(s)
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(3, np.float32))


@pytest.mark.parametrize("kind", ["array", "double tensor"])
def test_function_backward_beyond_float32_is_refused(device, kind):
    # Before: a float64 gradient of 1e39 (finite) for a float input was added as inf, without
    # a word (PyTorch casts it to the input's dtype the same way). Now refused, naming the
    # Function and the input, and no gradient changes.
    big = np.array([1e39, 1.0, 2.0])

    def ret():
        return big if kind == "array" else pydiff.tensor(big, dtype="double", device=device)

    _Returns.ret = ret
    x = pydiff.tensor(X.astype(np.float32), device=device, requires_grad=True)
    x.grad.copy_from_numpy(np.ones(3, np.float32))
    with pydiff.Tape() as tape:
        s = (_Returns.apply(x * 3.0) + x).sum()
    with pytest.raises(OverflowError, match=r"_Returns\.backward\(\) gradient 0 .*input 0.*1e\+39"):
        tape.backward(s)
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(3, np.float32))
    # values in range, and an inf or NaN returned as such, are added as they are (x.grad:
    # 1 before, + 1 through "+ x", + 3 * the returned gradient through "x * 3.0")
    x = _backward_of(device, lambda: np.array([1e30, np.inf, np.nan]))
    got = x.grad.numpy()
    np.testing.assert_allclose(got[0], 3e30, rtol=1e-6)
    assert got[1] == np.inf and np.isnan(got[2])


# --- 3. a GradientFlowWarning made an error, on the generated kernels' path ---------------

NODIFF = """
[Differentiable] float f(float a, no_diff float b) { return a * a * b; }
"""


def test_gradient_flow_warning_as_error_zeroes_nothing(device):
    # Before: under RESET, a .bwds taking the generated kernels' path zeroed a.grad, then
    # the warning for b (no_diff, requires a gradient) raised under -W error: a.grad lost
    # its 5s. Now every warning comes before any zeroing: a refused call changes nothing.
    import warnings

    import pydiff.generated as generated

    m = pydiff.load_module_from_source("s41_nodiff", NODIFF, device=device)
    n = generated.MIN_ELEMENTS
    a_np = np.linspace(-1, 1, n).astype(np.float32)
    a = pydiff.tensor(a_np, device=device, requires_grad=True)
    b = pydiff.tensor(np.full(n, 3.0, np.float32), device=device, requires_grad=True)
    a.grad.copy_from_numpy(np.full(n, 5.0, np.float32))
    up = pydiff.tensor(np.ones(n, np.float32), device=device)
    y = pydiff.zeros((n,), device=device).with_grads(grad_in=up)
    with pydiff.zero_policy("reset"), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(pydiff.GradientFlowWarning, match="parameter 'b' is no_diff"):
            m.f.bwds(a, b, _result=y)
    np.testing.assert_array_equal(a.grad.numpy(), np.full(n, 5.0, np.float32))
    with pydiff.zero_policy("reset"), warnings.catch_warnings():  # warned: runs, reset first
        warnings.simplefilter("ignore")
        m.f.bwds(a, b, _result=y)
    np.testing.assert_allclose(a.grad.numpy(), 6.0 * a_np, rtol=1e-6)


# --- 6. a gradient buffer read as data under RESET ---------------------------------------

MUL = """
[Differentiable] float f(float a, float b) { return a * b; }
"""


@pytest.mark.parametrize("where", ["eager", "tape", "tape after a plan"])
def test_gradient_buffer_read_as_data_under_reset_is_refused(device, where):
    # Before: f.bwds(x, x.grad) under RESET zeroed x.grad, then read it as b: x.grad came
    # out 0 where d(a*b)/da = b = 2 (the value passed) is right. Now refused (ValueError
    # naming both parameters) with x.grad unchanged; a copy gives the right 2.
    m = pydiff.load_module_from_source("s41_mul", MUL, device=device)
    n = 8
    x = pydiff.tensor(np.linspace(-1, 1, n), device=device, requires_grad=True)
    x.grad.copy_from_numpy(np.full(n, 2.0, np.float32))
    up = pydiff.zeros((n,), device=device).with_grads(
        grad_in=pydiff.tensor(np.ones(n, np.float32), device=device)
    )
    if where == "tape after a plan":  # a plan of this layout (ACCUMULATE): 2 + 2
        m.f.bwds(x, x.grad.copy_values(), _result=up)
        np.testing.assert_array_equal(x.grad.numpy(), np.full(n, 4.0, np.float32))
        x.grad.copy_from_numpy(np.full(n, 2.0, np.float32))
        m.f.bwds(x, x.grad.copy_values(), _result=up)
        x.grad.copy_from_numpy(np.full(n, 2.0, np.float32))

    def call(b):
        if where == "eager":
            m.f.bwds(x, b, _result=up)
            return

        class F(pydiff.Function):
            @staticmethod
            def forward(ctx, z):
                return z * 1.0

            @staticmethod
            def backward(ctx, g):
                m.f.bwds(x, b() if callable(b) else b, _result=up)
                return (None,)

        with pydiff.Tape() as tape:
            s = F.apply(x * 1.0).sum()
        tape.backward(s)

    with pydiff.zero_policy("reset"):
        with pytest.raises(ValueError, match=r"parameter 'b' reads the gradient buffer of .*'a'"):
            call(x.grad)
        np.testing.assert_array_equal(x.grad.numpy(), np.full(n, 2.0, np.float32))
        call(x.grad.copy_values())
    np.testing.assert_array_equal(x.grad.numpy(), np.full(n, 2.0, np.float32))


# --- 2. may refuse: per (function, argument layout) --------------------------------------

LOOP = """import slangpy;
[Differentiable] float prod2(float a, float b) { return a * b; }
[Differentiable]
float wsum(float a, IDiffTensor<float, 1> x)
{
    float acc = 0.0;
    int n = x.shape[0];
    [MaxIters(8)]
    for (int k = 0; k < n; k++) acc += a * x[k] * x[k];
    return acc;
}
"""


def test_a_layout_refused_after_another_ran_leaves_every_gradient(device):
    # Before: wsum's backward ran for x of length 8, so a tape of it was taken as one that
    # refuses nothing; for x of length 16 (past MaxIters(8)) its backward is refused after
    # prod2's entry added into w.grad: w.grad came out 12.02.. where 9 (unchanged) is right.
    # Now what ran is known per argument layout: the tape keeps the buffers and puts them back.
    m = pydiff.load_module_from_source("s41_loop", LOOP, device=device)
    a = np.linspace(0.5, 2.0, 4)
    at = pydiff.tensor(a, device=device)

    def step(k):
        xs = np.linspace(-1.0, 1.0, k)
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        w = pydiff.tensor(np.full(4, 3.0), device=device, requires_grad=True)
        w.grad.copy_from_numpy(np.full(4, 9.0, np.float32))
        with pydiff.Tape() as tape:
            h = m.wsum(at, x, _result="tensor")
            y = m.prod2(w, h, _result="tensor")
        return tape, y, w, xs

    tape, y, w, xs = step(8)
    tape.backward(y, grad=np.ones(4, np.float32))
    np.testing.assert_allclose(w.grad.numpy(), 9.0 + a * np.sum(xs * xs), rtol=1e-5)
    tape, y, w, _ = step(16)
    with pytest.raises(ValueError, match=r"runs 16 times.*MaxIters\(8\)"):
        tape.backward(y, grad=np.ones(4, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(4, 9.0, np.float32))
