"""DLPack both ways: ``pydiff.from_dlpack`` of any producer (torch, CuPy, NumPy, JAX) and the
``__dlpack__`` export of pydiff tensors (on CUDA a view of pydiff's own buffer through torch,
elsewhere a host copy).

    x = pydiff.from_dlpack(np.ones(3, np.float32))
    t = torch.from_dlpack(x)
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import temporary_copies, tensor_methods
from .creation import tensor as make_tensor
from .device import Device
from .lost_derivative import losing_derivative, refuse_lost_copy
from .tensor import Tensor
from .dtype_names import dtype_name
from .torch_dtypes import FROM_TORCH, converted
from .torch_interop import TO_TORCH, from_torch, shared_view, torch_module

#: DLPack's device types (dlpack.h's DLDeviceType).
_DL_CPU, _DL_CUDA = 1, 2


def _cuda_export(x: Tensor) -> bool:
    if x.device.type != "cuda" or x.scalar_type not in TO_TORCH:
        return False
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return False
    return bool(torch.cuda.is_available())


def _dlpack(x: Tensor, stream: Any = None, **kwargs: Any) -> Any:
    why = losing_derivative(x)
    if why is not None:  # the consumer's array carries no derivative (torch's has none)
        raise TypeError(
            f"DLPack export (torch.from_dlpack(x), np.from_dlpack(x)) of a pydiff.Tensor of "
            f"shape {x.shape} that {why}: the exported values carry no derivative, so the "
            "gradient through them would be lost. For a gradient in PyTorch, run the pydiff "
            "code inside torch autograd (pydiff.torch_function); to hand over the values on "
            "purpose, export x.detach() (or pydiff.to_torch(x.detach()))"
        )
    if _cuda_export(x):  # (a view of its memory: of the row's copy, for a row)
        temporary_copies.refuse_row_export(x, "torch.from_dlpack(row), a zero-copy export on CUDA,")
        return shared_view(x).__dlpack__(stream=stream, **kwargs)
    return np.require(x.numpy(), requirements="C").__dlpack__(**kwargs)  # 0-d stays 0-d


def _dlpack_device(x: Tensor) -> tuple[int, int]:
    return (_DL_CUDA, 0) if _cuda_export(x) else (_DL_CPU, 0)


def from_dlpack(
    obj: Any,
    *,
    device: Device | str | None = None,
    requires_grad: bool = False,
    dtype: Any = None,
) -> Tensor:
    """A pydiff tensor with the values of any DLPack producer (a torch or CuPy tensor, a NumPy
    array, a JAX array). A CUDA producer's values are copied on the device when pydiff's
    device is CUDA (SlangPy cannot wrap memory it did not allocate), else through the host.
    ``dtype=`` as ``from_torch``'s: float32, float16, int32 and uint32 are taken as they are;
    int64, uint64, float64 and the 8/16-bit integers when it asks for the type of their width
    (``dtype=np.int8`` / ``"int8_t"``), int64 and float64 narrowed when it asks ``"int"`` /
    ``"float"``.

    >>> x = pydiff.from_dlpack(torch.arange(4.0, device="cuda"))
    >>> y = pydiff.from_dlpack(np.ones(3, np.float32), requires_grad=True)
    >>> k = pydiff.from_dlpack(torch.tensor([-3, 7], dtype=torch.int8), dtype=np.int8)
    """
    if not hasattr(obj, "__dlpack_device__"):
        raise TypeError(
            f"from_dlpack: obj must implement the DLPack protocol (__dlpack__ and "
            f"__dlpack_device__), not {type(obj).__name__}"
        )
    if isinstance(obj, Tensor):
        refuse_lost_copy(obj, "pydiff.from_dlpack")
        obj = shared_view(obj) if _cuda_export(obj) else obj.numpy()  # (copied below)
    if obj.__dlpack_device__()[0] != _DL_CPU:
        t = torch_module().from_dlpack(obj)
        return from_torch(t, device=device, requires_grad=requires_grad, dtype=dtype)
    arr = np.from_dlpack(obj)
    name, asked = arr.dtype.name, None if dtype is None else dtype_name(dtype)
    if name in FROM_TORCH and asked in (None, FROM_TORCH[name]):
        target = FROM_TORCH[name]
    else:  # (same width asked for, a narrowing asked for, or TypeError naming dtype=)
        target, arr = converted(name, asked, lambda: arr, "from_dlpack", "")
    return make_tensor(arr, dtype=target, device=device, requires_grad=requires_grad)


tensor_methods.provide("__dlpack__", _dlpack)
tensor_methods.provide("__dlpack_device__", _dlpack_device)
