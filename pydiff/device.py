"""Opening devices: a SlangPy device with pydiff's shader library on its include path and
the persistent compile caches, one per type, include paths and cache folder in a process
(the default one too); a type that failed to open fails fast after. What pydiff keeps per
device, ``Device``, is ``device_state``'s.

    dev = pydiff.create_device()            # CUDA, then D3D12, then Vulkan
    print(dev.type, dev.adapter_name)
    pydiff.available_devices()              # e.g. ['vulkan']
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import slangpy as spy

from . import call_data_loads, call_uniforms, compile_cache, cuda_context
from .device_names import AUTO_ORDER, auto_override, normalise_type
from .errors import DeviceUnavailableError, env_flag
from .device_state import Device, shader_dir
from .slangpy_loader import missing_driver, quiet_native_output
from .lavapipe import LAVAPIPE_INLINE_MAX_CPUS, choose_lavapipe_threads  # noqa: F401 (public)
from .lavapipe import before_device_opens, lavapipe_threads_text  # noqa: F401 (public here)

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
