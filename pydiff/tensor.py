"""Differentiable tensors: a SlangPy tensor plus the gradient buffers pydiff manages for it.

    x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)   # grads zeroed on allocation
    y = module.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
    module.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y.with_grads(ones=True)); x.grad.numpy()
"""

from __future__ import annotations

import math
import sys
from typing import Any, Sequence

import numpy as np
import slangpy as spy

from . import capturing
from .device import Device, resolve_device
from .policy import ZeroPolicy, _active_scope

_NUMPY_TO_SLANG = {
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "float",  # Slang has no double atomics: float is the useful default
    np.dtype(np.float16): "half",
    np.dtype(np.int32): "int",
    np.dtype(np.int64): "int",
    np.dtype(np.uint32): "uint",
    np.dtype(np.bool_): "bool",
}
_SCALAR_NUMPY = {
    "float": np.float32,
    "half": np.float16,
    "double": np.float64,
    "int": np.int32,
    "uint": np.uint32,
    "bool": np.bool_,
    "int64_t": np.int64,
    "uint64_t": np.uint64,
}


class _GradState:
    """Bookkeeping shared by every view of one buffer.

    ``holds_result_of`` names the backward whose result the buffer holds (STRICT policy);
    ``version`` counts writes, ``last_writer`` names the latest (tape overwrite detection).
    """

    __slots__ = ("holds_result_of", "version", "last_writer", "checked")

    def __init__(self) -> None:
        self.holds_result_of: str | None = None
        self.version = 0
        self.last_writer = "nothing"
        self.checked: Any = None  # (version, what) of the latest validation of the values

    def wrote(self, writer: str) -> None:
        self.version += 1
        self.last_writer = writer


def _dtype_name(dtype: Any) -> str:
    if dtype is float:
        return "float"
    if dtype is int:
        return "int"
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        return _NUMPY_TO_SLANG[np.dtype(dtype)]
    if isinstance(dtype, str) and dtype.strip():
        return dtype.strip()
    raise TypeError(f"dtype={dtype!r}: expected a Slang type name such as 'float' or 'float3'")


def _element_shape(native_dtype: Any) -> tuple[int, ...]:
    """Trailing NumPy dimensions one element occupies (float3 -> (3,), float4x4 -> (4, 4))."""
    shape = tuple(int(s) for s in native_dtype.shape)
    return shape


def _flush_pending() -> None:
    """Kernels queued in a batched backward must run before the host reads or writes."""
    scope = _active_scope.get()
    if scope is not None and scope._encoder is not None:
        scope.flush()


