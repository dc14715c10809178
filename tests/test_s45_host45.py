"""The eager training step's host work trimmed (twenty-fifth session, helper ``host45``):
new float tensors and gradient buffers know they are float4-ready without reading their
layout from SlangPy, a 0-d result and its gradient keep the pool's ``(1,)`` tensor (no two
views), ``Tape._needed`` and ``ctx._input_index`` take plain loops and a fast path. Each
test against an independent reference (the layout read from SlangPy itself, float64 NumPy,
closed forms), and each refusal on the changed paths still fires.
"""

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import ops


def _layout_from_slangpy(device, t):
    # what pydiff's fast kernels need, read from SlangPy field by field
    n = t.native
    desc = n.storage.desc
    return (
        n.dtype.full_name == "float"
        and n.offset == 0
        and n.is_contiguous()
        and desc.struct_size == 16
        and (desc.format == spy.Format.rgba32_float or not device.typed_loads)
    )


@pytest.mark.parametrize("shape", [(), (1,), (3,), (5, 7), (256, 64)])
def test_new_tensors_float4_flag_is_their_layout(device, shape):
    made = [
        pydiff.empty(shape, device=device),
        pydiff.zeros(shape, device=device),
        pydiff.zeros(shape, device=device, requires_grad=True).grad,
        pydiff.zeros(shape, dtype="half", device=device, requires_grad=True).grad,
        pydiff.zeros(shape, dtype="float3", device=device, requires_grad=True).grad,
    ]
    for t in made:
        assert t.shape == shape
        assert t.float4 == _layout_from_slangpy(device, t), (t.dtype, shape)
    assert made[0].float4 and made[2].float4 and not made[3].float4 and not made[4].float4


def test_a_0d_result_and_its_gradient(device):
    # a 0-d tensor keeps a (1,) native; its values and its gradient buffer read back as 0-d
    e = pydiff.empty((), device=device)
    assert tuple(e.native.shape) == (1,) and e.shape == ()
    e.copy_from_numpy(np.array(2.5, np.float32))
    assert e.numpy().shape == () and e.numpy() == 2.5
    rng = np.random.default_rng(3)
    zv = rng.standard_normal((16, 5)).astype(np.float32)
    yv = rng.integers(0, 5, 16).astype(np.int32)
    z = pydiff.tensor(zv, device=device, requires_grad=True)
    y = pydiff.tensor(yv, device=device)
    for _ in range(2):  # the second from pooled buffers the first released
        z.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(z, y)
        tape.backward(loss, retain_graph=False)
        z64 = zv.astype(np.float64)
        p = np.exp(z64 - z64.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        want = -np.log(p[np.arange(16), yv]).mean()
        assert loss.shape == () and loss.numpy().shape == ()
        np.testing.assert_allclose(loss.numpy(), want, rtol=1e-5)
        onehot = np.eye(5)[yv]
        np.testing.assert_allclose(z.grad.numpy(), (p - onehot) / 16, rtol=1e-4, atol=1e-7)


class _Twice(pydiff.Function):
    """y = 2x, its gradient added through ``ctx.grad_target`` with the index kind given."""

    index = 0

    @staticmethod
    def forward(ctx, x):
        return ops.mul(x, 2.0)

    @staticmethod
    def backward(ctx, g):
        target = ctx.grad_target(_Twice.index)
        target.copy_from_numpy(target.numpy() + 2.0 * g.numpy())
        return None


@pytest.mark.parametrize("index", [0, np.int64(0), np.int32(0)])
def test_grad_target_takes_python_and_numpy_ints(device, index):
    xv = np.linspace(-1.0, 1.0, 8).astype(np.float32)
    x = pydiff.tensor(xv, device=device, requires_grad=True)
    _Twice.index = index
    with pydiff.Tape() as tape:
        y = _Twice.apply(x)
    tape.backward(y, grad=np.arange(8.0))
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * np.arange(8.0))  # d(2x)/dx . g


@pytest.mark.parametrize("index", [True, 1, -1, 0.0])
def test_grad_target_refuses_other_indices(device, index):
    x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
    _Twice.index = index
    with pydiff.Tape() as tape:
        y = _Twice.apply(x)
    with pytest.raises(IndexError, match=r"ctx.grad_target\(.*\): k must be the index"):
        tape.backward(y, grad=np.ones(4))


def test_backward_refuses_a_result_overwritten_by_copy_from_a_graph(device):
    # _needed: a call whose result was replaced by copy_ from values with a gradient path
    a = pydiff.tensor(np.arange(4.0, dtype=np.float32), device=device, requires_grad=True)
    b = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.mul(a, 2.0)
        z = ops.mul(y, 3.0)
        w = ops.mul(b, 5.0)
    y.copy_(w)
    with pytest.raises(RuntimeError, match="wrote were replaced by"):
        tape.backward(z, grad=np.ones(4))


def test_backward_skips_a_call_whose_result_was_filled(device):
    # _needed: a result overwritten by fill is a constant: no gradient past it
    a = pydiff.tensor(np.arange(4.0, dtype=np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.mul(a, 2.0)
        y.fill(1.0)  # (before the call that reads it: the value it reads is the constant)
        z = ops.mul(y, 3.0)
    tape.backward(z, grad=np.ones(4))
    np.testing.assert_allclose(z.numpy(), np.full(4, 3.0))
    np.testing.assert_allclose(a.grad.numpy(), np.zeros(4))  # the path through y is cut
