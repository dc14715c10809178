"""Gradient buffers a Function's outputs get on a tape are zeroed when first read or bound,
or by the tape's backward in its own command list (``requires_grad_(zero_later=True)``):
whichever comes first, nobody sees the buffer's earlier contents."""

import numpy as np

import pydiff


class _Twice(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        return pydiff.tensor(2.0 * x.numpy(), device=x.device)

    @staticmethod
    def backward(ctx, g):
        return 2.0 * g.numpy()


def _dirty_pool(device, n):
    # Buffers of this size holding non-zeros, released to the pool: the next allocations of
    # the size reuse them.
    junk = [pydiff.tensor(np.full(n, 7.0, np.float32), device=device) for _ in range(4)]
    device.flush()
    del junk


def test_output_gradient_reads_zeros_before_any_backward(device):
    x = pydiff.tensor(np.arange(8, dtype=np.float32), device=device, requires_grad=True)
    _dirty_pool(device, 8)
    with pydiff.Tape():
        y = _Twice.apply(x)
    assert y.requires_grad
    np.testing.assert_array_equal(y.grad.numpy(), np.zeros(8, np.float32))


def test_output_gradient_bound_by_a_call_is_zeroed_first(device):
    m = pydiff.load_module_from_source(
        "zero_later_sq", "[Differentiable] float sq(float x) { return x * x; }", device=device
    )
    x = pydiff.tensor(np.arange(8, dtype=np.float32), device=device, requires_grad=True)
    _dirty_pool(device, 8)
    with pydiff.Tape():
        y = _Twice.apply(x)
    # .bwds adds into y's gradient buffer (y is read): it must start from zero.
    z = pydiff.zeros((8,), device=device).with_grads(ones=True)
    m.sq.bwds(y, _result=z)
    np.testing.assert_allclose(y.grad.numpy(), 2 * 2 * np.arange(8))


def test_tape_backward_after_zero_later(device):
    xs = np.arange(8, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    for _ in range(3):  # buffers of earlier steps back in the pool, with their contents
        x.zero_grad()
        with pydiff.Tape() as tape:
            y = _Twice.apply(x)
        tape.backward(y, grad=np.ones(8, np.float32))
        np.testing.assert_allclose(x.grad.numpy(), np.full(8, 2.0))


def test_shader_call_result_on_a_tape_reads_zeros(device):
    m = pydiff.load_module_from_source(
        "zero_later_sq", "[Differentiable] float sq(float x) { return x * x; }", device=device
    )
    xs = np.arange(8, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    _dirty_pool(device, 8)
    with pydiff.Tape() as tape:
        y = m.sq(x, _result="tensor")
    np.testing.assert_array_equal(y.grad.numpy(), np.zeros(8, np.float32))
    tape.backward(y, grad=np.ones(8, np.float32))
    np.testing.assert_allclose(x.grad.numpy(), 2 * xs)
