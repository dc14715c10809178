"""`import pydiff` stays light with PyTorch installed: SlangPy's torch bridge is loaded only
when torch is already imported (or PYDIFF_SLANGPY_TORCH=on asks for it), on every machine.
Checked in fresh processes with a stand-in `torch` package that records being imported (so
no real torch is needed), in both import orders."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pydiff import slangpy_loader

CALLS = textwrap.dedent(
    """
    import os, sys
    {before}
    import pydiff
    src = "[Differentiable] float sq(float x) {{ return x * x; }}"
    m = pydiff.load_module_from_source("sq", src)
    x = pydiff.tensor([3.0], requires_grad=True)
    m.sq.bwds(x, _result=1.0)
    assert x.grad.numpy().tolist() == [6.0], x.grad.numpy()
    print("torch after pydiff's calls:", "torch" in sys.modules)
    import torch
    y = pydiff.tensor([2.0], requires_grad=True)
    m.sq.bwds(y, _result=1.0)
    assert y.grad.numpy().tolist() == [4.0], y.grad.numpy()
    print("torch importable:", torch.__name__ == "torch")
    """
)


def _run(tmp_path: Path, device: str, mode: str, before: str = "") -> tuple[str, bool]:
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text(
        "import os\nopen(os.environ['FAKE_TORCH_MARK'], 'a').write('imported\\n')\n"
        "class Tensor:  # what SlangPy's torch detection looks for in call arguments\n"
        "    pass\n"
    )
    mark = tmp_path / "torch-imported"
    mark.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]),
        "FAKE_TORCH_MARK": str(mark),
        "PYDIFF_SLANGPY_TORCH": mode,
        "PYDIFF_DEVICE": device,
    }
    out = subprocess.run(
        [sys.executable, "-c", CALLS.format(before=before)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, mark.exists()


def test_torch_is_not_imported_where_the_bridge_cannot_work(tmp_path, device):
    out, _ = _run(tmp_path, device.type, "off")
    assert "torch after pydiff's calls: False" in out  # neither import nor calls loaded it
    assert "torch importable: True" in out  # the user's own import works, pydiff still too


def test_with_the_bridge_wanted_slangpy_loads_torch_as_before(tmp_path, device):
    out, imported = _run(tmp_path, device.type, "on")
    assert imported and "torch after pydiff's calls: True" in out


def test_torch_imported_first_then_pydiff(tmp_path, device):
    out, imported = _run(tmp_path, device.type, "off", before="import torch")
    assert imported and "torch importable: True" in out


def test_the_bridge_is_wanted_only_when_torch_is_loaded_or_asked_for(monkeypatch):
    monkeypatch.setenv("PYDIFF_SLANGPY_TORCH", "on")
    assert slangpy_loader.torch_bridge_wanted()
    monkeypatch.setenv("PYDIFF_SLANGPY_TORCH", "off")
    assert not slangpy_loader.torch_bridge_wanted()
    monkeypatch.setenv("PYDIFF_SLANGPY_TORCH", "auto")
    monkeypatch.setitem(sys.modules, "torch", object())
    assert slangpy_loader.torch_bridge_wanted()
    monkeypatch.delitem(sys.modules, "torch")
    # A CUDA driver no longer matters: pydiff's own torch paths never use the bridge.
    monkeypatch.setattr(slangpy_loader, "missing_driver", lambda t: None)
    assert not slangpy_loader.torch_bridge_wanted()


RAW_SLANGPY_WITH_TORCH = textwrap.dedent(
    """
    import pydiff, slangpy as spy
    import torch
    m = spy.Module.load_from_source(pydiff.default_device().native, "sq",
                                    "float sq(float x) {{ return x * x; }}")
    try:
        m.sq({value})
    except pydiff.slangpy_loader.TorchBridgeNotLoaded as e:
        print("refused:", e)
    """
)


@pytest.mark.parametrize("value", ["torch.Tensor()", "[1.0, {'a': torch.Tensor()}]"])
def test_a_torch_tensor_in_a_raw_slangpy_call_without_the_bridge_is_refused(
    tmp_path, device, value
):
    """SlangPy's bridge cannot start after SlangPy loaded: a clear error, never a crash."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("class Tensor:\n    pass\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]),
        "PYDIFF_SLANGPY_TORCH": "auto",
        "PYDIFF_DEVICE": device.type,
    }
    out = subprocess.run(
        [sys.executable, "-c", RAW_SLANGPY_WITH_TORCH.format(value=value)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "import torch before pydiff" in out.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="the driver check is Linux's here")
def test_missing_cuda_driver_is_named(monkeypatch):
    import ctypes

    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert "libcuda.so.1" in slangpy_loader.missing_driver("cuda")


PYDIFF_THEN_TORCH = textwrap.dedent(
    """
    import sys, pydiff, slangpy as spy
    import torch
    dev = pydiff.create_device(sys.argv[1]); pydiff.set_default_device(dev)
    tdev = "cuda" if dev.type == "cuda" else "cpu"
    m = pydiff.load_module_from_source(
        "sq_real_torch", "[Differentiable] float sq(float x) {{ return x * x; }}")
    t = torch.arange(4.0, device=tdev, requires_grad=True)
    y = m.sq(t)
    y.sum().backward()
    assert y.tolist() == [0.0, 1.0, 4.0, 9.0] and t.grad.tolist() == [0.0, 2.0, 4.0, 6.0]
    x = pydiff.from_torch(torch.arange(3.0, device=tdev))
    assert pydiff.to_torch(x).tolist() == [0.0, 1.0, 2.0]
    raw = spy.Module.load_from_source(dev.native, "raw_sq", "float sq(float x) {{ return x * x; }}")
    try:
        raw.sq(torch.arange(3.0, device=tdev))
    except pydiff.slangpy_loader.TorchBridgeNotLoaded:
        print("raw call refused")
    print("bridge loaded:", spy.is_torch_bridge_available())
    """
)

TORCH_THEN_PYDIFF = textwrap.dedent(
    """
    import torch, pydiff, slangpy as spy
    spy.set_allow_torch_fallback(True)
    dev = pydiff.create_device("cuda")
    src = "float sq(float x) {{ return x * x; }}"
    raw = spy.Module.load_from_source(dev.native, "raw_sq2", src)
    r = raw.sq(torch.arange(3.0, device="cuda"))
    torch.cuda.synchronize()
    assert r.tolist() == [0.0, 1.0, 4.0], r
    print("bridge loaded:", spy.is_torch_bridge_available())
    """
)


def _real_torch(code: str, *args: str) -> str:
    env = {**os.environ, "PYDIFF_SLANGPY_TORCH": "auto"}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_real_torch_after_pydiff_works_through_pydiff_and_refuses_raw_slangpy(device):
    pytest.importorskip("torch")
    out = _real_torch(PYDIFF_THEN_TORCH, device.type)
    assert "raw call refused" in out and "bridge loaded: False" in out


def test_real_torch_before_pydiff_keeps_slangpys_own_bridge(device):
    """Raw SlangPy with torch tensors (SlangPy's bridge) dispatches on CUDA only."""
    pytest.importorskip("torch")
    if device.type != "cuda":
        pytest.skip("SlangPy's torch bridge dispatches on CUDA only")
    assert "bridge loaded: True" in _real_torch(TORCH_THEN_PYDIFF)
