"""The eager MLP step waited on after each step (``step(); wait``), against PyTorch-CPU eager
(one thread) and the captured step, timed two ways in alternating rounds of 20 steps: back
to back (a phase of its own), and each round after an idle pause (as ``timing.interleaved`` and
``bench_train.py``'s "each step waited on" lines do), to tell whether the pause decides
the ratio (docs/benchmarks-history.md, twenty-fifth session: on the 2-vCPU VM it moved every
contender, and the ratio stayed 1.5-1.75x either way).

The contenders' order rotates from round to round (``--rounds``: a multiple of their count
gives each position equally). ``dev.wait()`` and ``loss.item()`` poll the device's last
submission on Vulkan (pydiff.command_queue, 2026-11-29).

python benchmarks/bench_step_pause.py [--rounds 10] [--pause 0.25]
"""

from __future__ import annotations

import argparse
import statistics
import time

import pydiff

from mlp_step import make_batch, make_mlp_step
from timing import describe


def torch_step_fn():
    """PyTorch's eager step of the same shapes (one thread), or None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    layers = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)]
    opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-3)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(layers[1](torch.relu(layers[0](x))), y).backward()
        opt.step()

    return step


def per_step_ms(fn, steps: int = 20, pause: float = 0.0) -> float:
    if pause:
        time.sleep(pause)
        fn()  # (one untimed call after the pause, as timing.interleaved)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--pause", type=float, default=0.25)
    args = ap.parse_args()
    dev = pydiff.default_device()
    xb, yb = make_batch()
    _, eager = make_mlp_step(xb, yb)
    _, to_capture = make_mlp_step(xb, yb)
    to_capture()  # (the optimizer's state made before the capture)
    captured = pydiff.capture(to_capture)
    wait_for_idle = dev.native.wait_for_idle
    contenders = {
        "pydiff eager, dev.wait()": lambda: (eager(), dev.wait()),
        "pydiff eager, loss.item()": lambda: eager().item(),
        # (the blocking wait of pydiff before 2026-11-29, for an A/B in one process)
        "pydiff eager, flush + wait_for_idle": lambda: (eager(), dev.flush(), wait_for_idle()),
        "pydiff captured": lambda: (captured.replay(), dev.wait()),
    }
    torch_step = torch_step_fn()
    if torch_step is not None:
        contenders["PyTorch-CPU (1 thread)"] = torch_step
    for fn in contenders.values():
        for _ in range(50):
            fn()
    times = {(name, p): [] for name in contenders for p in (0.0, args.pause)}
    names = list(contenders)
    # The back-to-back rounds run as a phase of their own, before any pause: interleaved with
    # the paused rounds (as before 2026-11-29) they measured the pause's after-effect too
    # (0.97-1.0 ms against 0.64 ms for the same eager step, PyTorch 0.5-0.6 ms either way).
    for pause in (0.0, args.pause):
        for r in range(args.rounds):
            # The order rotates each round: the first pydiff contender after PyTorch's rounds
            # ran ~12% slower than an identical one after it (2026-11-28), so each contender
            # follows each other equally often.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name, pause].append(per_step_ms(contenders[name], pause=pause))
    print(f"device: {describe(dev)}")
    print(f"MLP step waited on each time, ms (median of {args.rounds} rounds of 20 steps):")
    torch_name = "PyTorch-CPU (1 thread)"
    base = (
        {p: statistics.median(times[torch_name, p]) for p in (0.0, args.pause)}
        if torch_step
        else {}
    )
    for name in contenders:
        cells = []
        for pause, label in ((0.0, "back to back"), (args.pause, f"after {args.pause} s idle")):
            ms = statistics.median(times[name, pause])
            ratio = f" = {ms / base[pause]:.2f}x PyTorch" if torch_step is not None else ""
            cells.append(f"{label} {ms:.3f}{ratio}")
        print(f"  {name}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
