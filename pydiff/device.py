"""Devices: a SlangPy device with pydiff's shader library on its include path, and
everything pydiff keeps per device.

    dev = pydiff.create_device()            # CUDA, then D3D12, then Vulkan
    print(dev.type, dev.adapter_name)
    pydiff.available_devices()              # e.g. ['vulkan']
"""

from __future__ import annotations


import itertools
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import slangpy as spy

from . import call_data_loads, call_uniforms, compile_cache, cuda_context
from .buffer_pool import BoundedDict, BufferPool, typed_float4_loads
from .command_queue import CommandQueue
from .device_names import AUTO_ORDER, auto_override, normalise_type
from .errors import DeviceUnavailableError, env_flag
from .kernels import KernelCache
from .slangpy_loader import missing_driver, quiet_native_output
from .lavapipe import LAVAPIPE_INLINE_MAX_CPUS, choose_lavapipe_threads  # noqa: F401 (public)
from .lavapipe import before_device_opens, lavapipe_threads_text  # noqa: F401 (public here)

#: Bounds of the per-device memos, ``scratch`` (buffers per size) and ``cached`` (LRU).
SCRATCH_MAX_ITEMS = 256
SCRATCH_MAX_BYTES = 512 * 2**20
CACHED_MAX_ITEMS = 1024


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
            if key not in self._cache:
                self._cache[key] = make()
                if kernels:
                    self._kernel_keys.add(key)
            return self._cache[key]

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


_ordinals = itertools.count(1)
# Opening a device (and the default one) is one step per process: two threads asking at once
# get the same Device, not two devices whose tensors would not mix.
_open_lock = threading.RLock()
_open_devices: dict[tuple, Device] = {}
_failed_types: dict[str, str] = {}
_default: Device | None = None


def _create_native(type_name: str, paths: list, caches: tuple | None, validation: bool) -> Any:
    """A SlangPy device as ``spy.create_device`` makes it, plus the persistent caches, without
    slang-rhi's validation layer and SlangPy's shader hot reload: both on by default, they
    wrap every command and submission (validation) and poll the shader files at every
    submission (hot reload), 60-70 us of CPU in an eager MLP step of 0.9-1.0 ms on lavapipe
    (docs/benchmarks-history.md, "Host cost per op"). ``PYDIFF_RHI_VALIDATION=1`` turns validation
    back on, to debug pydiff's own use of the device."""
    options: dict[str, Any] = {
        "enable_rhi_validation": validation,
        "enable_hot_reload": False,
    }
    if caches is not None:
        options.update(
            module_cache_path=caches[0],
            shader_cache_path=caches[1],
            shader_cache_size=compile_cache.max_bytes(),
        )
    if type_name == "cuda":  # PyTorch's context, current on every thread (cuda_context)
        options["existing_device_handles"] = cuda_context.primary_handles()
    call_uniforms.install()  # no push constants past what Vulkan drivers take
    call_data_loads.install()  # no Slang warning about SlangPy's struct-argument loads
    return spy.Device(
        type=getattr(spy.DeviceType, type_name),
        compiler_options={"include_paths": [str(spy.SHADER_PATH), *paths]},
        **options,
    )


def open_device(
    type_name: str,
    include_paths: tuple[str, ...] = (),
    cache_dir: str | os.PathLike | bool | None = None,
) -> Device:
    """Open (or return the already open) device of a normalised type name, include paths and
    cache folder (see compile_cache.root); DeviceUnavailableError when it cannot be opened
    (remembered: later calls fail fast)."""
    with _open_lock:
        return _open_device(type_name, include_paths, cache_dir)


def _open_device(
    type_name: str, include_paths: tuple[str, ...], cache_dir: str | os.PathLike | bool | None
) -> Device:
    base = compile_cache.root(cache_dir)
    key = (type_name, include_paths, str(base))
    if key in _open_devices:
        return _open_devices[key]
    if type_name not in _failed_types and (why := missing_driver(type_name)):
        _failed_types[type_name] = f"could not open a '{type_name}' device: {why}"
    if type_name in _failed_types:
        raise DeviceUnavailableError(_failed_types[type_name])
    paths = [str(shader_dir()), *include_paths]
    validation = env_flag("PYDIFF_RHI_VALIDATION", False)  # (a typo: ValueError, not a failed open)
    before_device_opens(type_name)
    caches = compile_cache.prepare(base, type_name)
    try:
        with quiet_native_output():
            native = _create_native(type_name, paths, caches, validation)
    except Exception as exc:  # slangpy raises RuntimeError("Failed to create device!")
        hint = (
            " On a machine without a GPU, install Mesa's lavapipe (Vulkan on the CPU): "
            "run `make setup`, or see docs/getting-started.md."
            if type_name == "vulkan"
            else ""
        )
        msg = f"could not open a '{type_name}' device: {str(exc).splitlines()[0]}.{hint}"
        _failed_types[type_name] = msg
        compile_cache.discard_new(caches)
        raise DeviceUnavailableError(msg) from None
    dev = Device(native, type_name, caches)
    _open_devices[key] = dev
    return dev


