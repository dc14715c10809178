"""Run a child process and call it a hang by the CPU time it has used, not the wall time.

A compile that has not finished after ``cpu_budget`` seconds of its OWN CPU time (utime +
stime of the process, all its threads, read from /proc/<pid>/stat) is a hang; under load a
healthy compile may take minutes of wall time while using its usual few CPU seconds, so a
wall-clock timeout misclassified it. ``wall_cap`` (default 6 x the budget) still bounds a
child that sleeps or is starved forever, and ``max_rss`` kills a runaway compile by memory.
"""

from __future__ import annotations

import os
import subprocess
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14, 15 of stat(5)


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next((x for x in f if x.startswith("VmRSS:")), "VmRSS: 0 kB")
    except OSError:
        return 0
    return int(line.split()[1]) * 1024


def run_watched(
    args: list[str],
    cpu_budget: float,
    *,
    wall_cap: float | None = None,
    max_rss: int | None = None,
    env: dict | None = None,
    preexec_fn=None,
):
    """(returncode, stdout, stderr), or None when the child used ``cpu_budget`` CPU seconds,
    ran ``wall_cap`` wall seconds, or passed ``max_rss`` bytes resident without finishing
    (then it is killed)."""
    wall_cap = 6 * cpu_budget if wall_cap is None else wall_cap
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=preexec_fn,
    )
    start = time.monotonic()
    while True:
        try:
            out, err = proc.communicate(timeout=0.25)  # drains the pipes while it waits
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            pass
        if (
            cpu_seconds(proc.pid) > cpu_budget
            or time.monotonic() - start > wall_cap
            or (max_rss is not None and rss_bytes(proc.pid) > max_rss)
        ):
            proc.kill()
            proc.communicate()
            return None
