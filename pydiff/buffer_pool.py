"""Float4 storage buffers of one device, kept for reuse (``device.pool``).

Creating a buffer costs lavapipe about 40 us, more than most kernels of a small training
step. A buffer is free when nothing but the pool refers to it: SlangPy's objects share
Python's reference count, so tensors and views built on a buffer count too.

    buffer = device.pool.float4_buffer(256)      # 256 float4s, new or reused
    device.pool.prune()                          # release the unused ones
"""

from __future__ import annotations

import sys
from typing import Any

import slangpy as spy

from .command_queue import CommandQueue

POOL_MAX_FLOAT4S = 1 << 18  # 4 MiB: bigger buffers are rare enough to allocate each time
POOL_MAX_PER_SIZE = 32
STORAGE_USAGE = spy.BufferUsage.shader_resource | spy.BufferUsage.unordered_access


class BufferPool:
    """rgba32_float buffers by size; see the module docstring."""

    def __init__(self, native_device: spy.Device, queue: CommandQueue):
        self.native = native_device
        self.queue = queue
        self._buffers: dict[int, list] = {}

    def float4_buffer(self, float4s: int) -> Any:
        """A buffer of ``float4s`` float4s (contents undefined), reused when one is free."""
        # While kernels are appended but not submitted, a buffer freed since may still be
        # written by them: it must not be handed out again before they run.
        pooled = float4s <= POOL_MAX_FLOAT4S and not self.queue.pending
        if pooled:
            buffers = self._buffers.setdefault(float4s, [])
            for buffer in buffers:
                # References: the list, this loop's variable and getrefcount's argument.
                if sys.getrefcount(buffer) == 3:
                    return buffer
        buffer = self.native.create_buffer(
            element_count=float4s,
            struct_size=16,
            usage=STORAGE_USAGE,
            format=spy.Format.rgba32_float,
        )
        if pooled and len(buffers) < POOL_MAX_PER_SIZE:
            buffers.append(buffer)
        return buffer

    def prune(self) -> None:
        """Release the buffers nothing else refers to."""
        for size, buffers in list(self._buffers.items()):
            # References: the list, the comprehension's variable and getrefcount's argument.
            self._buffers[size] = [b for b in buffers if sys.getrefcount(b) > 3]
