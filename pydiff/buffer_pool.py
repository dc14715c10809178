"""Float4 storage buffers of one device, kept for reuse (``device.pool``).

Creating a buffer costs lavapipe about 40 us, more than most kernels of a small training
step. A buffer is free when nothing but the pool refers to it: SlangPy's objects share
Python's reference count, so tensors and views built on a buffer count too. The pool keeps
the SlangPy tensor it made on each of its buffers last (``float4_tensor``), so a buffer that
only that tensor refers to, itself referred to by nothing else, is free as well.

    buffer = device.pool.float4_buffer(256)      # 256 float4s, new or reused
    native = device.pool.float4_tensor(float_layout(...), dtype)   # on one: float_storage
    device.pool.prune()                          # release the unused ones

Every cache pydiff keeps per device is bounded (docs/ops-and-optimizers.md, "Memory"): the
pool by ``POOL_MAX_PER_SIZE`` buffers of one size and ``POOL_MAX_BYTES`` in all up to
``POOL_MAX_FLOAT4S`` (4 MiB), and by ``LARGE_POOL_MAX_PER_SIZE`` and ``LARGE_POOL_MAX_BYTES``
above it (a large buffer costs far more to create than to reuse); the per-device memos
(``device.cached``, ``device.scratch``) are ``BoundedDict``s.
"""

from __future__ import annotations

import errno
import math
import sys
from collections import OrderedDict
from itertools import islice
from typing import Any, Sequence

import slangpy as spy

from .command_queue import DEFER_MAX, CommandQueue
from .errors import OpenFileLimitError, PydiffError, TensorTooLargeError, env_choice
from .lavapipe import near_open_file_limit

#: Most elements of one tensor and threads of one call: SlangPy indexes both with 32-bit
#: signed ints (``int lin_idx`` in its tensor.slang), so more would wrap around silently.
MAX_ELEMENTS = 2**31 - 1
#: Most bytes of one buffer where the API bounds it: Vulkan's maxStorageBufferRange is a 32-bit
#: count of bytes (lavapipe refuses 2**32).
# slang-rhi's CUDA heap refuses 4 GiB too (cuMemAlloc: invalid value, from 2^32 - 16 bytes on
# an H200); requests just under the bound fail at allocation, with TensorTooLargeError.
MAX_BUFFER_BYTES = {"vulkan": 2**32 - 1, "cuda": 2**32 - 1}

POOL_MAX_FLOAT4S = 1 << 18  # 4 MiB: the largest of the small buffers
POOL_MAX_PER_SIZE = 32
# A loop making a new small result per call (``y = f(x)``) pins up to DEFER_MAX of them in the
# deferred list until it is submitted: a size whose buffers are small keeps that many more, or
# the loop would create (and drop) a buffer on nearly every call (~5 us on lavapipe, more on
# CUDA, and a new shader object for each).
POOL_SMALL_SIZE_BYTES = 16 << 20  # per size, for the extra buffers
POOL_MAX_BYTES = 256 << 20  # small sizes together; beyond, free buffers are released first
# Larger buffers are kept too, fewer of them and under a budget of their own (so that large
# tensors never crowd the small ones a training step reuses out of the pool): a new large
# buffer costs far more than its kernel. On lavapipe its memory is mapped on first touch
# (4 KiB pages: no transparent huge pages as NumPy's madvise gets) and unmapped when freed:
# relu over 10M floats took 14 ms into a used buffer and 44 ms into a new one, plus 16 ms to
# free it (2026-11-27). GPUs' allocators are costly too (PyTorch keeps a caching allocator).
LARGE_POOL_MAX_BYTES = 512 << 20  # large sizes together, free or not (long-lived tensors too)
# Free ones left after a new large buffer is made, per size and in all:
LARGE_POOL_MAX_PER_SIZE = 4
LARGE_POOL_MAX_FREE_BYTES = 256 << 20
STORAGE_USAGE = spy.BufferUsage.shader_resource | spy.BufferUsage.unordered_access


