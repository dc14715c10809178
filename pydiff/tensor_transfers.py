"""Values in and out of a tensor: host reads (``numpy``) and writes (``copy_from_numpy``,
an upload recorded in order with other commands), device copies (``copy_``), and the
bookkeeping of a write from outside a call (``wrote_from_outside``).

``TensorTransfers`` is mixed into ``Tensor``, whose fields (``_native``, ``_device``,
``_shape``, ``storage``) it reads.

    x.copy_from_numpy(np.zeros(x.shape, np.float32)); x.numpy()
    before.copy_(x)                       # on the device, in order with pending work
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import capturing, forward_trace, staging, temporary_copies, tensor_methods
from .exact_ints import refuse_rounded_list
from .storage import COPY_FROM_GRAPH, bool_words, element_shape, has_c_strides, host_cast
from .storage import read_back, upload_numpy_type
from .tensor_operators import copy_refusal

if TYPE_CHECKING:
    from typing_extensions import Self


class TensorTransfers:
    """Host reads and writes and device copies of a ``Tensor``'s values (mixed into it)."""

    def numpy(self) -> np.ndarray:
        """Copy to a NumPy array (vector elements become a trailing dimension)."""
        values = read_back(self._device, self._native)  # (flushes first, under the queue's lock)
        return values if self._shape else values.reshape(self.expected_numpy_shape())

    def expected_numpy_shape(self) -> tuple[int, ...]:
        """The NumPy shape of this tensor's values (vector/matrix elements trailing)."""
        if self.dtype == "float":  # (the common case: no reflection read, ~2 us)
            return self._shape
        return self._shape + element_shape(self._element)

    def copy_from_numpy(self, data: Any, *, caller: str = "", count: bool = True) -> Self:
        """Overwrite the values from host data of the same shape; returns self. ``caller``:
        the API its errors name (pydiff's own callers pass theirs, e.g. ``"Tensor.fill"``);
        ``count`` False: the caller counts the write (``x[k] = v``, a write of part).

        >>> x.copy_from_numpy(np.zeros(x.shape, np.float32))
        """
        caller or temporary_copies.refuse(self, caller := "copy_from_numpy")
        arr, want = np.asarray(data), self.expected_numpy_shape()
        if arr.shape != want:
            raise ValueError(
                f"{caller}: data has shape {arr.shape}, tensor of dtype {self.dtype} "
                f"and shape {self.shape} needs {want}"
            )
        up, kind = upload_numpy_type(self._native, self.scalar_type), self.scalar_type
        refuse_rounded_list(data, arr, up, caller)  # ([2**63 + 1, 0]: rounded by NumPy)
        arr = host_cast(arr, up, caller, kind == "bool")
        arr = arr if has_c_strides(arr) and arr.flags.writeable else arr.copy("C")  # (SlangPy)
        capturing.refuse("a host write (copy_from_numpy, fill, or pydiff.tensor(array))")
        queue, target = self._device.queue, bool_words(self._device, self._native)
        with queue.lock:
            queue.enter()
            staging.write(queue, target, arr, not self._shape, self._device.flush)
        return self.wrote_from_outside() if count else self

    def upload(self, data: Any, encoder: Any) -> bool:
        """Record a copy of float ``data`` (of this tensor's shape) into ``encoder``, in order
        with its other commands; False (nothing done) unless the storage takes raw floats."""
        n = self._native
        if not (n.dtype.full_name == "float" and n.offset == 0 and n.is_contiguous()):
            return False
        values = np.require(data, np.float32, "CWE").ravel()  # (read-only: copied, for SlangPy)
        with self._device.queue.lock:  # an upload, even recorded, is a copy: exclusive
            encoder.upload_buffer_data(n.storage, 0, values)
        rec = capturing.recording()
        if rec is not None:
            rec.record_upload(self._device.queue, n.storage, values)
        self.wrote_from_outside()
        return True

    def wrote_from_outside(self, what: str = "a host write (copy_from_numpy/fill)") -> Self:
        """Record that all values were overwritten by ``what`` (the host, torch), not a call."""
        self.storage.holds_result_of = None
        self.storage.wrote(what, everything=True)
        return forward_trace.replaced(self)  # under pydiff.jvp: a tangent no more

    def copy_(self, src: Self) -> Self:
        """Copy ``src``'s values (same shape and dtype) into this tensor on the device:
        ``before.copy_(x)``. Values with a gradient path (or copied from such) are marked."""
        temporary_copies.refuse(self, "copy_")
        same = isinstance(src, TensorTransfers) and src.shape == self.shape
        if not same or src.dtype != self.dtype:
            raise copy_refusal(self, src)
        graph = src.requires_grad or src.storage.last_writer == COPY_FROM_GRAPH  # (a chain)
        graph = graph or tensor_methods.call("copied_from", src) is not None  # (through calls)
        if not (src.native.is_contiguous() and self._native.is_contiguous()):  # (by the host)
            self.copy_from_numpy(src.numpy(), caller="Tensor.copy_")
            self.storage.holds_result_of = src.storage.holds_result_of  # (as below: STRICT)
            if graph:
                self.storage.wrote(COPY_FROM_GRAPH, True)  # (marked as below)
            return forward_trace.replaced(self, src)
        capturing.refuse("a device copy (copy_/clone)")
        native = self._device.native
        stride = src.element_type.buffer_layout.stride
        with self._device.queue.lock:
            self._device.flush()
            encoder = native.create_command_encoder()
            at, size = (self._native.offset * stride, src.native.offset * stride), stride
            size *= src.native.element_count
            encoder.copy_buffer(self._native.storage, at[0], src.native.storage, at[1], size)
            native.submit_command_buffer(encoder.finish())
        self.storage.holds_result_of = src.storage.holds_result_of
        self.storage.wrote(COPY_FROM_GRAPH if graph else "a device copy", True)
        return forward_trace.replaced(self, src)  # under pydiff.jvp: src's tangent
