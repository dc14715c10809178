"""``Device``: a SlangPy device and what pydiff keeps for it, each reached as an attribute
(its queue of pending work, compiled kernels, buffer pools, scratch buffers, pydiff's Slang
library, a memo for the layers above); ``shader_dir``, the folder of that library. Opening
devices (one per type, include paths and cache folder; the default one) is ``device``'s.

    dev.queue, dev.kernels, dev.pool, dev.scratch, dev.library, dev.cached(key, make)
"""

from __future__ import annotations

import itertools
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import slangpy as spy

from .buffer_pool import BoundedDict, BufferPool, typed_float4_loads
from .command_queue import CommandQueue
from .kernels import KernelCache

#: Bounds of the per-device memos, ``scratch`` (buffers per size) and ``cached`` (LRU).
SCRATCH_MAX_ITEMS = 256
SCRATCH_MAX_BYTES = 512 * 2**20
CACHED_MAX_ITEMS = 1024


_ordinals = itertools.count(1)


def shader_dir() -> Path:
    """Folder of pydiff's Slang library: installed package data first, then the checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "shaders", here.parent / "shaders"):
        if (candidate / "pydiff.slang").is_file():
            return candidate
    raise FileNotFoundError(
        f"pydiff's shader library (pydiff.slang) is missing: looked in {here / 'shaders'} "
        f"and {here.parent / 'shaders'}; reinstall pydiff"
    )


class Device:
    """A SlangPy device and what pydiff keeps for it, each reached as an attribute:

    - ``native``: the ``slangpy.Device``; ``type``: 'vulkan', 'cuda', ...
    - ``queue``: pending GPU work (``CommandQueue``); ``flush()`` submits it;
    - ``library``: pydiff's Slang library (``shaders/pydiff.slang``), a raw SlangPy module;
    - ``kernels``: compiled compute kernels and bound shader objects (``KernelCache``);
    - ``pool``: float4 storage buffers kept for reuse (``BufferPool``), one per thread;
    - ``scratch``: gradient buffers per size, one per thread (``BoundedDict``: bounded by
      ``SCRATCH_MAX_ITEMS`` and ``SCRATCH_MAX_BYTES``; ``scratch.bytes`` is what it holds);
    - ``dtype(name)``: SlangPy's reflection of a Slang element type;
    - ``cached(key, make)``: a per-device memo for the layers above (wrapped modules, constants).

    >>> dev = pydiff.create_device("vulkan")
    >>> dev.type, dev.native        # 'vulkan', the slangpy.Device underneath
    >>> x = pydiff.zeros((4,), device=dev)
    """

    def __init__(
        self, native: spy.Device, type_name: str, cache_paths: tuple[str, str] | None = None
    ):
        self._native = native
        self.type = type_name
        #: This device's number among those opened in this process (1, 2, ...), in its repr.
        self.ordinal = next(_ordinals)
        #: (module cache, shader cache) folders of the persistent compile cache, or None.
        self.cache_paths = cache_paths
        self.queue = CommandQueue(native)
        #: pydiff's kernels read float4 buffers through typed views here (Vulkan) or
        #: structured ones (elsewhere); the only backend difference of the fast path.
        self.typed_loads = typed_float4_loads(type_name)
        self.kernels = KernelCache(native, shader_dir(), self.queue, self.typed_loads)
        self._per_thread = threading.local()
        # The shared per-device state below (the library, dtypes, the memo) is filled lazily
        # by whichever thread comes first: the lock makes that a check-and-fill, never a
        # lookup racing another thread's eviction of the same key.
        self._lock = threading.RLock()
        # ``cached``'s make() runs under this one, not under ``_lock``: a first use's compile
        # (50-500 ms) stalled every thread's lookups of entries already made (re-entrant: a
        # make() may use other entries, made meanwhile if need be).
        self._building = threading.RLock()
        self._library: spy.Module | None = None
        self._dtypes: dict[str, Any] = {}
        self._cache: dict[Any, Any] = BoundedDict(CACHED_MAX_ITEMS, SCRATCH_MAX_BYTES)
        self._kernel_keys: set = set()  # (``cached(kernels=True)``'s entries)
        self._releases: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def native(self) -> spy.Device:
        """The ``slangpy.Device`` underneath. The deferred list is submitted first, so that
        what is done through it (``wait_for_idle()``, a read, a SlangPy call) comes after
        pydiff's pending kernels.

        >>> dev.native.wait_for_idle()     # waits for the ops issued so far
        """
        self.queue.enter()
        if self.queue.deferred or self.queue.open_batches:
            self.queue.flush_deferred()
        return self._native

    def wait(self) -> None:
        """Submit the pending work and wait until the device has finished it.

        >>> dev.wait()        # e.g. before timing, or before reading buffers through SlangPy
        """
        self.flush()
        self.queue.wait()

    @property
    def scratch(self) -> dict:
        """This thread's scratch buffers: a backward writes a broadcast parameter's full-shape
        gradient (or fixed-point words) into one and reads it back, so threads sharing one
        would add up each other's gradients."""
        buffers = getattr(self._per_thread, "scratch", None)
        if buffers is None:
            buffers = self._per_thread.scratch = BoundedDict(SCRATCH_MAX_ITEMS, SCRATCH_MAX_BYTES)
        return buffers

    @property
    def pool(self) -> BufferPool:
        """This thread's pool of float4 buffers. Per thread because a buffer is handed out
        again once nothing refers to it and this thread has no unsubmitted work: another
        thread's pending kernels may still write a buffer it has just let go."""
        pool = getattr(self._per_thread, "pool", None)
        if pool is None:
            self.queue.enter()
            pool = self._per_thread.pool = BufferPool(self._native, self.queue, self.typed_loads)
        return pool

    @property
    def adapter_name(self) -> str:
        return self._native.info.adapter_name

    @property
    def supports_float_atomics(self) -> bool:
        feats = {str(f).split(".")[-1] for f in self._native.features}
        return "atomic_float" in feats or self.type == "cuda"

    @property
    def library(self) -> spy.Module:
        """pydiff's Slang library (shaders/pydiff.slang) on this device, as a SlangPy module
        (its calls run at once: the deferred list is submitted first)."""
        if self.queue.deferred or self.queue.open_batches:
            self.queue.flush_deferred()
        with self._lock:
            return self._load_library()

    def _load_library(self) -> spy.Module:
        if self._library is None:
            # By name, as a user's `import pydiff;` finds it: with a module cache, loading it
            # by path makes a second copy whose types (FwdDiffTensor<N>) differ from theirs.
            self._library = spy.Module(self.native.load_module("pydiff"))
        return self._library

    def dtype(self, name: str) -> Any:
        """SlangPy's reflection of the Slang element type ``name`` ('float', 'float3', ...)."""
        found = self._dtypes.get(name)
        if found is not None:
            return found
        with self._lock:
            return self._dtype(name)

    def _dtype(self, name: str) -> Any:
        found = self._dtypes.get(name)
        if found is None:
            try:
                found = spy.Tensor.empty(self.native, (1,), name).dtype
            except Exception as exc:
                # SlangPy's first line (its later ones are the C++ source location)
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc)
                raise TypeError(
                    f"dtype={name!r}: not a Slang type SlangPy can store ({reason})"
                ) from None
            self._dtypes[name] = found
        return found

    def cached(self, key: Any, make: Callable[[], Any], kernels: bool = False) -> Any:
        """``make()`` once per key on this device, for objects built by higher layers (LRU);
        ``kernels``: an entry of compiled kernels or library functions (the generated kernels'
        memos), which ``empty_cache`` drops (made again on the next use)."""
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        with self._building:  # one build at a time: the same key is made once
            with self._lock:
                if key in self._cache:  # (another thread's build, meanwhile)
                    return self._cache[key]
            making = getattr(self._per_thread, "making", None)
            if making is None:
                making = self._per_thread.making = set()
            if key in making:  # (the lock is re-entrant: make() would recurse without end)
                raise RuntimeError(
                    f"Device.cached: make() for key {key!r} asked for the same key while "
                    "building it; a make() may use other keys, never its own"
                )
            making.add(key)
            try:
                value = make()
            finally:
                making.discard(key)
            with self._lock:
                self._cache[key] = value
                if kernels:
                    self._kernel_keys.add(key)
            return value

    def on_empty_cache(self, owner: Any, release: Callable[[Any], None]) -> None:
        """Have ``empty_cache`` call ``release(owner)`` while ``owner`` lives (held weakly):
        what a layer above keeps outside ``cached`` that holds compiled kernels (call plans).

        >>> fn.module.device.on_empty_cache(fn, forget_plans)
        """
        with self._lock:
            self._releases[owner] = release

    def flush(self) -> None:
        """Submit the work queued on this device (before reading results on the host)."""
        self.queue.flush()

    def empty_cache(self) -> None:
        """Release the storage buffers, this thread's scratch buffers, the compiled kernels
        (pydiff's own, the generated ones and the call plans holding them: built again on
        their next use) and the bound shader objects kept for reuse."""
        self.queue.flush()  # queued kernels may still read a scratch buffer
        self.scratch.clear()
        with self._lock:  # memo entries holding buffers (e.g. layer_norm's default weights)
            self._cache.release_buffers()
            for key in self._kernel_keys:
                self._cache.pop(key, None)
            self._kernel_keys.clear()
            releases = list(self._releases.items())
        for owner, release in releases:
            release(owner)
        self.kernels.release()
        self.pool.prune()
        self.queue.staging.clear()
        self.flush()  # slang-rhi frees a released buffer once the work before it has finished,
        self._native.wait_for_idle()  # (as its queue's wait_for_idle retires that work)

    def __repr__(self) -> str:
        # The ordinal tells two devices of one type and adapter apart in error messages.
        return f"<pydiff.Device #{self.ordinal} {self.type}: {self.adapter_name}>"

    def __eq__(self, other: object) -> bool:
        return other is self or (isinstance(other, Device) and other.native is self._native)

    def __hash__(self) -> int:
        return id(self._native)
