"""Time to first gradient: the polynomial sample in fresh processes, compile cache off, cold
(empty) and warm, side by side; and the time of ``import pydiff``.

    python benchmarks/bench_startup.py            # or: make bench
    python benchmarks/bench_startup.py --runs 5

Each run is a new ``python samples/polynomial.py`` (load the module, forward, ``.bwds``),
timed from process start to exit. Timings only; the tests never assert on speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "polynomial.py"


def _timed(args: list[str], env: dict) -> float:
    start = time.perf_counter()
    out = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    took = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return took


def _torch_installed() -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each case (median reported)")
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYDIFF_CACHE")}
    rows: dict[str, list[float]] = {"cache off": [], "cold cache": [], "warm cache": []}
    imports: list[float] = []
    bridge_on: list[float] = []  # import pydiff with SlangPy's torch bridge forced on
    torch = _torch_installed()
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):  # interleaved: the machine's speed drifts
            cold = Path(tmp) / f"cold{run}"
            warm_env = {**base, "PYDIFF_CACHE_DIR": str(Path(tmp) / "warm")}
            if run == 0:
                _timed([sys.executable, str(SAMPLE)], warm_env)  # fill the warm cache
            rows["cache off"].append(
                _timed([sys.executable, str(SAMPLE)], {**base, "PYDIFF_CACHE": "0"})
            )
            rows["cold cache"].append(
                _timed([sys.executable, str(SAMPLE)], {**base, "PYDIFF_CACHE_DIR": str(cold)})
            )
            rows["warm cache"].append(_timed([sys.executable, str(SAMPLE)], warm_env))
            imports.append(_timed([sys.executable, "-c", "import pydiff"], base))
            if torch:
                on = {**base, "PYDIFF_SLANGPY_TORCH": "on"}
                bridge_on.append(_timed([sys.executable, "-c", "import pydiff"], on))
    off = statistics.median(rows["cache off"])
    said = "installed" if torch else "not installed"
    print(f"time to first gradient, samples/polynomial.py (median of {args.runs}; torch {said}):")
    for name, times in rows.items():
        med = statistics.median(times)
        spread = f"{min(times):.2f}-{max(times):.2f}"
        print(f"  {name:11s} {med:5.2f} s  ({spread} s)   vs cache off: {med / off:.2f}x")
    print(f"import pydiff: {statistics.median(imports):.2f} s (median)")
    if bridge_on:
        print(
            f"import pydiff with SlangPy's torch bridge loaded (PYDIFF_SLANGPY_TORCH=on): "
            f"{statistics.median(bridge_on):.2f} s"
        )


if __name__ == "__main__":
    main()
