"""`import pydiff` stays light with PyTorch installed: SlangPy's torch bridge (CUDA only) is
loaded only where a CUDA driver exists. Checked in fresh processes with a stand-in `torch`
package that records being imported (so no real torch is needed), in both import orders."""

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
        "PYTHONPATH": str(tmp_path / "fake"),
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


def test_the_bridge_is_wanted_only_with_a_cuda_driver(monkeypatch):
    monkeypatch.setenv("PYDIFF_SLANGPY_TORCH", "on")
    assert slangpy_loader.torch_bridge_wanted()
    monkeypatch.setenv("PYDIFF_SLANGPY_TORCH", "off")
    assert not slangpy_loader.torch_bridge_wanted()
    monkeypatch.setenv("PYDIFF_SLANGPY_TORCH", "auto")
    monkeypatch.setattr(slangpy_loader, "missing_driver", lambda t: None)
    assert slangpy_loader.torch_bridge_wanted()
    monkeypatch.setattr(slangpy_loader, "missing_driver", lambda t: "no NVIDIA driver")
    assert not slangpy_loader.torch_bridge_wanted()


@pytest.mark.skipif(sys.platform != "linux", reason="the driver check is Linux's here")
def test_missing_cuda_driver_is_named(monkeypatch):
    import ctypes

    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert "libcuda.so.1" in slangpy_loader.missing_driver("cuda")
