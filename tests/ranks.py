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

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _vulkan_opens() -> bool:
    import pydiff

    return "vulkan" in pydiff.available_devices()


#: The rank scenarios run on Vulkan (lavapipe here); a machine where Vulkan does not open (a
#: GPU machine without an NVIDIA Vulkan driver) skips them rather than failing.
needs_vulkan = pytest.mark.skipif(not _vulkan_opens(), reason="the rank scenarios run on Vulkan")


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


def scenario_worker(scenarios: dict, scenario: str, out: Path) -> None:
    """A rank's whole run (the script's ``__main__``): a lavapipe device, a gloo group with
    the timeout $B19_TIMEOUT, ``scenarios[f"_scenario_{scenario}"](rank, world_size)``, its
    result written to OUT/rank{rank}.json; then the process ends without teardown."""
    import json

    import pydiff
    from pydiff import distributed as dist

    pydiff.set_default_device(pydiff.create_device("vulkan"))
    me = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=float(os.environ["B19_TIMEOUT"]))
    res = scenarios[f"_scenario_{scenario}"](me, dist.world_size())
    (out / f"rank{me}.json").write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)  # a broken group's teardown could block


def launch_scenario(
    script: str, scenario: str, out: Path, env: dict, wait: float = 30.0, world: int = 2
) -> list:
    """Run ``scenario`` of ``script`` in ``world`` ranks; [(code or "hung", log tail, the
    rank's JSON result or None)]."""
    import json

    ran = run_ranks(script, [scenario, str(out)], world=world, env=env, wait=wait)
    results = []
    for r, (code, log) in enumerate(ran):
        f = out / f"rank{r}.json"
        results.append((code, log[-3000:], json.loads(f.read_text()) if f.exists() else None))
    return results
