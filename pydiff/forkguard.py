"""What a forked child does with the devices its parent opened: never a hang.

A forked child has its parent's memory but none of its other threads: lavapipe's queue
thread (and a CUDA context) stay in the parent. So a SlangPy device inherited through
``fork()`` hangs whatever waits for its queue: a kernel or read of an inherited tensor, and
SlangPy's own atexit callback, which closes every device, at the exit of any child leaving
through ``sys.exit`` (a bare ``os.fork()``), even one that never touched pydiff (measured on
lavapipe: the child waits forever in ``rhi::vk::CommandQueueImpl::waitOnHost`` under
``sgl::Device::close_all_devices``; were that callback skipped, the same wait comes from the
extension module's teardown, ``sgl::static_shutdown`` releasing every device).

So, in every forked child (``os.register_at_fork``: ``os.fork``, multiprocessing's ``fork``
workers, PyTorch ``DataLoader`` workers), when the parent had devices open:

- each pydiff ``Device`` of the parent and its ``CommandQueue`` become unusable: their class
  becomes a subclass whose every attribute raises ``DeviceUnavailableError``, saying what to
  do, so an inherited tensor or module fails at once (the normal path checks nothing);
- pydiff forgets them: ``default_device()`` and ``create_device()`` open devices of the
  child, which work (on the parent's compile cache, as any other process);
- the inherited SlangPy devices are never closed nor released in the child: SlangPy's
  atexit callback is replaced there by one closing only the devices the child opened
  (``close_own_devices``), and each inherited device and SlangPy's extension module keep a
  reference that is never dropped (a leak of the child only, gone when it exits);
- the child's ``exit()``, once Python's whole shutdown has run (every atexit callback,
  finalisation, flushes), flushes C's streams and ends with its status, skipping the native
  exit handlers inherited from the parent: Mesa's waits for lavapipe threads that are not
  in the child (``end_without_native_exit_handlers``). multiprocessing's fork workers skip
  even Python's shutdown (``os._exit``).

    pid = os.fork()
    if pid == 0:
        x.numpy()                    # x from the parent: DeviceUnavailableError
        dev = pydiff.default_device()   # a new device, of this process
        sys.exit(0)                  # exits (SlangPy's callback closes only `dev`)
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import warnings
from typing import Any

import slangpy as spy

from . import command_queue, compile_cache
from .command_queue import CommandQueue
from .device import Device, forget_open_devices, refuse_type
from .errors import DeviceUnavailableError
from .slangpy_loader import exit_hook

#: Attributes an inherited device still answers (plain Python values, no native call).
_KEPT = frozenset({"type", "ordinal", "cache_paths", "forked_from", "forked_type"})
# SlangPy devices inherited from the parent (and its own parents): never closed nor released.
_inherited: list = []
# The parent's SlangPy devices, taken under SlangPy's lock just before each fork.
_before_fork: list = []
# Whether this process's exit() already skips the native exit handlers (a child's child).
_ends_early: list = []
_warned: list = []  # (that SlangPy's exit callback is unknown)


#: Why no CUDA device opens in a child forked from a process that had one open.
CUDA_IN_CHILD = (
    "CUDA cannot be used in a process forked from one that used it, so no CUDA device "
    "opens here either: start the workers with multiprocessing's 'spawn' or "
    "'forkserver' start method (multiprocessing.get_context('spawn'), "
    "DataLoader(..., multiprocessing_context='spawn')) and open the device in each."
)


def refusal_message(owner: str, name: str, device_type: str) -> str:
    """What the use of an inherited device (``owner``, e.g. ``<pydiff.Device #1 vulkan>``,
    of type ``device_type``; the attribute ``name`` asked for) says in a forked child. A CUDA
    device cannot be opened in a forked child (CUDA does not survive ``fork()``): only new
    processes ('spawn', 'forkserver') are offered there."""
    head = (
        f"{owner} was opened before this process was forked (os.fork, a multiprocessing "
        "'fork' worker, a DataLoader worker): its tensors, modules and queue cannot be used "
        "here (the device's threads stay in the parent process; a use would hang). "
    )
    if device_type == "cuda":
        what = CUDA_IN_CHILD + " "
    else:
        what = (
            "Open a device in this process (pydiff.create_device(...), or "
            "pydiff.default_device(), which now opens a new one) and create the tensors on it, "
            "or start workers with multiprocessing's 'spawn' or 'forkserver' start method. "
        )
    return f"{head}{what}(Asked for: .{name})"


def _refusal(obj: object, name: str) -> DeviceUnavailableError:
    owner = object.__getattribute__(obj, "forked_from")
    kind = object.__getattribute__(obj, "forked_type")
    return DeviceUnavailableError(refusal_message(owner, name, kind))


class InheritedDevice(Device):
    """A ``Device`` opened before ``fork()``, as the forked child sees it: every use raises
    ``DeviceUnavailableError`` (``type``, ``ordinal`` and ``forked_from`` still answer)."""

    def __getattribute__(self, name: str) -> Any:
        if name in _KEPT or (name.startswith("__") and name.endswith("__")):
            return object.__getattribute__(self, name)
        raise _refusal(self, name)

    def __repr__(self) -> str:
        return f"{self.forked_from[:-1]}, opened before fork(): unusable here>"

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:  # (as before the fork: the id of the SlangPy device)
        return id(object.__getattribute__(self, "_native"))


class InheritedQueue(CommandQueue):
    """The ``CommandQueue`` of an inherited device in a forked child: every use raises."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("forked_from", "forked_type") or (
            name.startswith("__") and name.endswith("__")
        ):
            return object.__getattribute__(self, name)
        raise _refusal(self, f"queue.{name}")


