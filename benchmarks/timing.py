"""Shared timing for the benchmarks: best of several runs after a warm-up run, and
interleaved rounds for comparisons on a machine whose speed drifts (a shared VM).

    from timing import best_of, interleaved
    seconds = best_of(lambda: (step(), device.native.wait_for_idle()), repeats=5)
    medians = interleaved({"pydiff": step, "torch": torch_step}, rounds=15, inner=20)
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from pydiff.device import lavapipe_threads_text


def describe(dev) -> str:
    """The device as the benchmarks print it, with lavapipe's compute threading (pydiff runs
    it inline on machines of two CPUs or fewer: see docs/devices.md)."""
    text = f"{dev.type} ({dev.adapter_name})"
    if "llvmpipe" in dev.adapter_name:
        text += "; lavapipe compute " + lavapipe_threads_text()
    kernels = getattr(dev, "kernels", None)
    if kernels is not None:  # the fast kernels' forms (pydiff info prints them too)
        text += "; float4 stores " + ("paired 64-bit" if kernels.paired_stores else "float4")
    return text


def best_of(fn: Callable[[], object], repeats: int = 5, inner: int = 1) -> float:
    """Seconds per call of ``fn``: the best of ``repeats`` timings of ``inner`` calls each,
    after one untimed call (kernel compilation, caches)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int = 15,
    inner: int = 20,
    warmup: int = 20,
    pause: float = 0.25,
) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per call of each function, timed in alternating rounds of
    ``inner`` calls so that a slow spell of the machine hits every contender alike. Each
    round starts after ``pause`` seconds idle: worker threads that spin for a while after
    their work (OpenMP's, lavapipe's) would otherwise slow the next contender down."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(pause)
            fn()  # one untimed call: caches and threads back in shape after the pause
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}
