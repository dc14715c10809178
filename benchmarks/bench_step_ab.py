"""In-process A/B of the eager MLP step: functions of another checkout (the base) swapped in
for this tree's in alternate rounds, so both sides run on the same device, allocator and
machine load. Calling thread's CPU time per step, and the wall time of a loop of 50 steps
with one device wait, medians of the alternating rounds.

python benchmarks/bench_step_ab.py --base ../wt-base --rounds 20 \\
    pydiff.optim:Adam._dispatch_four pydiff.products:fast_product

Each function is compiled from the base's source of that module in this tree's module (its
globals: the names it calls are this tree's), so a changed function whose helpers changed
too needs those named as well. A measuring tool: it reads modules' source, not an API.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import statistics
import textwrap
import time


import pydiff

from mlp_step import make_batch, make_mlp_step


def base_versions(base: str, targets: list[str]) -> tuple[list, list]:
    """``(owner, name, function)`` of each ``module:Qual.name`` target, from ``base`` and
    from this tree."""
    old, new = [], []
    for target in targets:
        modname, qual = target.split(":")
        mod = importlib.import_module(modname)
        with open(os.path.join(base, *modname.split(".")) + ".py") as f:
            src = f.read()
        node: ast.AST = ast.parse(src)
        parts = qual.split(".")
        for part in parts:
            node = next(n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == part)
        namespace = dict(vars(mod))
        exec(textwrap.dedent(ast.get_source_segment(src, node)), namespace)
        owner = mod if len(parts) == 1 else getattr(mod, parts[0])
        current = vars(owner)[parts[-1]]
        fn = namespace[parts[-1]]
        if isinstance(current, (classmethod, staticmethod)):
            fn = type(current)(fn)
        old.append((owner, parts[-1], fn))
        new.append((owner, parts[-1], current))
    return old, new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout's root")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("targets", nargs="+", help="module:Qualified.name of each function")
    args = ap.parse_args()
    old, new = base_versions(args.base, args.targets)

    def use(which: list) -> None:
        for owner, name, fn in which:
            setattr(owner, name, fn)

    dev = pydiff.default_device()
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    for which in (old, new):
        use(which)
        for _ in range(30):
            step()
    dev.native.wait_for_idle()
    cpu: dict[str, list[float]] = {"base": [], "this tree": []}
    wall: dict[str, list[float]] = {"base": [], "this tree": []}
    for r in range(args.rounds):
        order = [("base", old), ("this tree", new)]
        for name, which in order if r % 2 == 0 else order[::-1]:
            use(which)
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(50):
                step()
            c1 = time.thread_time()
            dev.native.wait_for_idle()
            cpu[name].append((c1 - c0) / 50)
            wall[name].append((time.perf_counter() - w0) / 50)
    use(new)
    b, n = statistics.median(cpu["base"]), statistics.median(cpu["this tree"])
    print(
        f"calling thread's CPU per step: base {b * 1e6:.1f} us, this tree {n * 1e6:.1f} us "
        f"({100 * (n / b - 1):+.1f}%); load {os.getloadavg()[0]:.2f}"
    )
    b, n = statistics.median(wall["base"]), statistics.median(wall["this tree"])
    print(
        f"wall per step (50 steps, one wait): base {b * 1e6:.1f} us, this tree "
        f"{n * 1e6:.1f} us ({100 * (n / b - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
