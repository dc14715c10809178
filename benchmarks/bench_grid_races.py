"""Per-call CPU of the grid-race check (``grid_races.refuse_grid_races``, its verdict cached)
on an in-place grid call, and of the whole call with the check on and off, alternating.

python benchmarks/bench_grid_races.py
"""

import statistics
import time

import numpy as np
import slangpy as spy

import pydiff
from pydiff import arguments, bwds_checks, grid_races

SRC = """
import slangpy;
[Differentiable]
void sq_own(int2 px, IRWDiffTensor<float, 2> x)
{
    float v = x[px.y, px.x];
    x[px.y, px.x] = v * v;
}
"""
m = pydiff.load_module_from_source("bench_grid", SRC)
fn = m.sq_own
x = pydiff.tensor(np.ones((4, 8), np.float32))
g = spy.grid((4, 8))
m.sq_own(g, x)
bound, _ = arguments.bind_arguments(fn, (g, x), {})
N = 20000


def per_call(f):
    t = time.process_time()
    for _ in range(N):
        f()
    return (time.process_time() - t) / N * 1e6


def check():
    grid_races.refuse_grid_races(fn, bound, "bench")


rounds = []
for r in range(7):
    rounds.append(per_call(check))
print(
    f"refuse_grid_races cached, per call: median {statistics.median(rounds):.2f} us "
    f"(min {min(rounds):.2f}, max {max(rounds):.2f}) over 7 rounds of {N}"
)
# whole call with and without the check, alternating
real = bwds_checks.refuse_grid_races
M = 300
on, off = [], []
for r in range(7):
    for lst, f in ((on, real), (off, lambda *a, **k: None)):
        bwds_checks.refuse_grid_races = f
        t = time.process_time()
        for _ in range(M):
            m.sq_own(g, x)
        lst.append((time.process_time() - t) / M * 1e6)
bwds_checks.refuse_grid_races = real
on_us, off_us = statistics.median(on), statistics.median(off)
print(
    f"m.sq_own(grid, x) per call: check on {on_us:.1f} us, off {off_us:.1f} us "
    f"(diff {on_us - off_us:.1f} us; spread on {min(on):.0f}-{max(on):.0f}, "
    f"off {min(off):.0f}-{max(off):.0f})"
)
