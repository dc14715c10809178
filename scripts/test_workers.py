"""How many pytest-xdist workers `make test` starts: one per CPU, as far as memory allows.

A worker of the suite peaked at 4.7-5.8 GB (maximum resident set, two workers on lavapipe), so
each one gets 8 GiB of the memory available now; none (``0``: pytest's own process runs the
tests) where fewer than two fit. Measured on the
development machine (2 CPUs, 24 GiB): 2 workers, the suite in 502 s instead of 887 s.

    python3 scripts/test_workers.py        # prints 2 on a 2-CPU, 24 GiB machine
"""

import os

GIB_PER_WORKER = 8


def available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float(GIB_PER_WORKER)  # unknown: one worker's worth


def workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    count = min(cpus or 1, int(available_gib() // GIB_PER_WORKER))
    return count if count > 1 else 0


if __name__ == "__main__":
    print(workers())