class Tensor:
    """A tensor on a device with optional gradient buffers ``grad_in`` and ``grad_out``.

    ``grad_in`` holds the upstream gradient a backward reads for values the call wrote;
    ``grad_out`` receives gradients a backward adds for values the call read. By default one
    zeroed buffer serves as both, and ``.grad`` is ``grad_out`` (as in SlangPy).

    >>> x = pydiff.tensor(np.arange(4.0), requires_grad=True)
    >>> x.shape, x.dtype, x.grad.numpy()
    ((4,), 'float', array([0., 0., 0., 0.], dtype=float32))
    """

    __array_priority__ = 1000

    def __init__(
        self,
        native: spy.Tensor,
        device: Device,
        grad_in: "Tensor | None" = None,
        grad_out: "Tensor | None" = None,
        *,
        _state: _GradState | None = None,
        zero_policy: ZeroPolicy | str | None = None,
    ):
        self._native = native
        self._device = device
        self._shape = tuple(int(s) for s in native.shape)
        self._grad_in = grad_in
        self._grad_out = grad_out
        self._state = _state or _GradState()
        self.zero_policy = zero_policy
        self._bound: spy.Tensor | None = None
        self._producer: Any = None  # the Tape that recorded the call writing this tensor
        self._tangent: "Tensor | None" = None  # forward mode: d(self) along the chosen direction

    # --- description -------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> str:
        """Slang element type name: 'float', 'float3', 'half', 'int', ..."""
        t = self._native.dtype
        if type(t).__name__ == "VectorType":
            return f"{t.element_type.full_name}{t.num_elements}"
        return t.full_name

    @property
    def device(self) -> Device:
        return self._device

    @property
    def native(self) -> spy.Tensor:
        """The SlangPy tensor holding the primal values (no gradient buffers attached)."""
        return self._native

    @property
    def numel(self) -> int:
        return math.prod(self._shape)

    @property
    def differentiable(self) -> bool:
        return bool(getattr(self._native.dtype, "differentiable", False))

    @property
    def zero_policy(self) -> ZeroPolicy | None:
        """This tensor's own zeroing policy, or None to follow the global/context one."""
        return self._zero_policy

    @zero_policy.setter
    def zero_policy(self, value: ZeroPolicy | str | None) -> None:
        self._zero_policy = None if value is None else ZeroPolicy.parse(value)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __repr__(self) -> str:
        grads = ""
        if self._grad_out is not None:
            grads = ", grad=shared" if self._grad_in is self._grad_out else ", grad=separate"
        return (
            f"pydiff.Tensor(shape={self.shape}, dtype={self.dtype}, device={self._device.type}"
            f"{grads})"
        )

    # --- data in and out ---------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """Copy to a NumPy array (vector elements become a trailing dimension)."""
        _flush_pending()
        return self._native.to_numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def item(self) -> float:
        arr = self.numpy()
        if arr.size != 1:
            raise ValueError(f"item() needs a tensor with one element, this one has shape {self.shape}")
        return arr.reshape(()).item()

    def expected_numpy_shape(self) -> tuple[int, ...]:
        return self.shape + _element_shape(self._native.dtype)

    def copy_from_numpy(self, data: Any) -> "Tensor":
        """Overwrite the values from host data of the same shape; returns self.

        >>> x.copy_from_numpy(np.zeros(x.shape, np.float32))
        """
        arr = np.asarray(data)
        want = self.expected_numpy_shape()
        if arr.shape != want:
            raise ValueError(
                f"copy_from_numpy: data has shape {arr.shape}, tensor of dtype {self.dtype} "
                f"and shape {self.shape} needs {want}"
            )
        np_type = _SCALAR_NUMPY.get(self._scalar_name())
        if np_type is not None:
            arr = arr.astype(np_type, copy=False)
        arr = np.ascontiguousarray(arr)
        capturing.refuse("a host write (copy_from_numpy, fill, or pydiff.tensor(array))")
        _flush_pending()
        self._native.copy_from_numpy(arr.reshape(1) if arr.ndim == 0 else arr)
        return self._wrote_from_host()

    def _upload(self, data: Any, encoder: Any) -> bool:
        """Record a copy of float ``data`` (of this tensor's shape) into ``encoder``, in order
        with its other commands; False (nothing done) unless the storage takes raw floats."""
        n = self._native
        if not (n.dtype.full_name == "float" and n.offset == 0 and n.is_contiguous()):
            return False
        values = np.ascontiguousarray(data, dtype=np.float32).ravel()
        encoder.upload_buffer_data(n.storage, 0, values)
        rec = capturing.recording()
        if rec is not None:
            rec.record_upload(n.storage, values)
        self._wrote_from_host()
        return True

    def _wrote_from_host(self) -> "Tensor":
        self._state.holds_result_of = None
        self._state.wrote("a host write (copy_from_numpy/fill)")
        return self

    def _scalar_name(self) -> str:
        t = self._native.dtype
        while hasattr(t, "element_type") and t.element_type is not None and t.element_type != t:
            t = t.element_type
        return t.full_name

    # --- gradients ---------------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        return self._grad_out is not None or self._grad_in is not None

    @property
    def grad(self) -> "Tensor | None":
        """The gradient buffer a backward adds into (``grad_out``), as in SlangPy."""
        return self._grad_out

    @property
    def grad_in(self) -> "Tensor | None":
        return self._grad_in

    @property
    def grad_out(self) -> "Tensor | None":
        return self._grad_out

    def _new_grad_buffer(self, zero: bool = True) -> "Tensor":
        if not self._shape:  # a 0-d result (a scalar-returning call): a (1,) buffer, viewed
            native = new_native(self._device, (1,), self._grad_dtype(), zero).view(self._native.shape)
        else:
            native = new_native(self._device, self._native.shape, self._grad_dtype(), zero)
        return Tensor(native, self._device)

    def _grad_dtype(self) -> Any:
        derivative = getattr(self._native.dtype, "derivative", None)
        if derivative is None or not self.differentiable:
            raise TypeError(
                f"a tensor of dtype {self.dtype!r} cannot have gradients (no derivative type); "
                "use a floating-point dtype such as 'float', 'half' or 'float3'"
            )
        return derivative

    def _check_grad(self, grad: Any, name: str) -> "Tensor":
        if not isinstance(grad, Tensor):
            raise TypeError(f"{name}: expected a pydiff.Tensor, got {type(grad).__name__}")
        if grad.device != self.device:
            raise ValueError(f"{name}: on device {grad.device.type}, primal on {self.device.type}")
        if grad.shape != self.shape:
            raise ValueError(
                f"{name}: gradient shape {grad.shape} does not match the primal's shape {self.shape}"
            )
        want = self._grad_dtype().full_name
        if grad._native.dtype.full_name != want:
            raise ValueError(
                f"{name}: gradient dtype {grad.dtype!r} does not match the primal's "
                f"derivative type {want!r}"
            )
        return grad

    def with_grads(
        self,
        grad_in: "Tensor | None" = None,
        grad_out: "Tensor | None" = None,
        zero: bool = True,
        *,
        ones: bool = False,
    ) -> "Tensor":
        """A tensor on the same storage with gradient buffers attached.

        With no buffers given, one new buffer serves as grad_in and grad_out. Buffers you
        pass are validated (shape, dtype, device) and kept as they are: ``zero`` applies only
        to buffers pydiff allocates (SlangPy also clears yours, losing an upstream gradient). ``ones=True``
        fills a new shared buffer with ones, the usual upstream gradient of an output.

        >>> y = module.f(x, _result="tensor").with_grads(ones=True)
        >>> module.f.bwds(x, _result=y)
        """
        if grad_in is not None:
            self._check_grad(grad_in, "grad_in")
        if grad_out is not None:
            self._check_grad(grad_out, "grad_out")
        if grad_in is None and grad_out is None:
            grad_in = grad_out = self._new_grad_buffer(zero and not ones)
            if ones:
                grad_in.fill(1.0)
        else:
            grad_in = grad_in if grad_in is not None else self._new_grad_buffer(zero)
            grad_out = grad_out if grad_out is not None else self._new_grad_buffer(zero)
        return Tensor(
            self._native,
            self._device,
            grad_in,
            grad_out,
            _state=self._state,
            zero_policy=self._zero_policy,
        )

    @property
    def tangent(self) -> "Tensor | None":
        """Forward mode: the tangent (directional derivative) of these values, or None.

        ``.fwds`` reads it for inputs and fills it for outputs.
        >>> x.with_tangent(np.ones(x.shape)); y, dy = m.f.fwds(x)
        """
        return self._tangent

    def with_tangent(self, tangent: Any) -> "Tensor":
        """Attach a tangent (a pydiff.Tensor or host data of the same shape); returns self.

        >>> x = pydiff.tensor([1.0, 2.0]).with_tangent([1.0, 0.0])
        """
        if tangent is None:
            self._tangent = None
            return self
        if isinstance(tangent, Tensor):
            if tangent.device != self.device:
                raise ValueError(f"tangent is on device {tangent.device!r}, the tensor on {self.device!r}")
            if tangent.shape != self.shape or tangent.dtype != self.dtype:
                raise ValueError(
                    f"tangent has shape {tangent.shape} and dtype {tangent.dtype}; the tensor has "
                    f"shape {self.shape} and dtype {self.dtype}"
                )
            self._tangent = tangent
            return self
        arr = np.asarray(tangent, dtype=np.float64)
        want = self.expected_numpy_shape()
        if arr.shape != want:
            raise ValueError(f"tangent has shape {arr.shape}; the tensor's values have shape {want}")
        self._tangent = Tensor(new_native(self._device, self._native.shape, self._native.dtype),
                               self._device).copy_from_numpy(arr)
        return self

    def requires_grad_(self, flag: bool = True) -> "Tensor":
        """Attach (or drop) a zeroed shared gradient buffer in place; returns self."""
        if flag and not self.requires_grad:
            self._grad_in = self._grad_out = self._new_grad_buffer()
        elif not flag:
            self._grad_in = self._grad_out = None
        self._bound = None
        return self

    def zero_grad(self) -> "Tensor":
        """Zero the gradient buffers (grad_in and grad_out); returns self."""
        return self._zero_grad()

    def _zero_grad(self, encoder: Any = None) -> "Tensor":
        grad_in, grad_out = self._grad_in, self._grad_out
        if grad_in is not None:
            grad_in._clear(encoder)
        if grad_out is not None and grad_out is not grad_in:
            grad_out._clear(encoder)
        return self

    def detach(self) -> "Tensor":
        """The same values without gradient buffers."""
        return Tensor(self._native, self._device, _state=self._state)

    def fill(self, value: float) -> "Tensor":
        """Set every component to ``value``; returns self."""
        arr = np.full(self.expected_numpy_shape(), value)
        return self.copy_from_numpy(arr)

    def _clear(self, encoder: Any = None) -> None:
        """Zero the values now, or in order with the commands of ``encoder``."""
        if encoder is None:
            _flush_pending()
            self._native.clear()
        else:
            self._native.clear(encoder)
        rec = capturing.recording()
        if rec is not None:
            rec.record_clear(self._native)
        self._state.holds_result_of = None
        self._state.wrote("a host write (zeroing)")

    def reshape(self, shape: Sequence[int]) -> "Tensor":
        """A view of the same contiguous storage with another shape (no gradient buffers).

        >>> flat = x.reshape((x.numel,))
        """
        shape = _shape_tuple(shape)
        if math.prod(shape) != self.numel:
            raise ValueError(f"reshape: cannot view {self.numel} elements as shape {shape}")
        if not self._native.is_contiguous():
            raise ValueError("reshape: the tensor is not contiguous; clone() it first")
        return Tensor(self._native.view(shape), self._device, _state=self._state)

    def clone(self) -> "Tensor":
        """A copy of the values in new storage (no gradient buffers).

        >>> before = x.clone()
        """
        out = Tensor(new_native(self._device, self._native.shape, self._native.dtype), self._device)
        copy_tensor(out, self)
        return out

    def backward(self, grad: Any = None) -> None:
        """Backpropagate through the tape that recorded the call producing this tensor.

        >>> with pydiff.Tape():
        ...     loss = m.loss(x, _result="tensor")
        >>> loss.backward()
        """
        if self._producer is None:
            raise RuntimeError(
                "backward(): this tensor was not produced by a call recorded on a pydiff.Tape; "
                "make it inside 'with pydiff.Tape() as tape:' (or call .bwds yourself)"
            )
        self._producer.backward(self, grad)

    # --- plumbing used by calls ------------------------------------------------------------
    @property
    def _holds_result_of(self) -> str | None:
        return self._state.holds_result_of

    @_holds_result_of.setter
    def _holds_result_of(self, value: str | None) -> None:
        self._state.holds_result_of = value

    def _storage_key(self) -> int:
        return id(self._state)

    def _as_native(self, with_grads: bool = True) -> spy.Tensor:
        """The SlangPy tensor to bind: primal plus gradient buffers when attached."""
        if not with_grads or not self.requires_grad:
            return self._native
        if self._bound is None:
            gi = self._grad_in._native if self._grad_in is not None else None
            go = self._grad_out._native if self._grad_out is not None else None
            self._bound = self._native.with_grads(grad_in=gi, grad_out=go, zero=False)
        return self._bound