def typed_float4_loads(device_type: str) -> bool:
    """Whether pydiff's kernels read float4 buffers through typed ``Buffer<float4>`` views
    (Vulkan: lavapipe loads them for a third of a structured load's cost) rather than
    ``StructuredBuffer<float4>`` (every other backend). Everything else about the fast path is
    the same on every backend. ``PYDIFF_FLOAT4_LOADS=structured`` takes the structured loads
    on Vulkan too, which is how the suite tests the other backends' path without a GPU.

    >>> typed_float4_loads("vulkan"), typed_float4_loads("cuda")
    (True, False)
    """
    # "typed" is the default's name: typed on Vulkan, structured elsewhere
    forced = env_choice("PYDIFF_FLOAT4_LOADS", ("auto", "typed", "structured"))
    return device_type == "vulkan" and forced != "structured"


class BufferPool:
    """rgba32_float buffers by size; see the module docstring."""

    def __init__(self, native_device: spy.Device, queue: CommandQueue, typed_loads: bool = True):
        self.native = native_device
        self.queue = queue
        # A typed view needs the buffer's format; structured loads need only its stride.
        self._format = spy.Format.rgba32_float if typed_loads else spy.Format.undefined
        self._buffers: dict[int, list] = {}
        self.bytes = 0  # of the buffers in the pool, free or not
        self.large_bytes = 0  # of those larger than POOL_MAX_FLOAT4S (counted in bytes too)
        # Sizes counted as large when first kept (the bound may change at run time), and when
        # each was last asked for: a trim keeps the free buffers of the sizes used last.
        self._large: dict[int, int] = {}
        self._asked = 0
        # Per size, where the last free buffer was found since the last submission (and that
        # submission's count): buffers come free in the order they were handed out, so the
        # scan starts there; after a submission (which frees a run of them) it starts from the
        # list's start again, so that a step finds the same buffers as the step before (a
        # cursor kept across steps rotated it through every free buffer of the size: 116 new
        # bound objects in 40 released training steps, the shared cache keyed by buffer).
        self._cursor: dict[int, tuple[int, int]] = {}
        # Per buffer the pool keeps (id(buffer): the entry holds the buffer, so the id stays
        # its own): the SlangPy tensor made on it last, with that tensor's layout and element
        # type. A new SlangPy tensor costs 1.5-3 us, and a training step makes 7 of them on
        # buffers it had the step before. The tensor's reference to the buffer is counted in
        # the free test (``_free``): a buffer is free when nothing else refers to it or to
        # that tensor.
        self._tensors: dict[int, tuple] = {}

    def float4_tensor(self, layout: tuple, dtype: Any) -> spy.Tensor:
        """A SlangPy tensor of ``layout`` (``float_storage.float_layout``'s ``(float4s,
        shape, strides)``) and element type ``dtype`` (a reflection) at the start of a buffer
        from ``float4_buffer``; on a buffer the pool keeps, the one made on it last when that
        one has this very layout and element type (SlangPy's tensors do not change)."""
        buffer, kept = self._take(layout[0])
        if not kept:
            return spy.Tensor(buffer, dtype, layout[1], layout[2], 0)
        key = id(buffer)
        entry = self._tensors.get(key)
        if entry is not None and entry[0] is layout and entry[1] is dtype:
            kept_native = entry[2]
            # (as made: SlangPy's point_to and gradient setters change a tensor in place, e.g.
            # through pydiff's Tensor.native; such a one would alias another tensor's buffers)
            if (
                kept_native.storage is buffer
                and kept_native.grad_in is None
                and kept_native.grad_out is None
            ):
                return kept_native
        native = spy.Tensor(buffer, dtype, layout[1], layout[2], 0)
        self._tensors[key] = (layout, dtype, native)
        return native

    def _free(self, buffer: Any, refs: int) -> bool:
        """Whether ``buffer``, of which the caller counted ``refs`` references with its list's,
        its variable's and getrefcount's argument's (3) among them, is free: nothing else
        refers to it, or only its cached SlangPy tensor, to which nothing else refers."""
        if refs == 3:
            return True
        if refs != 4:
            return False
        entry = self._tensors.get(id(buffer))
        # References to the tensor: the entry's and getrefcount's argument.
        return entry is not None and sys.getrefcount(entry[2]) == 2

    def _release(self, buffer: Any) -> None:
        """Forget a buffer the pool lets go of (its cached tensor, which refers to it)."""
        self._tensors.pop(id(buffer), None)

    def float4_buffer(self, float4s: int) -> Any:
        """A buffer of ``float4s`` float4s (contents undefined), reused when one is free."""
        return self._take(float4s)[0]

    def _take(self, float4s: int) -> tuple[Any, bool]:
        """``float4_buffer``'s buffer, and whether the pool keeps it."""
        # While kernels are appended to a batch but not submitted, a buffer freed since may
        # still be read or written by them: it must not be handed out again before they run.
        # Any thread's batch: a flush here does not submit another thread's on Vulkan.
        pooled = not self.queue.recording
        if float4s in self._large or float4s > POOL_MAX_FLOAT4S and float4s not in self._buffers:
            self._asked += 1
            self._large[float4s] = self._asked
        if pooled:
            buffers = self._buffers.setdefault(float4s, [])
            submitted, start = self._cursor.get(float4s, (-1, 0))
            if submitted != self.queue.submissions:
                start = 0
            # (islice: a slice would add a reference to each buffer, as enumerate's tuple does)
            j = start
            for buffer in islice(buffers, start, None):
                j += 1
                # References: the list, this loop's variable and getrefcount's argument.
                if (refs := sys.getrefcount(buffer)) == 3 or self._free(buffer, refs):
                    self._cursor[float4s] = (self.queue.submissions, j)
                    return buffer, True
            j = 0
            for buffer in islice(buffers, start):
                j += 1
                if (refs := sys.getrefcount(buffer)) == 3 or self._free(buffer, refs):
                    self._cursor[float4s] = (self.queue.submissions, j)
                    return buffer, True
        try:
            buffer = self.native.create_buffer(
                element_count=float4s,
                struct_size=16,
                usage=STORAGE_USAGE,
                format=self._format,
            )
        except RuntimeError as exc:
            raise allocation_failed(16 * float4s, exc) from None
        self.queue.allocated(16 * float4s)
        kept = False
        if pooled:
            kept = self._keep(buffer, float4s)
            if float4s in self._large:
                self._trim_free_large()
                kept = kept and any(b is buffer for b in self._buffers.get(float4s, ()))
        return buffer, kept

    def _keep(self, buffer: Any, float4s: int) -> bool:
        """Add a new buffer to the pool where its size's count and its class's budget allow
        (releasing that class's free buffers first when the budget is reached); whether it
        was added."""
        nbytes, large = 16 * float4s, float4s in self._large
        # (large ones: any number of a size in use, e.g. an optimizer's state; free ones are
        # trimmed per size by _trim_free_large)
        budget = LARGE_POOL_MAX_BYTES if large else POOL_MAX_BYTES
        if not large and len(self._buffers.get(float4s, ())) >= _per_size(nbytes):
            return False
        if self._class_bytes(large) + nbytes > budget:
            self.prune(large=large)
        if self._class_bytes(large) + nbytes <= budget:
            self._buffers.setdefault(float4s, []).append(buffer)
            self.bytes += nbytes
            if large:  # (its class again: the prune may have dropped the size's empty list)
                self.large_bytes += nbytes
                self._large.setdefault(float4s, self._asked)
            return True
        return False

    def _trim_free_large(self) -> None:
        """Release free large buffers past ``LARGE_POOL_MAX_PER_SIZE`` of a size and
        ``LARGE_POOL_MAX_FREE_BYTES`` in all (a large size that comes back finds one; sizes
        no longer used give their memory back)."""
        free = 0
        for size in sorted(self._large, key=self._large.__getitem__, reverse=True):
            buffers = self._buffers.get(size, [])
            kept, free_here = [], 0
            for buffer in buffers:
                # References: the list, this loop's variable and getrefcount's argument.
                refs = sys.getrefcount(buffer)  # (read first: an argument of _free adds one)
                if self._free(buffer, refs):
                    if free_here == LARGE_POOL_MAX_PER_SIZE or (
                        free + 16 * size > LARGE_POOL_MAX_FREE_BYTES
                    ):
                        self.bytes -= 16 * size
                        self.large_bytes -= 16 * size
                        self._release(buffer)
                        continue
                    free += 16 * size
                    free_here += 1
                kept.append(buffer)
            if kept:
                self._buffers[size] = kept
            else:
                self._buffers.pop(size, None)
                self._cursor.pop(size, None)
                del self._large[size]

    def _class_bytes(self, large: bool) -> int:
        return self.large_bytes if large else self.bytes - self.large_bytes

    def prune(self, large: bool | None = None) -> None:
        """Release the buffers nothing else refers to (with ``large``: only the large ones, or
        only the small ones)."""
        for size, buffers in list(self._buffers.items()):
            if large is not None and (size in self._large) != large:
                continue
            # References: the list, the loop's variable and getrefcount's argument.
            kept = []
            for b in buffers:
                refs = sys.getrefcount(b)  # (read first: an argument of _free would add one)
                if self._free(b, refs):
                    self._release(b)
                else:
                    kept.append(b)
            released = 16 * size * (len(buffers) - len(kept))
            self.bytes -= released
            self.large_bytes -= released * (size in self._large)
            if kept:
                self._buffers[size] = kept
            else:
                del self._buffers[size]
                self._large.pop(size, None)

        # the cursors of the sizes kept, in a new dict (one that shrank keeps its memory): a
        # cursor per size ever reused would pile up (32k sizes: 1.3 MB past empty_cache)
        self._cursor = {k: v for k, v in self._cursor.items() if k in self._buffers}

    def sizes(self) -> dict[str, int]:
        """How many buffers the pool holds and their bytes."""
        return {"buffers": sum(map(len, self._buffers.values())), "bytes": self.bytes}


