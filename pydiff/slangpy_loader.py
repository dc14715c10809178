"""Loading SlangPy without PyTorch unless PyTorch is already loaded.

SlangPy's native extension imports torch while it loads, for its torch bridge: 1.3-1.9 s of
every ``import pydiff`` on a machine with torch installed. pydiff never needs that bridge:
its own calls turn torch tensors into pydiff tensors first (``pydiff.foreign``, zero-copy on
CUDA through ``Buffer.to_torch``). So unless torch is already imported (then the bridge
costs nothing more) or ``PYDIFF_SLANGPY_TORCH=on`` asks for it, pydiff hides torch while
SlangPy loads; torch then imports normally whenever the user imports it. SlangPy's bridge
cannot start later (it initialises once, when its extension loads), so a torch tensor given
to a *raw* SlangPy call afterwards raises ``TorchBridgeNotLoaded`` saying what to do,
instead of SlangPy's garbage signature and a crash at dispatch.

    from pydiff import slangpy_loader          # pydiff/__init__.py imports it first
    slangpy_loader.torch_bridge_wanted()       # False unless torch is loaded or asked for
    slangpy_loader.exit_hook()                 # SlangPy's atexit callback (pydiff.forkguard)
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import os
import sys
from typing import Any, Iterator

from .errors import ENV_OFF, ENV_ON, env_choice

ENV = "PYDIFF_SLANGPY_TORCH"


class TorchBridgeNotLoaded(RuntimeError):
    """A torch tensor reached a raw SlangPy call, but SlangPy loaded without its torch bridge."""


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
    """Whether SlangPy should load its torch bridge: when asked for, or torch is loaded."""
    choice = env_choice(ENV, ("auto", *ENV_ON, *ENV_OFF))
    if choice in ENV_ON:
        return True
    if choice in ENV_OFF:
        return False
    return "torch" in sys.modules


class _NoTorch:
    """A meta path finder that makes ``import torch`` fail (while SlangPy loads)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is hidden while SlangPy loads (see pydiff.slangpy_loader)")
        return None


def _holds_torch_tensor(value: Any, tensor_type: type, depth: int = 0) -> bool:
    if isinstance(value, tensor_type):
        return True
    if depth < 4 and isinstance(value, (list, tuple)):
        return any(_holds_torch_tensor(v, tensor_type, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return any(_holds_torch_tensor(v, tensor_type, depth + 1) for v in value.values())
    return False


def _detect_without_bridge(args: tuple, kwargs: dict) -> tuple[bool, bool]:
    """SlangPy's torch detection, for a SlangPy loaded without its bridge: no torch tensors
    ever (so no import of torch on a call), and a clear error where one is given."""
    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None)
    if isinstance(tensor_type, type) and _holds_torch_tensor((args, kwargs), tensor_type):
        raise TorchBridgeNotLoaded(
            "a torch.Tensor was passed to a raw SlangPy call, but SlangPy was loaded without "
            "its torch bridge (pydiff loads it only when torch is imported first). Pass the "
            "tensor through pydiff (pydiff.from_torch, or call the pydiff function, which "
            "takes torch tensors), or import torch before pydiff, or set "
            f"{ENV}=on"
        )
    return False, False


# SlangPy's native extension registers one atexit callback as it loads (src/slangpy_ext/
# slangpy_ext.cpp): it waits for SlangPy's tasks and closes every device. A forked child must
# not run it on the devices it inherited (pydiff.forkguard), so it is kept here.
_exit_hooks: list = []
_NB_EXIT_SIGNATURE = (("def () -> None", None, None),)


def _is_exit_hook(func: Any) -> bool:
    """Whether ``func`` looks like SlangPy's atexit callback: an unnamed nanobind function of
    no arguments (the extension's only one)."""
    return (
        type(func).__name__ == "nb_func"
        and getattr(func, "__name__", None) == ""
        and getattr(func, "__nb_signature__", None) == _NB_EXIT_SIGNATURE
    )


def _import_watching_atexit(name: str) -> Any:
    """Import ``name``, keeping the atexit callbacks SlangPy's extension registers meanwhile."""
    register = atexit.register

    def watch(func: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_exit_hook(func):
            _exit_hooks.append(func)
        return register(func, *args, **kwargs)

    atexit.register = watch
    try:
        return importlib.import_module(name)
    finally:
        atexit.register = register


def exit_hook() -> Any:
    """SlangPy's atexit callback (it closes every SlangPy device), or None if unknown: seen
    as SlangPy loaded, or, when SlangPy was imported before pydiff, the one such function
    among all objects (looked for once: a garbage-collector scan, tens of milliseconds)."""
    if not _exit_hooks:
        found = [obj for obj in gc.get_objects() if _is_exit_hook(obj)]
        _exit_hooks.append(found[0] if len(found) == 1 else None)
    return _exit_hooks[0]


def load_slangpy() -> Any:
    """Import SlangPy, without torch unless its bridge is wanted; returns the module."""
    if "slangpy" in sys.modules:
        return sys.modules["slangpy"]
    if torch_bridge_wanted():
        return _import_watching_atexit("slangpy")
    hider = _NoTorch()
    sys.meta_path.insert(0, hider)
    try:
        spy = _import_watching_atexit("slangpy")
        detection = importlib.import_module("slangpy.torchintegration.detection")
    finally:
        sys.meta_path.remove(hider)
    # SlangPy's calls look for torch tensors by importing torch on their first call; without
    # the bridge there is nothing torch could do there but crash.
    detection.detect_torch_tensors = _detect_without_bridge
    return spy


load_slangpy()  # on import: ``pydiff/__init__.py`` imports this module before any other


@contextlib.contextmanager
def quiet_native_output() -> Iterator[None]:
    """Silence the C++ layer's prints (a device opening: backends expected to fail print)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
    except (OSError, ValueError):  # no real file descriptors (e.g. some notebooks)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
