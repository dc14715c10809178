"""Making tensors: from host data, empty, zeros, ones; and releasing cached storage.

x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
w = pydiff.zeros((64, 32), requires_grad=True)
pydiff.empty_cache()
"""

from __future__ import annotations

from typing import Any, Sequence


from . import capturing, tensor_methods
from .buffer_pool import check_size
from .device import Device, open_devices, resolve_device
from .exact_ints import refuse_rounded_list
from .foreign import as_array
from .dtype_names import NUMPY_TO_SLANG, dtype_name
from .storage import (
    allocate,
    element_shape,
    host_cast,
    shape_tuple,
    upload_numpy_type,
)
from .tensor import Tensor


#: why a dimension of 0 is refused, and what to do instead
ZERO_SIZE = (
    "pydiff has no zero-size tensors (every dimension must be at least 1): skip the call "
    "when there is nothing to compute"
)


def tensor(
    data: Any,
    dtype: Any = None,
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor holding a copy of ``data`` (NumPy array, nested lists, a scalar).

    ``dtype`` defaults from the data (floating -> 'float', integer -> 'int'); with a vector
    type such as 'float3' the last dimension of ``data`` holds the components.

    >>> x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> p = pydiff.tensor(np.zeros((8, 3)), dtype="float3")    # shape (8,)
    >>> s = pydiff.tensor(3.0)                                   # shape (), as np.asarray
    """
    return from_host(data, dtype, device, requires_grad, "pydiff.tensor: data")


def from_host(data: Any, dtype: Any, device: Any, requires_grad: bool, where: str) -> Tensor:
    """``pydiff.tensor(data, ...)`` for another API, which ``where`` names in the errors
    (values that do not fit the dtype, a shape that cannot hold its elements).

    >>> from_host(np.linspace(0, 1, 5), "int", None, False, "pydiff.linspace")  # ValueError:
    ... # pydiff.linspace: 0.25 is not a whole number; the tensor holds int32
    """
    dev = resolve_device(device)
    if isinstance(data, Tensor):
        tensor_methods.call("refuse_lost_copy", data, where)
        if (copied := _device_copy(data, dev, dtype, requires_grad)) is not None:
            return copied
        arr = data.numpy()
        # its own dtype by default, as np.array(a) and torch.tensor(t) keep theirs (a double
        # tensor's values became float32, a float3 tensor a (..., 3) float one, before s49)
        dtype = data.dtype if dtype is None else dtype
    else:
        arr = as_array(data, where)
    if dtype is None:
        native_order = arr.dtype.newbyteorder("=")  # big-endian '>f4' holds float32 values
        name = NUMPY_TO_SLANG.get(native_order)
        if name is None and native_order.kind in "iu" and native_order.itemsize < 4:
            name = "int"  # int8/16, uint8/16 (an image's bytes): every value fits
        if name is None:
            raise TypeError(
                f"{where}: NumPy dtype {arr.dtype} has no default Slang dtype; pass dtype="
            )
    else:
        name = dtype_name(dtype)
    elem = element_shape(dev.dtype(name))
    if elem and arr.shape[len(arr.shape) - len(elem) :] != elem:
        raise ValueError(
            f"{where}: shape {arr.shape} cannot hold elements of dtype {name!r}: its last "
            f"dimension(s) must be {elem}"
        )
    shape = arr.shape[: arr.ndim - len(elem)] if elem else arr.shape  # () for a scalar: 0-d
    if 0 in arr.shape:
        raise ValueError(f"{where} has shape {arr.shape}, with no elements; {ZERO_SIZE}")
    out = empty(shape, dtype=name, device=dev)
    kind = out.scalar_type
    # (bind(False, False): its dtype only; .native would submit the pending work, which the
    # write below joins rather than submits: staging.write_in_order)
    up = upload_numpy_type(out.bind(False, False), kind)
    refuse_rounded_list(data, arr, up, where)  # ([2**63 + 1, 0]: float64, rounded by NumPy)
    arr = host_cast(arr, up, where, kind == "bool").reshape(out.expected_numpy_shape())
    # A new tensor: no command held back in the queue binds its buffers (the held command
    # keeps its own from the pool), so the command stays held for its consumer (a held
    # forward for tape.backward(y, grad=pydiff.tensor(g)) to fuse: generated_hold).
    return dev.queue.keeping_held(lambda: _filled(out, arr, where, requires_grad), None)


def _device_copy(data: Tensor, dev: Device, dtype: Any, requires_grad: bool) -> Tensor | None:
    """``pydiff.tensor(t)``: ``t``'s values copied on the device, in order with the pending
    work, into a new tensor (no host read: a forward held back for a fused backward stays
    held, unless it is the one that writes ``t``: then it is recorded first); None, nothing
    done, where the host copies them (another device or dtype, not dense, bools, a capture,
    which refuses a host write)."""
    if dev is not data.device or (dtype is not None and dtype_name(dtype) != data.dtype):
        return None
    if not data.dense or data.scalar_type == "bool" or capturing.recording() is not None:
        return None
    out = empty(data.shape, dtype=data.dtype, device=dev)
    if not out.dense or out.element_type.buffer_layout.stride != (
        stride := data.element_type.buffer_layout.stride
    ):
        return None
    queue, nbytes = dev.queue, stride * data.numel

    def copy() -> Tensor:
        with queue.lock:  # (the batch's encoder fetched and used under it: command_queue)
            queue.enter()
            dst, src, encoder = out.buffer, data.buffer, queue.encoder()
            if encoder is None:
                queue.defer(lambda e: e.copy_buffer(dst, 0, src, 0, nbytes), (dst, src))
            else:
                encoder.copy_buffer(dst, 0, src, 0, nbytes)
        out.wrote_from_outside("pydiff.tensor(t): a copy of t's values")
        return out.requires_grad_(True) if requires_grad else out

    return dev.queue.keeping_held(copy, data.storage)


def _filled(out: Tensor, arr: Any, where: str, requires_grad: bool) -> Tensor:
    out.copy_from_numpy(arr, caller=where)
    return out.requires_grad_(True) if requires_grad else out


def empty(
    shape: int | Sequence[int],
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """An uninitialised tensor (gradient buffers, if asked for, are zeroed).

    >>> y = pydiff.empty((1024,), dtype="float")
    """
    return _new("pydiff.empty", shape, dtype, device, requires_grad)


def _new(what: str, shape: Any, dtype: Any, device: Any, requires_grad: bool) -> Tensor:
    """An uninitialised tensor, its size checked against the device's limits first."""
    dev = device if type(device) is Device else resolve_device(device)
    if dtype == "float" and type(dtype) is str and _plain_shape(shape):
        # (type: NumPy's float64 dtype == "float" too; dtype_name makes it double below)
        # The ops' fast path: the size is checked there (once per shape).
        native = allocate(dev, shape or (1,), "float", what=f"{what}(dtype='float')")
        out = Tensor(native, dev, shape=shape, float4=True)  # (pooled: storage.allocate)
    else:
        try:
            shape = shape_tuple(shape)
        except ValueError as exc:  # a zero or negative dimension
            raise ValueError(f"{what}: {exc}; {ZERO_SIZE}") from None
        name = dtype_name(dtype)
        refl = dev.dtype(name)
        # Gradient buffers as well: as many bytes again per buffer, checked here up front.
        check_size(f"{what}(dtype={name!r})", dev.type, shape, int(refl.buffer_layout.stride))
        out = Tensor(allocate(dev, shape, refl), dev)
    return out.requires_grad_(True) if requires_grad else out


def _plain_shape(shape: Any) -> bool:
    """A tuple of positive Python ints, or () (what the ops pass: a 0-d loss is ``()``):
    nothing to convert or refuse."""
    if type(shape) is not tuple:
        return False
    for d in shape:
        if type(d) is not int or d <= 0:
            return False
    return True


def zeros(
    shape: int | Sequence[int],
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor of zeros.

    >>> w = pydiff.zeros((64, 32), requires_grad=True)
    """
    # Zeroed in order with the pending work (no submission of its own), and recorded by a
    # capture: a step's scratch accumulator from zeros() restarts from zero on each replay.
    # In the deferred list even inside a backward's batch (a custom Function's backward): no
    # command recorded there reads a new buffer (the pool hands none out while a batch
    # records), and t.native submits the list, not the batch: raw SlangPy writing into
    # t.native came before the batch's zeroing, which wiped its values (a zero gradient).
    return _new("pydiff.zeros", shape, dtype, device, requires_grad).zero_(batch=False)


def ones(
    shape: int | Sequence[int],
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor of ones.

    >>> up = pydiff.ones((4,))
    """
    return _new("pydiff.ones", shape, dtype, device, requires_grad).fill(1.0)


def empty_cache(device: Device | str | None = None) -> None:
    """Release the unused storage buffers pydiff keeps for reuse, its scratch buffers and
    bound shader objects, and the compiled kernels: pydiff's own, the generated kernels of
    user functions and the call plans holding them (all devices by default). Kernels are
    built again on their next use.

    >>> del activations
    >>> pydiff.empty_cache()
    """
    devices = open_devices() if device is None else [resolve_device(device)]
    for dev in devices:
        dev.empty_cache()
