"""Adversarial review of fuse44 (a classifier head's product held back for the cross-entropy)
and lazy44 (an op's output gradient buffer owed until first needed): cases that gave a wrong
value or gradient, checked against float64 NumPy."""

import copy

import numpy as np

import pydiff
from pydiff import ops


def test_copy_copy_of_an_output_with_owed_gradient_shares_it():
    """``copy.copy`` of an op's output on a tape: the copy shares the gradient buffers (the
    documented contract). With the buffer owed (lazy44) each object made its own, so the
    gradient through the copy never reached the producer's backward: x.grad was wrong by ~3."""
    rng = np.random.default_rng(5)
    xn = rng.standard_normal((8, 4)).astype(np.float32)
    x = pydiff.tensor(xn, requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.relu(x)
        yc = copy.copy(y)
        s = ops.sum(ops.mul(yc, yc))
    tape.backward(s)
    x64 = xn.astype(np.float64)
    want = 2.0 * np.maximum(x64, 0.0) * (x64 > 0)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6, atol=1e-6)
    assert y.grad is yc.grad
    np.testing.assert_allclose(y.grad.numpy(), 2.0 * np.maximum(x64, 0.0), rtol=1e-6)


def test_interrupt_building_the_fused_kernel_keeps_the_held_product(monkeypatch):
    """A KeyboardInterrupt (or a compile error) while the fused kernel is built, the first
    time a head's shape meets a cross-entropy: the product had already been claimed, so it was
    never recorded and the logits kept the pooled buffer's old values. Now built before the
    claim: the product stays held and its values are right."""
    from pydiff import head_fusion, nn, ops_reduce, products

    monkeypatch.setattr(products, "HOT_SHAPE_USES", 1)
    monkeypatch.setattr(products, "FIXED_SHAPES_MAX", 1 << 10)
    dev = pydiff.default_device()
    dev.kernels.plans.clear()
    rng = np.random.default_rng(7)
    hn = rng.standard_normal((64, 16)).astype(np.float32)
    h = pydiff.tensor(hn, device=dev)
    head = nn.Linear(16, 5, seed=3, device=dev)
    labels = rng.integers(0, 5, 64)
    yt = pydiff.tensor(labels.astype(np.int32), device=dev)
    ops_reduce._check_labels(yt, (64, 5))
    warm = pydiff.tensor(np.full((64, 16), 3.0, np.float32), device=dev)
    for _ in range(3):  # (other values in the pool's buffers of this shape)
        head(warm).numpy()
    junk = [pydiff.tensor(np.full((64, 5), 7.0, np.float32), device=dev) for _ in range(3)]
    del junk
    z = head(h)
    assert dev.kernels.gpu or dev.queue.held is not None

    def interrupted(self, kernels):
        raise KeyboardInterrupt

    monkeypatch.setattr(head_fusion.HeadPlan, "fused_kernel", interrupted)
    try:
        ops.cross_entropy(z, yt)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    want = hn.astype(np.float64) @ head.weight.numpy().T.astype(np.float64) + head.bias.numpy()
    np.testing.assert_allclose(z.numpy(), want, rtol=1e-5, atol=1e-5)


def test_error_recording_the_fused_kernel_keeps_the_product(monkeypatch):
    """An exception (a KeyboardInterrupt) while the claimed product's fused kernel is recorded:
    the product was neither recorded nor held any more, so the logits kept stale values. Now
    the product is recorded as issued before the error propagates."""
    from pydiff import kernels, nn, ops_reduce, products

    monkeypatch.setattr(products, "HOT_SHAPE_USES", 1)
    monkeypatch.setattr(products, "FIXED_SHAPES_MAX", 1 << 10)
    dev = pydiff.default_device()
    dev.kernels.plans.clear()
    rng = np.random.default_rng(8)
    hn = rng.standard_normal((32, 8)).astype(np.float32)
    h = pydiff.tensor(hn, device=dev)
    head = nn.Linear(8, 6, seed=4, device=dev)
    labels = rng.integers(0, 6, 32)
    yt = pydiff.tensor(labels.astype(np.int32), device=dev)
    ops_reduce._check_labels(yt, (32, 6))
    warm = pydiff.tensor(np.full((32, 8), 3.0, np.float32), device=dev)
    for _ in range(3):  # (other values in the pool's buffers of this shape)
        head(warm).numpy()
        ops.cross_entropy(head(warm), yt).item()  # (the fused kernel built)
    junk = [pydiff.tensor(np.full((32, 6), 7.0, np.float32), device=dev) for _ in range(3)]
    del junk
    z = head(h)
    assert dev.kernels.gpu or dev.queue.held is not None
    real = kernels.KernelCache.dispatch_split

    def interrupted(self, kernel, threads, buffers, *args, **kwargs):
        if any(name == "labels" for name, _ in buffers):
            raise KeyboardInterrupt
        return real(self, kernel, threads, buffers, *args, **kwargs)

    monkeypatch.setattr(kernels.KernelCache, "dispatch_split", interrupted)
    try:
        ops.cross_entropy(z, yt)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    want = hn.astype(np.float64) @ head.weight.numpy().T.astype(np.float64) + head.bias.numpy()
    np.testing.assert_allclose(z.numpy(), want, rtol=1e-5, atol=1e-5)