def _per_size(nbytes: int) -> int:
    """How many small buffers of ``nbytes`` each the pool keeps."""
    extra = min(DEFER_MAX, POOL_SMALL_SIZE_BYTES // nbytes)
    return POOL_MAX_PER_SIZE + max(0, extra)


def format_bytes(n: int) -> str:
    """``n`` bytes in readable units: '64.0 GiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # unreachable


def check_size(what: str, device_type: str, shape: Sequence[int], element_bytes: int) -> None:
    """Raise TensorTooLargeError, before anything is allocated, when ``shape`` holds more
    elements than SlangPy can index or more bytes than one buffer of ``device_type`` can hold.

    >>> check_size("pydiff.zeros", "vulkan", (2**34,), 4)   # TensorTooLargeError: ... 64.0 GiB
    """
    numel = math.prod(shape)
    nbytes = numel * element_bytes
    max_bytes = MAX_BUFFER_BYTES.get(device_type)
    if numel <= MAX_ELEMENTS and (max_bytes is None or nbytes <= max_bytes):
        return
    limit = f"at most {MAX_ELEMENTS:,} elements (SlangPy indexes them with 32-bit ints)"
    if max_bytes is not None:
        limit += f" and {max_bytes:,} bytes per buffer ({device_type}'s limit)"
    raise TensorTooLargeError(
        f"{what} of shape {tuple(shape)} is {numel:,} elements = {nbytes:,} bytes "
        f"({format_bytes(nbytes)}, {element_bytes} bytes each), more than a {device_type} "
        f"device allows: {limit}; split the work into smaller tensors or calls"
    )


def allocation_failed(nbytes: int | None, exc: Exception, what: str = "") -> PydiffError:
    """The error for a buffer the device refused (of ``nbytes`` if known): OpenFileLimitError
    when the process is at its open-file limit (lavapipe's buffers each hold a descriptor,
    and the device's error does not say so), else TensorTooLargeError."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    size = f" of {format_bytes(nbytes)} ({nbytes:,} bytes)" if nbytes is not None else ""
    if (files := near_open_file_limit()) is not None:
        return OpenFileLimitError(
            errno.EMFILE,
            f"{what}the device could not allocate a buffer{size}: the process has {files[0]:,} "
            f"open files of its limit of {files[1]:,} (RLIMIT_NOFILE), and each device buffer "
            "on lavapipe holds one. Raise the limit (`ulimit -n` in the shell, or "
            "resource.setrlimit(resource.RLIMIT_NOFILE, ...) before pydiff opens the device) "
            "or keep fewer tensors alive (a fresh Tape per step, or backward with "
            "retain_graph=False, frees a tape's intermediates; pydiff.empty_cache() releases "
            "the buffers of freed tensors at once)",
        )
    return TensorTooLargeError(
        f"{what}the device could not allocate a buffer{size}: {first}; it may be out of "
        "memory (free tensors, pydiff.empty_cache()) or the buffer may exceed the device's "
        "own limit"
    )


class BoundedDict(OrderedDict):
    """A dict keeping only the ``max_items`` most recently used entries (a read or a write
    counts as a use), and, with ``max_bytes``, at most that many bytes of device buffers in
    its values (the newest entry is always kept); evicted values are released when nothing
    else refers to them.

    >>> d = BoundedDict(2); d["a"] = 1; d["b"] = 2; d["a"]; d["c"] = 3; list(d)
    ['a', 'c']
    """

    def __init__(self, max_items: int, max_bytes: int | None = None) -> None:
        super().__init__()
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.bytes = 0  # device bytes held by the values (counted when max_bytes is set)
        self._sizes: dict[Any, int] = {}

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self:
            del self[key]
        super().__setitem__(key, value)
        if self.max_bytes is not None:
            self._sizes[key] = size = device_bytes(value)
            self.bytes += size
        while len(self) > self.max_items or (
            self.max_bytes is not None and self.bytes > self.max_bytes and len(self) > 1
        ):
            self.popitem(last=False)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self.bytes -= self._sizes.pop(key, 0)

    def popitem(self, last: bool = True) -> tuple:
        key, value = super().popitem(last)
        self.bytes -= self._sizes.pop(key, 0)
        return key, value

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self.bytes -= self._sizes.pop(key, 0)
        return super().pop(key, *default)

    def clear(self) -> None:
        super().clear()
        self._sizes.clear()
        self.bytes = 0

    def release_buffers(self) -> None:
        """Drop the entries whose values hold device buffers (``empty_cache``)."""
        for key in [k for k, v in self.items() if device_bytes(v)]:
            del self[key]


def device_bytes(value: Any) -> int:
    """Bytes of the distinct device buffers in ``value`` (a SlangPy buffer or tensor, a
    pydiff tensor, or lists, tuples and dicts of them); other values count 0."""
    buffers: dict[int, int] = {}

    def visit(v: Any) -> None:
        if isinstance(v, spy.Tensor):
            v = v.storage
        elif hasattr(v, "storage") and isinstance(getattr(v.storage, "buffer", None), spy.Buffer):
            v = v.storage.buffer  # a pydiff Tensor
        if isinstance(v, spy.Buffer):
            buffers[v.native_handle.value] = v.size
        elif isinstance(v, (list, tuple)):
            for item in v:
                visit(item)
        elif isinstance(v, dict):
            for item in v.values():
                visit(item)

    visit(value)
    return sum(buffers.values())
