"""Session 51, break51: a demanding user at the ops, optimizers and transforms.

Every reference is independent: NumPy float64 closed forms, central finite differences in
float64, or PyTorch float64 (skipped where PyTorch is not installed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import pydiff
from pydiff import head_fusion, ops, ops_reduce, products

# float64 references meet log(0) and the like on purpose
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SUBNORMALS = np.array([1e-45, 1e-42, 3e-40, 1e-39, 5e-39, 1.1e-38], np.float32)


@pytest.mark.parametrize("n", [6, 5000])  # a small call and a generated kernel's
def test_log_of_subnormal_inputs(n):
    """log of a subnormal float32 read the exponent field as a normal number's: log(1e-45)
    was -88.03 (float64: -103.28), log(1e-39) -87.95 (-89.80)."""
    x = np.resize(SUBNORMALS, n)
    t = pydiff.tensor(x, requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.log(t)
        loss = ops.sum(y)
    tape.backward(loss)
    want = np.log(x.astype(np.float64))
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)
    # the derivative 1/x, rounded to float32 (inf where it passes 3.4e38)
    np.testing.assert_array_equal(t.grad.numpy(), (1.0 / x.astype(np.float64)).astype(np.float32))
    value, slope = pydiff.jvp(ops.log, (pydiff.tensor(x),), (np.ones(n, np.float32),))
    np.testing.assert_allclose(value.numpy(), want, rtol=1e-6)


def test_log_near_the_smallest_normal_is_unchanged():
    x = np.array([1.17549435e-38, 1.2e-38, 2e-38, 1e-30, 0.25, 3.0], np.float32)
    got = ops.log(pydiff.tensor(x)).numpy()
    np.testing.assert_allclose(got, np.log(x.astype(np.float64)), rtol=1e-6)
    assert ops.log(pydiff.tensor(np.float32([0.0]))).numpy()[0] == -np.inf


@pytest.mark.parametrize(
    "labels, kind",
    [
        (["a", "b"], TypeError),
        (np.array([1 + 0j, 2]), TypeError),
        ([None, 1], TypeError),
        (np.array([1, 2], dtype=object), TypeError),
        ([[1], [2, 3]], ValueError),
    ],
)
def test_cross_entropy_labels_that_are_not_indices_are_named(labels, kind):
    """Text, complex, None and ragged labels raised NumPy's own errors ("ufunc 'isfinite' not
    supported for the input types", "inhomogeneous shape"), not one naming the labels."""
    z = pydiff.tensor(np.float32([[1, 2, 3], [0, 0, 0]]))
    with pytest.raises(kind, match="cross_entropy: labels"):
        ops.cross_entropy(z, labels)


@pytest.mark.parametrize("x", [np.ones((2, 3), np.float32), 1.5])
def test_linear_names_the_shapes_it_takes_for_x(x):
    """A NumPy x or a 0-d tensor was told "x must be a 2-D float tensor", though linear takes
    (in,) and (..., in) as PyTorch does."""
    w = pydiff.tensor(np.ones((2, 3), np.float32))
    arg = pydiff.tensor(np.float32(x)) if isinstance(x, float) else x
    with pytest.raises(ValueError, match=r"x must be a float tensor of shape \(in,\) or"):
        ops.linear(arg, w)


@pytest.mark.parametrize("exponent", [float("inf"), float("nan"), np.float64(-np.inf)])
def test_power_by_a_non_finite_exponent_is_refused_by_name(exponent):
    """x ** inf raised Python's "cannot convert float infinity to integer" (OverflowError),
    x ** nan "cannot convert float NaN to integer", from inside pydiff."""
    x = pydiff.tensor(np.float32([1.0, 2.0]))
    with pytest.raises(NotImplementedError, match=r"x \*\* -?(inf|nan): pydiff has integer"):
        x**exponent


