"""Shared timing for the benchmarks: best of several runs after a warm-up run.

    from timing import best_of
    seconds = best_of(lambda: (step(), device.native.wait_for_idle()), repeats=5)
"""

from __future__ import annotations

import time
from typing import Callable


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
