"""Lavapipe (Mesa's Vulkan on the CPU): how many threads it runs compute on.

pydiff.device.choose_lavapipe_threads()      # before the first device opens
pydiff.device.lavapipe_threads_text()        # 'inline (LP_NUM_THREADS=0)'
"""

from __future__ import annotations

import os

# Mesa's lavapipe (Vulkan on the CPU) hands each dispatch to a pool of one worker thread per
# core. On two cores that hand-off costs more than the second core gives back for the small
# kernels of a training step (measured: an empty dispatch 22 us pooled, 4 us inline; an eager
# 256x64x64x10 MLP step 3.7x PyTorch-CPU pooled, 2.3x inline), so pydiff asks lavapipe to run
# compute inline on machines this small, unless LP_NUM_THREADS is already set. Kernels over
# millions of elements give up the second core (about 2x slower). Re-measured for issue 16:
# a captured step's kernels cost 1.7x the CPU time pooled, large kernels the same CPU time
# but 1.7-1.9x less wall time; the variable is read per device, so there is no per-workload
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
