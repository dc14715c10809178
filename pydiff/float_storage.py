"""Storage of float and float-vector tensors (``float``, ``float2``, ``float3``, ``float4``):
a buffer of float4s from the device's pool (``dev.pool``), reused once nothing refers to it.

A tensor of n elements of ``width`` floats takes the first ``n * width`` floats of a buffer
of ``ceil(n * width / 4)`` float4s, element i at float ``i * width`` as in a buffer of its
own: SlangPy binds it as usual (its stride is the element's, not the buffer's 16 bytes) and
pydiff's kernels read it as floats (float tensors: as float4s). A new buffer costs far more
than a reused one (lavapipe: ~7 ms for a fresh 12 MB ``float3`` result of 2^20 elements).

    native = pooled_tensor(dev, (1024,), dev.dtype("float3"), 3)     # 768 float4s
    FLOAT_WIDTHS["vector<float,3>"], FLOAT_WIDTHS["float3"]          # 3, 3

An integer a float cannot hold exactly is refused (``exact_ints.refuse_rounded_ints``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import slangpy as spy

from . import capturing
from .buffer_pool import check_size
from .exact_ints import refuse_rounded_ints as refuse_rounded_ints  # (storage's import)

if TYPE_CHECKING:
    from .device import Device

#: Element types kept in pooled float4 buffers, by name and by SlangPy's full name: floats
#: per element.
FLOAT_WIDTHS = {"float": 1}
FLOAT_WIDTHS.update({f"float{w}": w for w in (2, 3, 4)})
FLOAT_WIDTHS.update({f"vector<float,{w}>": w for w in (2, 3, 4)})

# Layouts by (device type, shape, width): (float4s, shape, C strides), the size checked once.
# A few microseconds of Python per tensor otherwise; bounded (shapes of a loop that varies
# them are dropped wholesale, then found again).
_LAYOUTS: dict[tuple, tuple] = {}
_LAYOUTS_MAX = 4096


def float_layout(device_type: str, shape: tuple, width: int, what: str) -> tuple:
    """``(float4s, shape, C strides)`` of a tensor of ``shape`` (a tuple) of ``width``-float
    elements, its size checked (TensorTooLargeError naming ``what``) the first time.

    >>> float_layout("vulkan", (5, 3), 3, "a float3 tensor")     # (12, [5, 3], [3, 1])
    """
    key = (device_type, shape, width)
    layout = _LAYOUTS.get(key)
    if layout is None:
        dims = [int(d) for d in shape]
        check_size(what, device_type, dims, 4 * width)
        strides, step = [], 1
        for d in reversed(dims):
            strides.append(step)
            step *= d
        layout = (max(1, -(-math.prod(dims) * width // 4)), dims, strides[::-1])
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def pooled_tensor(
    dev: "Device", shape: tuple, dtype: Any, width: int, zero: bool = False, what: str = ""
) -> spy.Tensor:
    """A SlangPy tensor of ``shape`` (a non-empty tuple) and element type ``dtype`` (SlangPy's
    reflection, of ``width`` floats) in a pooled buffer of float4s; zeroed in order with the
    device's pending work when ``zero``.

    >>> pooled_tensor(dev, (8,), dev.dtype("float"), 1, zero=True)
    """
    native = dev.pool.float4_tensor(float_layout(dev.type, shape, width, what), dtype)
    if zero:
        # In order with the pending work (a pooled buffer may be read by unsubmitted commands
        # of an ended batch); nothing pending reads its new contents, so even inside a batch
        # (whose work runs after the deferred list) the zeroing is early enough.
        dev.queue.defer(native.clear, (native.storage,))
        rec = capturing.recording()
        if rec is not None:
            rec.record_clear(dev.queue, native)
    return native
