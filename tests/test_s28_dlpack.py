"""DLPack export on a tape: a requires-grad tensor's export would carry no derivative
(torch.from_dlpack gives requires_grad=False), so it is refused like NumPy's conversion;
deliberate exports (detach, off the tape, inside a backward) still work."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff


def exported(t) -> np.ndarray:
    """``t``'s values through its DLPack export: NumPy takes host memory only, so a CUDA
    tensor's export (device memory) is read through torch."""
    if t.__dlpack_device__()[0] == 1:  # kDLCPU
        return np.from_dlpack(t)
    torch = pytest.importorskip("torch")
    return torch.from_dlpack(t).cpu().numpy()


def test_dlpack_export_of_a_tensor_requiring_grad_on_a_tape_is_refused(device):
    x = pydiff.tensor(np.array([1.0, 2.0, 3.0], np.float32), device=device, requires_grad=True)
    with pydiff.Tape():
        with pytest.raises(TypeError, match=r"DLPack export.*shape \(3,\).*x.detach\(\)"):
            np.from_dlpack(x)
        y = x * 2.0
        with pytest.raises(TypeError, match="torch_function"):
            np.from_dlpack(y)
        np.testing.assert_array_equal(exported(x.detach()), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(exported(x), [1.0, 2.0, 3.0])  # off the tape


def test_torch_from_dlpack_on_a_tape_is_refused_and_the_tape_still_gives_gradients(device):
    torch = pytest.importorskip("torch")
    xa = np.array([0.5, -1.5, 2.0], np.float32)
    x = pydiff.tensor(xa, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = x * x
        with pytest.raises(TypeError, match="DLPack export"):
            torch.from_dlpack(y)
        loss = y.sum()
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * xa.astype(np.float64), rtol=1e-6)
    t = torch.from_dlpack(x.detach())
    np.testing.assert_array_equal(t.cpu().numpy(), xa)


def test_new_tensors_copied_from_a_tensor_requiring_grad_on_a_tape_are_refused(device):
    """pydiff.tensor(x) and pydiff.from_dlpack(x) make new leaves: on a tape, x's gradient
    would silently stay 0 (as np.array([x]) and pydiff.tensor([x, y]) are refused)."""
    xa = np.array([1.0, 2.0, 3.0], np.float32)
    x = pydiff.tensor(xa, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        with pytest.raises(TypeError, match=r"pydiff.tensor: data: .*shape \(3,\).*x.detach"):
            pydiff.tensor(x, device=device, requires_grad=True)
        with pytest.raises(TypeError, match=r"pydiff.from_dlpack: .*shape \(3,\)"):
            pydiff.from_dlpack(x, device=device)
        c = pydiff.tensor(x.detach(), device=device)  # on purpose: a constant
        loss = (x * x * c).sum()
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * xa.astype(np.float64) ** 2, rtol=1e-6)
    np.testing.assert_array_equal(pydiff.tensor(x, device=device).numpy(), xa)  # off the tape
    np.testing.assert_array_equal(pydiff.from_dlpack(x, device=device).numpy(), xa)
