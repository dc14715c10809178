"""Run a child process and call it a hang by the CPU time it has used, not the wall time.

A compile that has not finished after ``cpu_budget`` seconds of its OWN CPU time (utime +
stime of the process, all its threads, read from /proc/<pid>/stat) is a hang; under load a
healthy compile may take minutes of wall time while using its usual few CPU seconds, so a
wall-clock timeout misclassified it. ``wall_cap`` (default 6 x the budget) still bounds a
child that sleeps or is starved forever, and ``max_rss`` kills a runaway compile by memory.

``run_remembered`` keeps the outcome of such a run on disk: raw SlangPy's verdict on a
variant is a fact of the SlangPy version, the Vulkan driver, the script and its arguments,
so a rerun on the same machine reads it back instead of compiling again (docs/testing.md).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


FRESH = "PYDIFF_ORACLE_FRESH"  # =1: every oracle run anew (and its outcome stored again)
_ENV_PREFIXES = ("LP_", "VK_", "MESA_", "GALLIVM_", "SLANG")  # what can change a driver's verdict


def _driver_identity() -> list:
    """The Vulkan drivers this process would load: each ICD manifest's text and its library's
    size and modification time (a Mesa upgrade changes them), and the environment switches
    a driver reads."""
    found = []
    listed = os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
    manifests = listed.split(os.pathsep) if listed else []
    for folder in ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d"):
        manifests += sorted(glob.glob(os.path.join(folder, "*.json")))
    for manifest in manifests:
        try:
            text = Path(manifest).read_text()
            library = json.loads(text).get("ICD", {}).get("library_path", "")
            st = os.stat(library) if os.path.isabs(library) else None
        except (OSError, ValueError):
            continue
        found.append([manifest, text, library, st and [st.st_size, st.st_mtime_ns]])
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
    return [found, env]


def _key(args: list[str], cpu_budget: float, include: str, max_rss: int | None) -> str:
    import slangpy

    files = [Path(a).read_text() for a in args if a.endswith(".py") and os.path.isfile(a)]
    included = (
        sorted((p.name, p.read_bytes().hex()) for p in Path(include).glob("*") if p.is_file())
        if include
        else []
    )
    parts = [slangpy.__version__, sys.version, args, files, included, cpu_budget, max_rss]
    parts.append(_driver_identity())
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _memo_dir() -> Path | None:
    from pydiff import compile_cache

    base = compile_cache.root()
    return None if base is None else base / "trap-oracle"


def run_remembered(
    args: list[str], cpu_budget: float, *, include: str = "", max_rss: int | None = None, **kw
):
    """``run_watched(args, cpu_budget, ...)`` (``include``: the oracle's TRAP_ORACLE_INCLUDE
    folder, its files part of the key), its outcome read back from pydiff's cache folder when
    this very run was made before here: only outcomes that are verdicts are kept (a clean
    exit, a crash by signal, a hang), never another error. ``PYDIFF_ORACLE_FRESH=1`` runs it
    anew."""
    env = dict(os.environ, TRAP_ORACLE_INCLUDE=include)
    folder = _memo_dir()
    path = None if folder is None else folder / f"{_key(args, cpu_budget, include, max_rss)}.json"
    if path is not None and os.environ.get(FRESH) != "1" and path.is_file():
        try:
            kept = json.loads(path.read_text())
            return None if kept["hang"] else (kept["rc"], kept["out"], kept["err"])
        except (OSError, ValueError, KeyError):
            pass  # (a damaged entry: run it again)
    done = run_watched(args, cpu_budget, env=env, max_rss=max_rss, **kw)
    verdict = done is None or done[0] == 0 or done[0] < 0 or done[0] in (134, 139)
    if path is not None and verdict:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            entry = {"hang": True} if done is None else {"hang": False}
            if done is not None:
                entry.update(rc=done[0], out=done[1], err=done[2])
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entry))
            os.replace(tmp, path)  # (whole or not at all, with other workers writing)
        except OSError:
            pass
    return done
