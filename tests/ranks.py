"""Launching the ranks of a data-parallel test: ``script`` run once per rank with the
environment torchrun would give it (RANK, WORLD_SIZE, MASTER_ADDR/PORT on loopback).

    results = run_ranks(__file__, ["train", str(out)], wait=240)   # [(code or "hung", log)]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: str,
    args: list[str],
    world: int = 2,
    env: dict | None = None,
    wait: float = 30.0,
    wait_for: list[int] | None = None,
) -> list:
    """Run ``script args`` as ``world`` ranks; wait (at most ``wait`` s in all) for the ranks
    in ``wait_for`` (default: all), kill whatever still runs, and return each rank's
    (return code, or "hung" if it was killed, and its output)."""
    base = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, script, *args],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + wait
    try:
        for r in range(world) if wait_for is None else wait_for:
            try:
                procs[r].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        hung = [p.poll() is None for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [("hung" if hung[r] else p.returncode, p.communicate()[0]) for r, p in enumerate(procs)]