def _to_array(data: Any) -> np.ndarray:
    if isinstance(data, Tensor):
        return data.numpy()
    return np.asarray(data)


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
    """
    dev = resolve_device(device)
    arr = _to_array(data)
    if dtype is None:
        if arr.dtype not in _NUMPY_TO_SLANG:
            raise TypeError(f"data of NumPy dtype {arr.dtype} has no default Slang dtype; pass dtype=")
        name = _NUMPY_TO_SLANG[arr.dtype]
    else:
        name = _dtype_name(dtype)
    native_dtype = _probe_dtype(dev, name)
    elem = _element_shape(native_dtype)
    if elem and arr.shape[len(arr.shape) - len(elem):] != elem:
        raise ValueError(
            f"data of shape {arr.shape} cannot hold elements of dtype {name!r}: its last "
            f"dimension(s) must be {elem}"
        )
    shape = arr.shape[: arr.ndim - len(elem)] if elem else arr.shape
    if shape == ():
        shape = (1,)
    out = empty(shape, dtype=name, device=dev)
    out.copy_from_numpy(arr.reshape(out.expected_numpy_shape()))
    if requires_grad:
        out.requires_grad_(True)
    return out


_dtype_cache: dict[tuple[int, str], Any] = {}
_STORAGE_USAGE = spy.BufferUsage.shader_resource | spy.BufferUsage.unordered_access


def new_native(dev: Device, shape: Sequence[int], dtype: Any, zero: bool = False) -> spy.Tensor:
    """Storage for a new tensor. On Vulkan, float tensors live in a buffer with the
    rgba32_float format (padded to whole float4s), which SlangPy binds as usual and
    pydiff's fast kernels read as typed float4 loads (about 3x cheaper on lavapipe)."""
    name = dtype if isinstance(dtype, str) else dtype.full_name
    shape = tuple(int(s) for s in shape)
    rec = capturing.recording()
    if name != "float" or dev.type != "vulkan":
        make = spy.Tensor.zeros if zero and rec is None else spy.Tensor.empty
        refl = _probe_dtype(dev, name) if isinstance(dtype, str) else dtype
        stride = int(refl.buffer_layout.stride)
        count = math.prod(shape)
        if shape and (count * stride) % 4:
            # SlangPy's clear() zeroes whole 4-byte words and leaves the last element of,
            # e.g., an odd number of halves: pad the storage to whole words.
            padded = count
            while (padded * stride) % 4:
                padded += 1
            native = make(dev.native, (padded,), dtype)
            if zero and rec is not None:
                _clear_recorded(native, rec)
            return native.view(shape)
        native = make(dev.native, shape, dtype)
        if zero and rec is not None:
            _clear_recorded(native, rec)
        return native
    count = math.prod(shape)
    storage = _float4_storage(dev, max(1, -(-count // 4)))
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    native = spy.Tensor(storage, _probe_dtype(dev, "float"), list(shape), list(reversed(strides)), 0)
    if zero:
        native.clear()
        if rec is not None:
            rec.record_clear(native)
    return native


def _clear_recorded(native: spy.Tensor, rec: Any) -> None:
    native.clear()
    rec.record_clear(native)



# Float4 storage buffers kept for reuse, per (device, float4 count): creating a buffer costs
# lavapipe about 40 us, more than most kernels of a small training step. A buffer is free when
# nothing but this pool refers to it (SlangPy's objects share Python's reference count, so
# views and tensors built on it count too).
_pool: dict[tuple[int, int], list] = {}
_POOL_MAX_FLOAT4S = 1 << 18  # 4 MiB: bigger buffers are rare enough to allocate each time
_POOL_MAX_PER_SIZE = 32


def _float4_storage(dev: Device, float4s: int) -> Any:
    pooled = float4s <= _POOL_MAX_FLOAT4S and not _encoder_pending()
    if pooled:
        buffers = _pool.setdefault((id(dev.native), float4s), [])
        for buffer in buffers:
            # References: the list, this loop's variable and getrefcount's argument.
            if sys.getrefcount(buffer) == 3:
                return buffer
    buffer = dev.native.create_buffer(
        element_count=float4s, struct_size=16, usage=_STORAGE_USAGE, format=spy.Format.rgba32_float,
    )
    if pooled and len(buffers) < _POOL_MAX_PER_SIZE:
        buffers.append(buffer)
    return buffer


def _encoder_pending() -> bool:
    """Kernels are recorded but not yet submitted: a buffer freed since may still be written
    by them, so it must not be handed out again before they run."""
    scope = _active_scope.get()
    return scope is not None and scope._encoder is not None


def empty_cache(device: Device | str | None = None) -> None:
    """Release the unused storage buffers pydiff keeps for reuse (all devices by default).

    >>> del activations
    >>> pydiff.empty_cache()
    """
    from . import kernels

    native_id = None if device is None else id(resolve_device(device).native)
    kernels.release_objects()
    for key, buffers in list(_pool.items()):
        if native_id is None or key[0] == native_id:
            _pool[key] = [b for b in buffers if sys.getrefcount(b) > 3]  # list, comprehension, argument


def _probe_dtype(dev: Device, name: str) -> Any:
    key = (id(dev.native), name)
    if key not in _dtype_cache:
        try:
            _dtype_cache[key] = spy.Tensor.empty(dev.native, (1,), name).dtype
        except Exception as exc:
            raise TypeError(f"dtype={name!r}: not a Slang type SlangPy can store ({exc})") from None
    return _dtype_cache[key]


def _shape_tuple(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        out = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape={shape!r}: expected an int or a sequence of ints") from None
    if not out or any(s <= 0 for s in out):
        raise ValueError(f"shape={shape!r}: every dimension must be a positive integer")
    return out


def empty(
    shape: int | Sequence[int],
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """An uninitialised tensor (gradient buffers, if asked for, are zeroed).

    >>> y = pydiff.empty((1024,), dtype="float")
    """
    dev = resolve_device(device)
    name = _dtype_name(dtype)
    native = new_native(dev, _shape_tuple(shape), _probe_dtype(dev, name))
    out = Tensor(native, dev)
    return out.requires_grad_(True) if requires_grad else out


def zeros(
    shape: int | Sequence[int],
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor of zeros.

    >>> w = pydiff.zeros((64, 32), requires_grad=True)
    """
    out = empty(shape, dtype, device, requires_grad)
    out._native.clear()
    return out


def ones(
    shape: int | Sequence[int],
    dtype: Any = "float",
    device: Device | str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor of ones.

    >>> up = pydiff.ones((4,))
    """
    return empty(shape, dtype, device, requires_grad).fill(1.0)


def copy_tensor(dst: Tensor, src: Tensor) -> None:
    """Device-side copy of ``src``'s values into ``dst`` (same shape and dtype)."""
    if dst.shape != src.shape or dst._native.dtype.full_name != src._native.dtype.full_name:
        raise ValueError(f"copy_tensor: {src!r} does not match {dst!r}")
    device = dst.device.native
    size = src._native.element_count * src._native.dtype.buffer_layout.stride
    if not (src._native.is_contiguous() and dst._native.is_contiguous()):
        dst.copy_from_numpy(src.numpy())
        return
    capturing.refuse("copy_tensor")
    _flush_pending()
    encoder = device.create_command_encoder()
    stride = src._native.dtype.buffer_layout.stride
    encoder.copy_buffer(
        dst._native.storage, dst._native.offset * stride, src._native.storage,
        src._native.offset * stride, size,
    )
    device.submit_command_buffer(encoder.finish())
    dst._state.holds_result_of = src._state.holds_result_of
    dst._state.wrote("a device copy")