def close_own_devices() -> None:
    """SlangPy's atexit callback in a forked child: close the devices this process opened
    (their shader caches are written then), never the inherited ones."""
    for native in reversed(spy.Device.get_created_devices()):
        if not any(native is old for old in _inherited):
            native.close()


def end_without_native_exit_handlers() -> bool:
    """Make this process's ``exit()`` flush C's streams and end at once with its status
    (glibc's ``on_exit``, run before the exit handlers registered earlier): the native exit
    handlers and destructors inherited from the parent are skipped, Python's whole shutdown
    (atexit callbacks, finalisation, its streams) having already run. False where the C
    library has no ``on_exit`` (not glibc): nothing changes.

    Mesa's exit handler (``util_queue``'s ``atexit``) wakes and joins the threads of every
    queue it knows, the inherited ones too (lavapipe's shader-cache writers, ``disk$0``...),
    whose threads are not in this process: measured, a child of a parent whose cache writers
    had grown to several threads waited forever in ``pthread_cond_broadcast`` there, and one
    that had started threads of its own joined one of them (a new thread reuses the stack, and
    so the handle, of one the parent had) forever.
    """
    libc = ctypes.CDLL(None)
    try:
        on_exit, finish = libc["on_exit"], libc["_exit"]  # (C symbols, by name)
        flush = libc["_IO_flush_all"]  # (int (void): on_exit's arguments are ignored)
    except AttributeError:
        return False
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit.restype = ctypes.c_int
    for func in (finish, flush):  # (last in, first run: flush, then _exit(status))
        on_exit(ctypes.cast(func, ctypes.c_void_p), None)
    return True


def _before() -> None:
    """In the parent, before the fork: its SlangPy devices (under SlangPy's lock, which
    another thread of the parent may hold; the child would wait for it forever)."""
    _before_fork[:] = spy.Device.get_created_devices()
    # (found in the parent, once: a scan when SlangPy was imported before pydiff)
    if _before_fork and exit_hook() is None and not _warned:
        _warned.append(True)
        warnings.warn(
            "pydiff could not find SlangPy's exit callback (several candidates, or none): a "
            "forked child that leaves through sys.exit may hang closing the devices it "
            "inherited. End forked children with os._exit, or import pydiff before slangpy, "
            "or use multiprocessing's 'spawn' start method",
            RuntimeWarning,
            stacklevel=2,
        )


def _after_in_parent() -> None:
    _before_fork.clear()


def _after_in_child() -> None:
    natives = list(_before_fork)
    _before_fork.clear()
    for dev in forget_open_devices():
        text = f"<pydiff.Device #{dev.ordinal} {dev.type}>"  # (no native call)
        if dev.type == "cuda":  # (CUDA's context does not survive fork: no new one either)
            refuse_type("cuda", "could not open a 'cuda' device: " + CUDA_IN_CHILD)
        for obj, kind in ((dev.queue, InheritedQueue), (dev, InheritedDevice)):
            object.__setattr__(obj, "forked_from", text)
            object.__setattr__(obj, "forked_type", dev.type)
            obj.__class__ = kind
    command_queue.forget_queues()
    compile_cache.forget_held()
    if not natives:
        return
    if not _ends_early:
        _ends_early.append(end_without_native_exit_handlers())
    keep = ctypes.pythonapi.Py_IncRef
    for obj in (*natives, sys.modules.get("slangpy.slangpy_ext")):
        if obj is not None:  # never released: no destructor, no static shutdown here
            keep(ctypes.py_object(obj))
    _inherited.extend(natives)
    hook = exit_hook()
    if hook is not None:
        atexit.unregister(hook)
    atexit.unregister(close_own_devices)  # (a child of a child: once)
    atexit.register(close_own_devices)


os.register_at_fork(
    before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child
)
