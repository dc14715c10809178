"""In-process A/B of ``BoundObjects.bound`` (and ``new_or_cached``) in the eager
MLP step: the base checkout's versions, compiled from its source into this tree's module, and
this tree's, alternating by round of 50 steps; the time inside the calls (perf_counter around
each of the step's 6), medians of the per-step sums. Resolves a few microseconds where the
whole step's CPU (bench_step_cpu.py) varies by tens between processes on a loaded host.

python benchmarks/bench_bound_object_ab.py --base ../wt-base --rounds 40

A measuring tool: it reads the base's source, not an API; the base's module-level helpers this
tree dropped are supplied (``_same_value``, ``math``: bound43's base). The base must keep them
in ``pydiff/bound_objects.py`` (split51b on); an older one held them as
``KernelCache._bound_object`` and ``_new_or_cached_object`` in ``kernels.py``: this file's own
version of that time measures it.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import statistics
import textwrap
import time


import pydiff
import pydiff.bound_objects as objects_module

from mlp_step import make_batch, make_mlp_step

NAMES = ("bound", "new_or_cached")


def _same_value(a, b) -> bool:  # (the base's helper, for its compiled methods)
    if type(a) is not type(b) or not a == b:
        return False
    return type(a) is not float or math.copysign(1.0, a) == math.copysign(1.0, b)


def base_methods(base: str) -> dict:
    """The base's versions of ``NAMES``, compiled in this tree's bound_objects module's globals."""
    path = os.path.join(base, "pydiff", "bound_objects.py")
    with open(path) as f:
        src = f.read()
    cls = next(
        n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "BoundObjects"
    )
    env = dict(vars(objects_module))
    env.setdefault("_same_value", _same_value)
    env.setdefault("math", math)
    out: dict = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in NAMES:
            code = "from __future__ import annotations\n"
            code += textwrap.dedent(ast.get_source_segment(src, node))
            exec(compile(code, path, "exec"), env, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the other checkout's root")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    cache = objects_module.BoundObjects
    sides = {"base": base_methods(args.base), "this": {n: getattr(cache, n) for n in NAMES}}
    spent = [0.0]
    clock = time.perf_counter

    def use(methods: dict) -> None:
        bound = methods["bound"]

        def timed(self, *a):
            t = clock()
            try:
                return bound(self, *a)
            finally:
                spent[0] += clock() - t

        cache.new_or_cached = methods["new_or_cached"]
        cache.bound = timed

    dev = pydiff.default_device()
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    for _ in range(50):
        step()
    dev.native.wait_for_idle()
    res: dict = {"base": [], "this": []}
    for r in range(args.rounds):
        for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
            use(sides[name])
            spent[0] = 0.0
            for _ in range(50):
                step()
            dev.native.wait_for_idle()
            res[name].append(spent[0] / 50 * 1e6)
    b, t = statistics.median(res["base"]), statistics.median(res["this"])
    print(
        f"BoundObjects.bound per step (wall inside its calls): base {b:.1f} us, "
        f"this tree {t:.1f} us ({t - b:+.1f}); load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
