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


def _held_head(monkeypatch, rows, n_in, classes, seed, build_fused):
    """A head's product held back over stale pooled buffers of its shape (three warm-up
    calls, junk freed), with range-checked labels: ``(dev, inputs, head, labels, logits)``.
    ``build_fused``: the warm-up builds the fused kernel too."""
    from pydiff import nn, ops_reduce, products

    monkeypatch.setattr(products, "HOT_SHAPE_USES", 1)
    monkeypatch.setattr(products, "FIXED_SHAPES_MAX", 1 << 10)
    dev = pydiff.default_device()
    dev.kernels.plans.clear()
    rng = np.random.default_rng(seed)
    hn = rng.standard_normal((rows, n_in)).astype(np.float32)
    h = pydiff.tensor(hn, device=dev)
    head = nn.Linear(n_in, classes, seed=seed - 4, device=dev)
    yt = pydiff.tensor(rng.integers(0, classes, rows).astype(np.int32), device=dev)
    ops_reduce._check_labels(yt, (rows, classes))
    warm = pydiff.tensor(np.full((rows, n_in), 3.0, np.float32), device=dev)
    for _ in range(3):  # (other values in the pool's buffers of this shape)
        head(warm).numpy()
        if build_fused:
            ops.cross_entropy(head(warm), yt).item()
    junk = [pydiff.tensor(np.full((rows, classes), 7.0, np.float32), device=dev) for _ in range(3)]
    del junk
    z = head(h)
    assert dev.kernels.gpu or dev.queue.held is not None
    return dev, hn, head, yt, z


def _interrupted_then_logits(monkeypatch, z, yt, hn, head):
    """The cross-entropy interrupted (the patches in force), then the patches undone and the
    logits checked against float64 NumPy: the held product ran, in order."""
    try:
        ops.cross_entropy(z, yt)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    want = hn.astype(np.float64) @ head.weight.numpy().T.astype(np.float64) + head.bias.numpy()
    np.testing.assert_allclose(z.numpy(), want, rtol=1e-5, atol=1e-5)


def test_interrupt_building_the_fused_kernel_keeps_the_held_product(monkeypatch):
    """A KeyboardInterrupt (or a compile error) while the fused kernel is built, the first
    time a head's shape meets a cross-entropy: the product had already been claimed, so it was
    never recorded and the logits kept the pooled buffer's old values. Now built before the
    claim: the product stays held and its values are right."""
    from pydiff import head_fusion

    _, hn, head, yt, z = _held_head(monkeypatch, 64, 16, 5, 7, build_fused=False)

    def interrupted(self, kernels):
        raise KeyboardInterrupt

    monkeypatch.setattr(head_fusion.HeadPlan, "fused_kernel", interrupted)
    _interrupted_then_logits(monkeypatch, z, yt, hn, head)


def test_error_recording_the_fused_kernel_keeps_the_product(monkeypatch):
    """An exception (a KeyboardInterrupt) while the claimed product's fused kernel is recorded:
    the product was neither recorded nor held any more, so the logits kept stale values. Now
    the product is recorded as issued before the error propagates."""
    from pydiff import kernels

    _, hn, head, yt, z = _held_head(monkeypatch, 32, 8, 6, 8, build_fused=True)
    real = kernels.KernelCache.dispatch_split

    def interrupted(self, kernel, threads, buffers, *args, **kwargs):
        if any(name == "labels" for name, _ in buffers):
            raise KeyboardInterrupt
        return real(self, kernel, threads, buffers, *args, **kwargs)

    monkeypatch.setattr(kernels.KernelCache, "dispatch_split", interrupted)
    _interrupted_then_logits(monkeypatch, z, yt, hn, head)
