"""The pool's SlangPy tensor per buffer (twenty-third session, helper ``eager43``): a pooled
buffer keeps the SlangPy tensor made on it last and hands it out again for the same layout and
element type (``BufferPool.float4_tensor``), and that tensor's reference to the buffer counts
in the free test. Each test against an independent reference (NumPy, float64 NumPy, PyTorch):

- a buffer whose cached tensor a live tensor (or a handed-out ``native``) holds is never
  handed out again: values written there survive every later allocation;
- another shape or element type on the same buffer gets its own SlangPy tensor;
- ``prune`` releases buffers that only their cached tensor refers to;
- a training loop whose shapes, dtypes, in-place writes and ``requires_grad`` change between
  steps gets PyTorch's gradients every step.
"""

import gc

import numpy as np
import pytest

import pydiff
from pydiff import buffer_pool, ops


def test_the_same_slangpy_tensor_again_for_a_free_buffer(device):
    gc.collect()
    device.empty_cache()  # (free buffers of this size left by other tests: the pool's cursor
    # would hand one of those out next, not a's; fuse44 saw it fail after other test files)
    a = pydiff.empty((256, 64), device=device)
    native = a.native_view()
    first = id(native)
    del a, native
    gc.collect()
    device.flush()
    b = pydiff.empty((256, 64), device=device)
    # the cache: the very SlangPy tensor made on that buffer (a new one at 6e39294)
    assert id(b.native_view()) == first
    assert b.shape == (256, 64)


def test_a_held_tensor_is_never_reused(device):
    rng = np.random.default_rng(0)
    vals = rng.standard_normal((64, 16)).astype(np.float32)
    kept = pydiff.tensor(vals, device=device)
    keep_native = pydiff.tensor(vals * 2, device=device).native  # only its native survives
    gc.collect()
    made = []
    for _ in range(40):  # every pooled buffer of that size that is free gets taken
        t = pydiff.empty((64, 16), device=device)
        t.fill(7.0)
        made.append(t)
    np.testing.assert_array_equal(kept.numpy(), vals)
    np.testing.assert_array_equal(keep_native.to_numpy(), vals * 2)
    assert all(kept.buffer is not t.buffer for t in made)
    assert all(keep_native.storage is not t.buffer for t in made)


def test_another_layout_or_dtype_gets_its_own_tensor(device):
    pool = buffer_pool.BufferPool(device.native, device.queue)
    f, f4 = device.dtype("float"), device.dtype("float4")
    first = pool.float4_tensor((4, [4, 4], [4, 1]), f)
    buffer = id(first.storage)  # (holding the buffer would keep it in use; the pool keeps it)
    del first
    again = pool.float4_tensor((4, [4, 4], [4, 1]), f)
    assert id(again.storage) == buffer and list(again.shape) == [4, 4]
    del again
    for layout, dtype, shape in [
        ((4, [16], [1]), f, [16]),  # the same float4s as (16,) floats
        ((4, [4], [1]), f4, [4]),  # as four float4s
        ((4, [2, 8], [8, 1]), f, [2, 8]),
    ]:
        t = pool.float4_tensor(layout, dtype)
        assert id(t.storage) == buffer  # (the one buffer, free again)
        assert list(t.shape) == shape and t.dtype is dtype
        assert list(t.strides) == layout[2]
        del t
    x = pydiff.tensor(np.arange(16, dtype=np.float32).reshape(4, 4), device=device)
    np.testing.assert_array_equal(x.numpy(), np.arange(16).reshape(4, 4))


def test_prune_releases_buffers_only_their_cached_tensor_holds(device, monkeypatch):
    pool = buffer_pool.BufferPool(device.native, device.queue)
    layout = (4, [16], [1])
    dtype = device.dtype("float")
    held = [pool.float4_tensor(layout, dtype) for _ in range(3)]
    assert pool.sizes()["buffers"] == 3
    pool.prune()
    assert pool.sizes()["buffers"] == 3  # all in use
    again = held[0]
    del held
    pool.prune()
    assert pool.sizes()["buffers"] == 1  # the two free ones released, cached tensors and all
    assert pool.float4_tensor(layout, dtype) is not again  # (in use: a new buffer)
    del again
    pool.prune()
    assert pool.sizes() == {"buffers": 0, "bytes": 0}


def _torch_step(torch, params, x, y, relu):
    tp = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params]
    h = torch.nn.functional.linear(torch.tensor(x, dtype=torch.float64), tp[0], tp[1])
    if relu:
        h = torch.relu(h)
    z = torch.nn.functional.linear(h, tp[2], tp[3])
    loss = torch.nn.functional.cross_entropy(z, torch.tensor(y, dtype=torch.long))
    loss.backward()
    return float(loss.detach()), [t.grad.numpy() for t in tp]


@pytest.mark.parametrize("retain", [False, True])
def test_changing_steps_get_torch_gradients(device, retain):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    n_in, n_hid, n_out = 64, 64, 10
    params = [
        rng.standard_normal((n_hid, n_in)).astype(np.float32) * 0.1,
        rng.standard_normal(n_hid).astype(np.float32) * 0.1,
        rng.standard_normal((n_out, n_hid)).astype(np.float32) * 0.1,
        rng.standard_normal(n_out).astype(np.float32) * 0.1,
    ]
    ps = [pydiff.tensor(p, device=device, requires_grad=True) for p in params]
    # batch size, relu or not, a param frozen, x written in place between steps
    plans = [(256, True, None), (256, True, None), (128, False, None), (256, True, 3)]
    plans += [(256, True, None), (64, True, 1), (256, True, None), (256, True, None)]
    x = pydiff.tensor(rng.standard_normal((256, n_in)).astype(np.float32), device=device)
    for step, (batch, relu, frozen) in enumerate(plans):
        for k, p in enumerate(ps):
            p.requires_grad_(k != frozen)
            if k != frozen:
                p.zero_grad()
        xv = rng.standard_normal((batch, n_in)).astype(np.float32)
        if batch == 256:
            x.copy_from_numpy(xv)  # in place: the same tensor, new values
            xb = x
        else:
            xb = pydiff.tensor(xv, device=device)
        yv = rng.integers(0, n_out, batch).astype(np.int32)
        yb = pydiff.tensor(yv, device=device)
        with pydiff.Tape() as tape:
            h = ops.linear(xb, ps[0], ps[1], activation="relu" if relu else None)
            loss = ops.cross_entropy(ops.linear(h, ps[2], ps[3]), yb)
        tape.backward(loss, retain_graph=retain)
        want_loss, want = _torch_step(torch, params, xv, yv, relu)
        np.testing.assert_allclose(float(loss.numpy()), want_loss, rtol=1e-5, atol=1e-6)
        for k, p in enumerate(ps):
            if k == frozen:
                assert not p.requires_grad
                continue
            np.testing.assert_allclose(p.grad.numpy(), want[k], rtol=1e-4, atol=1e-5)
        del h, loss, tape
        if step % 3 == 2:
            gc.collect()
