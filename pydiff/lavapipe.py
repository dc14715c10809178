"""Lavapipe (Mesa's Vulkan on the CPU): how many threads it runs compute on, and the
open-file limit each of its buffers counts against.

pydiff.device.choose_lavapipe_threads()      # before the first device opens
pydiff.device.lavapipe_threads_text()        # 'inline (LP_NUM_THREADS=0)'
"""

from __future__ import annotations

import errno
import os

from .errors import env_flag

try:
    import resource
except ImportError:  # not on Windows: no limit to read or raise
    resource = None  # type: ignore[assignment]

# Mesa's lavapipe (Vulkan on the CPU) hands each dispatch to a pool of one worker thread per
# core. On two cores that hand-off costs more than the second core gives back for the small
# kernels of a training step (measured: an empty dispatch 22 us pooled, 4 us inline; an eager
# 256x64x64x10 MLP step 3.7x PyTorch-CPU pooled, 2.3x inline), so pydiff asks lavapipe to run
# compute inline on machines this small, unless LP_NUM_THREADS is already set. Kernels over
# millions of elements give up the second core (about 2x slower). Re-measured for issue 16:
# a captured step's kernels cost 1.7x the CPU time pooled, large kernels the same CPU time
# but 1.7-1.9x less wall time; the variable is read per device (a second device may take the
# pool) but a tensor cannot move between devices without a copy, so there is no per-workload
# choice inside one process: docs/devices.md#lavapipes-threads.
LAVAPIPE_INLINE_MAX_CPUS = 2


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_lavapipe_threads(environ: dict | None = None, cpus: int | None = None) -> str | None:
    """Set ``LP_NUM_THREADS=0`` (lavapipe runs compute inline) on machines with at most
    ``LAVAPIPE_INLINE_MAX_CPUS`` usable CPUs unless the variable is already set; returns the
    value in effect (None: lavapipe's own default, a thread per core). Lavapipe reads it when
    a Vulkan device is created, so pydiff calls this before opening its first device.

    >>> os.environ["LP_NUM_THREADS"] = "2"      # before pydiff opens a device: keep the pool
    >>> pydiff.device.choose_lavapipe_threads()
    '2'
    """
    env = os.environ if environ is None else environ
    if "LP_NUM_THREADS" not in env:
        if (_usable_cpus() if cpus is None else cpus) > LAVAPIPE_INLINE_MAX_CPUS:
            return None
        env["LP_NUM_THREADS"] = "0"
    return env["LP_NUM_THREADS"]


def lavapipe_threads_text(value: str | None = None) -> str:
    """How lavapipe runs compute for ``LP_NUM_THREADS=value`` (default: the environment's).

    >>> pydiff.device.lavapipe_threads_text("0")
    'inline (LP_NUM_THREADS=0)'
    """
    value = os.environ.get("LP_NUM_THREADS") if value is None else value
    if value is None or not value.strip():
        return "on a worker per CPU (lavapipe's default)"
    return (
        "inline (LP_NUM_THREADS=0)"
        if value.strip() == "0"
        else f"on LP_NUM_THREADS={value} workers"
    )


# Lavapipe backs every device buffer with a file descriptor (and a memory mapping), so a
# process with many live tensors (a long recorded chain: its results and their gradient
# buffers) reaches RLIMIT_NOFILE, whose soft value is often 1024 although the hard one is far
# higher. Past the mappings' own limit (vm.max_map_count, 65530 by default) lavapipe crashes
# the process instead of failing an allocation, so the soft limit is raised no further than
# half of it: the open-file limit, which fails cleanly, stays the one reached first.
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def open_files() -> tuple[int, int] | None:
    """(file descriptors open now, the soft RLIMIT_NOFILE) on Linux; None where it cannot be
    read (another system) or the limit is infinite. A descriptor table so full that listing
    it fails (the listing needs a descriptor of its own) counts as full."""
    if resource is None or not os.path.isdir("/proc/self/fd"):
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        count = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own descriptor
    except OSError as exc:
        return (soft, soft) if exc.errno == errno.EMFILE else None
    return count, soft


def near_open_file_limit() -> tuple[int, int] | None:
    """``open_files()`` when the process is within a few descriptors of its limit (an
    allocation that failed for want of one), else None."""
    found = open_files()
    if found is None:
        return None
    count, limit = found
    return found if count + max(16, limit // 100) >= limit else None


def raise_open_file_limit() -> int | None:
    """Raise the soft RLIMIT_NOFILE to the hard one, but to no more than half of
    vm.max_map_count (see above), and never lower it; returns the new soft limit, or None
    where nothing changed (``PYDIFF_RAISE_NOFILE=off``, not Linux, already high enough, or
    refused). pydiff calls it before it opens a Vulkan device."""
    if resource is None or not env_flag("PYDIFF_RAISE_NOFILE", True):
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open(_MAX_MAP_COUNT) as f:
            cap = int(f.read()) // 2
    except (OSError, ValueError):
        cap = 65530 // 2  # Linux's default
    target = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return None
    return target


def before_device_opens(type_name: str) -> None:
    """What lavapipe needs settled before a device of ``type_name`` opens: its threads
    (``choose_lavapipe_threads``) and, for Vulkan, the open-file limit its buffers count
    against (``raise_open_file_limit``)."""
    choose_lavapipe_threads()
    if type_name == "vulkan":
        raise_open_file_limit()
