"""Loading SlangPy without PyTorch where SlangPy's torch bridge cannot work.

SlangPy's native extension imports torch while it loads (for its torch bridge): 1.3-1.5 s of
every ``import pydiff`` on a machine with torch installed, and its first call imports torch
again if the import was skipped. That bridge needs CUDA (on Vulkan a torch tensor in a
SlangPy call raises, or crashes the process: docs/devices.md), so where no CUDA driver can
be loaded, pydiff hides torch while SlangPy loads and tells SlangPy's torch detection that
there is none; torch itself then imports normally whenever the user imports it. Where a CUDA
driver exists nothing changes. ``PYDIFF_SLANGPY_TORCH=on`` (or ``off``) overrides the choice.

    from pydiff import slangpy_loader          # pydiff/__init__.py imports it first
    slangpy_loader.torch_bridge_wanted()       # False on a machine without a CUDA driver
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from typing import Any

ENV = "PYDIFF_SLANGPY_TORCH"


def missing_driver(type_name: str) -> str | None:
    """Why backend ``type_name`` cannot open on this machine without asking SlangPy, or None.

    Probing a backend that is not there costs SlangPy 0.25-0.3 s each (CUDA and D3D12 on a
    Linux machine without an NVIDIA driver: half a second of every ``"auto"`` start), so the
    platform and the driver library are looked at first.

    >>> pydiff.device.missing_driver("d3d12")       # on Linux
    'D3D12 exists on Windows only'
    """
    if type_name == "d3d12" and sys.platform != "win32":
        return "D3D12 exists on Windows only"
    if type_name == "metal" and sys.platform != "darwin":
        return "Metal exists on macOS only"
    if type_name == "cuda":
        if sys.platform == "darwin":
            return "CUDA does not run on macOS"
        library = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        try:
            ctypes.CDLL(library)
        except OSError:
            return f"no NVIDIA driver ({library} cannot be loaded)"
    return None


def torch_bridge_wanted() -> bool:
    """Whether SlangPy should load its torch bridge: only where it can work (CUDA)."""
    choice = os.environ.get(ENV, "auto").strip().lower()
    if choice in ("1", "on", "true", "yes"):
        return True
    if choice in ("0", "off", "false", "no"):
        return False
    return missing_driver("cuda") is None


class _NoTorch:
    """A meta path finder that makes ``import torch`` fail (while SlangPy loads)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is hidden while SlangPy loads (see pydiff.slangpy_loader)")
        return None


def load_slangpy() -> Any:
    """Import SlangPy, without torch unless its bridge is wanted; returns the module."""
    if "slangpy" in sys.modules or "torch" in sys.modules or torch_bridge_wanted():
        return importlib.import_module("slangpy")
    hider = _NoTorch()
    sys.meta_path.insert(0, hider)
    try:
        spy = importlib.import_module("slangpy")
        detection = importlib.import_module("slangpy.torchintegration.detection")
    finally:
        sys.meta_path.remove(hider)
    # SlangPy's call path looks for torch tensors by importing torch on its first call;
    # "no torch" is what the bridge could use here anyway.
    detection._torch_module = False
    return spy


load_slangpy()  # on import: ``pydiff/__init__.py`` imports this module before any other
