"""ops.linear on 1-D and N-D inputs (PyTorch's shapes) and linspace(endpoint=False), checked
against float64 NumPy references (closed-form gradients of a weighted sum)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import ops

ROOT = Path(__file__).resolve().parents[1]


def _reference(X, W, b, G, relu):
    z = X.astype(np.float64) @ W.T.astype(np.float64) + (0.0 if b is None else b)
    y = np.maximum(z, 0.0) if relu else z
    gz = G * (z > 0) if relu else G  # d(sum(G * y))/dz
    rows, grows = X.reshape(-1, X.shape[-1]), gz.reshape(-1, W.shape[0])
    dx = (grows @ W.astype(np.float64)).reshape(X.shape)
    dw = grows.T @ rows.astype(np.float64)
    db = grows.sum(axis=0)
    return y, dx, dw, db


@pytest.mark.parametrize("shape", [(5,), (2, 3, 5), (2, 1, 2, 5), (1, 5)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_linear_any_rank_matches_float64(device, shape, bias, activation):
    rng = np.random.default_rng(len(shape) * 7 + bias)
    X = rng.standard_normal(shape).astype(np.float32)
    W = rng.standard_normal((4, 5)).astype(np.float32)
    B = rng.standard_normal(4).astype(np.float32) if bias else None
    G = rng.standard_normal(shape[:-1] + (4,))
    x = pydiff.tensor(X, device=device, requires_grad=True)
    w = pydiff.tensor(W, device=device, requires_grad=True)
    b = pydiff.tensor(B, device=device, requires_grad=True) if bias else None
    g = pydiff.tensor(G.astype(np.float32), device=device)
    with pydiff.Tape() as tape:
        y = ops.linear(x, w, b, activation)
        loss = (y * g).sum()
    tape.backward(loss)
    ry, dx, dw, db = _reference(X, W, B, G, activation == "relu")
    assert y.shape == shape[:-1] + (4,)
    np.testing.assert_allclose(y.numpy(), ry, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), dw, rtol=1e-4, atol=1e-5)
    if bias:
        np.testing.assert_allclose(b.grad.numpy(), db, rtol=1e-4, atol=1e-5)


def test_linear_strided_3d_input_is_cloned_with_its_gradient(device):
    rng = np.random.default_rng(3)
    A = rng.standard_normal((5, 3, 2)).astype(np.float32)  # x = A transposed: (2, 3, 5)
    W = rng.standard_normal((4, 5)).astype(np.float32)
    a = pydiff.tensor(A, device=device, requires_grad=True)
    w = pydiff.tensor(W, device=device)
    with pydiff.Tape() as tape:
        x = a.transpose(2, 1, 0)
        loss = ops.linear(x, w).sum()
    tape.backward(loss)
    X = A.transpose(2, 1, 0)
    np.testing.assert_allclose(loss.item(), (X.astype(np.float64) @ W.T).sum(), rtol=1e-5)
    dx = np.broadcast_to(W.astype(np.float64).sum(axis=0), X.shape)  # d sum(x Wᵀ)/dx
    np.testing.assert_allclose(a.grad.numpy(), dx.transpose(2, 1, 0), rtol=1e-5, atol=1e-6)


def test_linear_any_rank_refusals(device):
    w = pydiff.tensor(np.ones((4, 5), np.float32), device=device)
    with pytest.raises(ValueError, match=r"x of shape \(2, 3, 6\) has 6 features"):
        ops.linear(pydiff.tensor(np.ones((2, 3, 6), np.float32), device=device), w)
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        ops.linear(pydiff.tensor(np.ones((2, 3, 5), np.float32), device=device), w.reshape(20))


@pytest.mark.parametrize("num", [1, 2, 4, 7])
@pytest.mark.parametrize("endpoint", [True, False])
def test_linspace_endpoint_matches_numpy(device, num, endpoint):
    got = pydiff.linspace(-1.5, 2.0, num, endpoint=endpoint, device=device).numpy()
    want = np.linspace(-1.5, 2.0, num, endpoint=endpoint).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_linspace_endpoint_type_is_checked():
    with pytest.raises(TypeError, match="endpoint must be True or False"):
        pydiff.linspace(0.0, 1.0, 4, endpoint="no")


# A parent that had a CUDA device open forks: in the child no CUDA device opens (CUDA does not
# survive fork), with the reason; "auto" goes on to the next backend. A GPU-less stand-in: a
# Device of type "cuda" over the parent's Vulkan device, registered as an open device.
CUDA_PARENT_FORKS = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import pydiff
    from pydiff import device as devices
    vk = pydiff.create_device("vulkan")
    devices._open_devices[("cuda", (), "stand-in")] = devices.Device(vk.native, "cuda")
    pid = os.fork()
    if pid == 0:
        try:
            pydiff.create_device("cuda")
            print("opened")
        except pydiff.DeviceUnavailableError as e:
            print("refused:", e)
        d = pydiff.create_device("auto")
        y = (pydiff.tensor([1.0, 2.0, 3.0], device=d) * 2.0).numpy()
        print("auto:", d.type, y.tolist())
        sys.stdout.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_a_forked_child_of_a_cuda_process_opens_no_cuda_device(tmp_path):
    env = {**os.environ, "PYDIFF_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("PYDIFF_DEVICE", None)
    done = subprocess.run(
        [sys.executable, "-c", CUDA_PARENT_FORKS],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "refused: could not open a 'cuda' device: CUDA cannot be used" in out, out
    assert "'spawn'" in out and "opened" not in out
    assert "auto: vulkan [2.0, 4.0, 6.0]" in out, out