@pytest.mark.parametrize("batch", [12, 100, 200])
def test_fused_head_loss_has_the_two_kernels_bits_for_any_batch(monkeypatch, batch):
    """The classifier head's fused forward divided the summed loss by the constant batch size,
    which lavapipe's compiler turned into a product with 1/B: for batches not a power of two
    the loss was often one bit off ce_forward's (48 rows: 2.28539705 for 2.28539681), so the
    loss a training loop reported depended on fusion (two threads training: run to run)."""
    kernels = pydiff.default_device().kernels
    monkeypatch.setattr(products, "HOT_SHAPE_USES", 1)
    monkeypatch.setattr(products, "FIXED_SHAPES_MAX", 1 << 10)
    fused: list[bool] = []
    real = ops_reduce.with_cross_entropy
    monkeypatch.setattr(
        ops_reduce, "with_cross_entropy", lambda *a: fused.append(real(*a)) or fused[-1]
    )
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 64)).astype(np.float32)
    w = (rng.standard_normal((10, 64)) / 8).astype(np.float32)
    labels = rng.integers(0, 10, batch)
    xt, wt = pydiff.tensor(x), pydiff.tensor(w)
    losses = []
    for hold in (True, False):
        monkeypatch.setattr(head_fusion, "HOLD_HEADS", hold)
        kernels.fixed_shapes.clear(), kernels.shape_uses.clear(), kernels.plans.clear()
        losses.append(ops.cross_entropy(ops.linear(xt, wt), labels).item())
    if not kernels.gpu:
        assert fused == [True, False]
    assert losses[0] == losses[1]
    z = x.astype(np.float64) @ w.T.astype(np.float64)
    m = z.max(axis=1)
    want = np.mean(m + np.log(np.exp(z - m[:, None]).sum(axis=1)) - z[np.arange(batch), labels])
    np.testing.assert_allclose(losses[0], want, rtol=2e-6)


def test_fused_head_backward_has_the_two_kernels_bits_for_any_upstream(monkeypatch):
    """The classifier head's one-kernel backward scaled by upstream / B with B a constant (a
    hot batch size), made a product with 1/B: with an upstream gradient other than 1 (a
    weighted loss) dx, dW and db differed from the two kernels' in their last bits (48 rows,
    0.3: up to 2e-8 in dW)."""
    monkeypatch.setattr(products, "HOT_SHAPE_USES", 1)
    monkeypatch.setattr(products, "FIXED_SHAPES_MAX", 1 << 10)
    rng = np.random.default_rng(48)
    x = rng.standard_normal((48, 64)).astype(np.float32)
    w = (rng.standard_normal((10, 64)) / 8).astype(np.float32)
    b = rng.standard_normal(10).astype(np.float32)
    labels = rng.integers(0, 10, 48)

    def step():
        xt, wt, bt = (pydiff.tensor(v, requires_grad=True) for v in (x, w, b))
        with pydiff.Tape() as tape:
            loss = ops.mul(ops.cross_entropy(ops.linear(xt, wt, bt), labels), 0.3)
        tape.backward(loss)
        return [t.grad.numpy() for t in (xt, wt, bt)]

    done: list[bool] = []
    wrapped = {
        cls: (lambda f: lambda *a: done.append(f(*a)) or done[-1])(fuse)
        for cls, fuse in ops_reduce.CE_PRODUCER_FUSIONS.items()
    }
    monkeypatch.setattr(ops_reduce, "CE_PRODUCER_FUSIONS", wrapped)
    fused = step()
    if not pydiff.default_device().kernels.gpu:
        assert done == [True]
    monkeypatch.setattr(ops_reduce, "CE_PRODUCER_FUSIONS", {})  # the two kernels
    apart = step()
    for a, c in zip(fused, apart):
        np.testing.assert_array_equal(a, c)
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(48), labels] -= 1.0
    dz = 0.3 * p / 48
    np.testing.assert_allclose(fused[1], dz.T @ x.astype(np.float64), rtol=1e-4, atol=1e-7)


def test_sum_is_the_exact_sum_rounded_once_up_to_a_chunk():
    """ops.sum adds in double: up to 256 elements (one chunk) the result is the exact sum
    (math.fsum) rounded to float32 once; past it, within 2^-24 sum|x| per pass (two here)."""
    rng = np.random.default_rng(51)
    for n in (3, 8, 9, 255, 256, 257, 4097):
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
        got = ops.sum(pydiff.tensor(x)).item()
        exact = math.fsum(x.astype(np.float64))
        if n <= 256:
            assert got == float(np.float32(exact)), n
        else:
            assert abs(got - exact) <= 2 * 2.0**-24 * np.abs(x.astype(np.float64)).sum(), n
