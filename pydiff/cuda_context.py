"""CUDA's primary context for pydiff's CUDA devices, shared with PyTorch, and current on
every thread that uses the device.

slang-rhi's CUDA device runs in a CUDA context of its own unless it is handed one, and some of
its calls (uploads, submissions) assume that context is current on the calling thread: from
any other thread (a user's ``threading.Thread``, PyTorch's autograd thread) the process
aborted (seen on an H200). pydiff hands it the device's *primary* context, the one PyTorch and
every CUDA runtime user share, and makes that context current on a thread that has none the
first time the thread uses the device (``CommandQueue.enter``).

    handles = cuda_context.primary_handles()     # -> spy.Device(existing_device_handles=...)
    cuda_context.ensure_current()                 # once per thread, from CommandQueue.enter
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import slangpy as spy

_state = threading.local()
_primary = ctypes.c_void_p()
_driver: Any = None


def _cuda() -> Any:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with error {result}")


def device_ordinal() -> int:
    """The GPU pydiff opens: PyTorch's current one where PyTorch has started CUDA
    (``torch.cuda.set_device(local_rank)`` in a data-parallel rank), else the first."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)  # (a stand-in torch may lack it)
    if cuda is not None and cuda.is_initialized():
        return int(cuda.current_device())
    return 0


def primary_handles() -> list | None:
    """The native handles of the primary context of the GPU ``device_ordinal()`` names, made
    current on this thread, for ``spy.Device(existing_device_handles=...)``; None where the
    driver cannot be loaded (the device then makes a context of its own, as SlangPy does)."""
    try:
        cuda = _cuda()
    except OSError:
        return None
    _check(cuda.cuInit(0), "cuInit")
    device = ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(device), device_ordinal()), "cuDeviceGet")
    retained = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(_primary), device)
    _check(retained, "cuDevicePrimaryCtxRetain")
    _check(cuda.cuCtxSetCurrent(_primary), "cuCtxSetCurrent")
    _state.ready = True
    return list(spy.get_cuda_current_context_native_handles())


def ensure_current() -> None:
    """Make the primary context current on this thread if it has none (once per thread)."""
    if getattr(_state, "ready", False) or not _primary.value:
        return
    current = ctypes.c_void_p()
    _check(_cuda().cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        _check(_cuda().cuCtxSetCurrent(_primary), "cuCtxSetCurrent")
    _state.ready = True