def create_device(
    type: str | spy.DeviceType = "auto",
    include_paths: Sequence[str | os.PathLike] = (),
    *,
    cache_dir: str | os.PathLike | bool | None = None,
) -> Device:
    """Open a device; ``"auto"`` tries CUDA, then D3D12, then Vulkan.

    The environment variable ``PYDIFF_DEVICE`` (e.g. ``vulkan``) overrides ``"auto"`` (a
    value it does not take: ``EnvironmentSettingError``).
    Compiled modules and shaders persist between processes in ``cache_dir`` (default: the
    per-user cache folder, ``$PYDIFF_CACHE_DIR``; ``False`` or ``PYDIFF_CACHE=0``: none; see
    docs/devices.md). Devices are cached: asking twice for the same type, include paths and
    cache folder returns the same one.

    >>> dev = pydiff.create_device()
    >>> dev = pydiff.create_device("vulkan", include_paths=["my_shaders"])
    >>> m = pydiff.load_module("model.slang", device=dev)
    """
    name = normalise_type(type)
    paths = tuple(str(Path(p).resolve()) for p in include_paths)
    if name == "auto":
        override = auto_override()  # a value it does not take: EnvironmentSettingError
        if override:
            return open_device(override, paths, cache_dir)
        errors = []
        for candidate in AUTO_ORDER:
            try:
                return open_device(candidate, paths, cache_dir)
            except DeviceUnavailableError as exc:
                errors.append(str(exc))
        raise DeviceUnavailableError(
            "no GPU backend could be opened here:\n  " + "\n  ".join(errors)
        )
    return open_device(name, paths, cache_dir)


def available_devices() -> list[str]:
    """Device types that open on this machine, in ``"auto"`` order.

    >>> pydiff.available_devices()
    ['vulkan']
    """
    found = []
    for name in AUTO_ORDER:
        try:
            open_device(name, ())
            found.append(name)
        except DeviceUnavailableError:
            pass
    return found


def default_device() -> Device:
    """The device used when ``device=`` is omitted; opened on first use."""
    global _default
    with _open_lock:
        if _default is None:
            _default = create_device("auto")
        return _default


def set_default_device(device: Device | str | spy.Device | None) -> None:
    """Make ``device`` the default (a Device, a type name, a slangpy.Device, or None to
    reopen lazily)."""
    global _default
    _default = None if device is None else resolve_device(device)


def open_devices() -> list[Device]:
    """The devices pydiff has opened in this process."""
    return list(_open_devices.values())


def forget_open_devices() -> list[Device]:
    """In a forked child (``pydiff.forkguard``): the devices the parent had open, forgotten
    (the default too), so that asking for a device opens one of this process; the lock
    starts afresh (another thread of the parent may have held it at the fork)."""
    global _default, _open_lock
    found = list({id(d): d for d in (*_open_devices.values(), _default) if d is not None}.values())
    _open_devices.clear()
    _default, _open_lock = None, threading.RLock()
    return found


def refuse_type(type_name: str, message: str) -> None:
    """Make every later open of ``type_name`` in this process fail with ``message`` (a forked
    child of a CUDA process: ``pydiff.forkguard``); ``"auto"`` then tries the next type."""
    _failed_types[type_name] = message


def resolve_device(device: Device | str | None) -> Device:
    """A Device from a Device, a type name, a slangpy.Device, or None (the default one)."""
    if device is None:
        return default_device()
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        return create_device(device)
    if isinstance(device, spy.Device):
        with _open_lock:
            return _wrap_native(device)
    raise TypeError(f"device={device!r}: expected a pydiff.Device, a type name or None")


def _wrap_native(device: spy.Device) -> Device:
    """The Device of a slangpy.Device pydiff did not open (made once)."""
    for dev in _open_devices.values():
        if dev.native is device:
            return dev
    dev = Device(device, str(device.info.type).split(".")[-1])
    _open_devices[("slangpy", (str(id(device)),))] = dev
    return dev


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pydiff.device``: print the device types that open (exit 1 if none)."""
    found = available_devices()
    for name in found:
        print(f"{name}: {open_device(name).adapter_name}")
    if not found:
        for msg in _failed_types.values():
            print(msg, file=sys.stderr)
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
