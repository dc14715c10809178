"""PyTorch interop and DLPack on every backend: zero-copy views on CUDA (checked by address and
by writes on either side showing in the other), host copies elsewhere; values against NumPy."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import pydiff

torch = pytest.importorskip("torch")


def on_cuda(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def torch_device(device) -> str:
    return "cuda" if on_cuda(device) else "cpu"


def test_to_torch_values_and_sharing(device):
    xs = np.linspace(-2, 2, 37).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    t = pydiff.to_torch(x)
    np.testing.assert_array_equal(t.cpu().numpy(), xs)
    if not on_cuda(device):
        assert t.device.type == "cpu"
        return
    assert t.is_cuda and t.data_ptr() == x.buffer.device_address  # zero-copy
    t.mul_(2.0)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(x.numpy(), 2 * xs)  # torch's write seen by pydiff
    y = x * 3.0  # pydiff's kernel, then a view of its result
    np.testing.assert_allclose(pydiff.to_torch(y).cpu().numpy(), 6 * xs, rtol=1e-6)


def test_to_torch_view_outlives_the_tensor(device):
    """torch's view keeps the buffer: pydiff never hands it out again while torch holds it."""
    x = pydiff.tensor(np.full(4096, 7.0, np.float32), device=device)
    t = pydiff.to_torch(x)
    del x
    gc.collect()
    others = [pydiff.tensor(np.full(4096, -1.0, np.float32), device=device) for _ in range(8)]
    device.native.wait_for_idle()
    assert float(t.min()) == 7.0 and float(t.max()) == 7.0
    assert len(others) == 8


@pytest.mark.parametrize("take", ["step", "transpose", "offset"])
def test_to_torch_strided_views(device, take):
    a = np.arange(60, dtype=np.float32).reshape(6, 10)
    x = pydiff.tensor(a, device=device)
    view, want = {
        "step": (x[:, ::3], a[:, ::3]),
        "transpose": (x.T, a.T),
        "offset": (x[2:5, 1:4], a[2:5, 1:4]),
    }[take]
    np.testing.assert_array_equal(pydiff.to_torch(view).cpu().numpy(), want)


def test_to_torch_vector_dtype(device):
    a = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    x = pydiff.tensor(a, dtype="float3", device=device)
    np.testing.assert_array_equal(pydiff.to_torch(x).cpu().numpy(), a)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
def test_from_torch_on_the_device(device, dtype):
    src = (torch.arange(24) - 5).reshape(4, 6).to(getattr(torch, dtype))
    t = src.clone().to(torch_device(device))
    x = pydiff.from_torch(t, device=device)
    assert x.device is device and x.shape == (4, 6)
    np.testing.assert_array_equal(x.numpy(), src.numpy())
    t.add_(100)  # a copy: later torch writes do not reach pydiff
    np.testing.assert_array_equal(x.numpy(), src.numpy())
    # non-contiguous torch input
    xt = pydiff.from_torch(t.T, device=device)
    np.testing.assert_array_equal(xt.numpy(), (src + 100).T.numpy())


def test_dlpack_both_ways(device):
    xs = np.arange(10, dtype=np.float32)
    x = pydiff.tensor(xs, device=device)
    expected_type = 2 if on_cuda(device) else 1
    assert x.__dlpack_device__() == (expected_type, 0)
    np.testing.assert_array_equal(torch.from_dlpack(x).cpu().numpy(), xs)
    if not on_cuda(device):
        np.testing.assert_array_equal(np.from_dlpack(x), xs)
    back = pydiff.from_dlpack(torch.arange(5.0, device=torch_device(device)), device=device)
    np.testing.assert_array_equal(back.numpy(), np.arange(5.0))
    with pytest.raises(TypeError, match="DLPack"):
        pydiff.from_dlpack([1.0, 2.0])
    with pytest.raises(TypeError, match="float64"):
        pydiff.from_dlpack(np.arange(3.0), device=device)


def test_torch_function_gradients_on_the_inputs_device(device):
    """Gradients come back on the torch device of each input, right against float64."""
    pydiff.set_default_device(device)
    try:
        layer = pydiff.torch_function(lambda a, b: (a * b + a).exp())
        where = torch_device(device)
        a = torch.linspace(-1, 1, 9, device=where, requires_grad=True)
        b = torch.linspace(0.5, -0.5, 9, device=where, requires_grad=True)
        out = layer(a, b)
        assert out.device.type == where
        out.backward(torch.ones_like(out))
        ad, bd = a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy()
        e = np.exp(ad * bd + ad)
        assert a.grad.device.type == where and b.grad.device.type == where
        np.testing.assert_allclose(a.grad.cpu().numpy(), e * (bd + 1), rtol=1e-5)
        np.testing.assert_allclose(b.grad.cpu().numpy(), e * ad, rtol=1e-5, atol=1e-7)
        # a second backward pass through a new graph: the first .grad is not aliased
        first = a.grad.clone()
        layer(a, b).backward(torch.ones_like(out))
        np.testing.assert_allclose(a.grad.cpu().numpy(), 2 * first.cpu().numpy(), rtol=1e-6)
    finally:
        pydiff.set_default_device(None)


def test_threads_upload_and_read_back(device):
    """Host transfers from many threads at once (slang-rhi's CUDA device aborted on these)."""
    errors: list = []

    def work(k: int) -> None:
        try:
            for j in range(20):
                xs = np.full(257, k * 100 + j, np.float32)
                x = pydiff.tensor(xs, device=device)
                if not np.array_equal(x.numpy(), xs):
                    errors.append((k, j))
        except Exception as exc:  # reported below, not lost in the thread
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
