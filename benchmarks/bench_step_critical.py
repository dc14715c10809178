"""The eager MLP step waited on each time (``step(); wait``), split along its critical path:
the calling thread's CPU, the CPU of the process's other threads (lavapipe's queue thread runs
the kernels there: ``/proc/self/task/*/schedstat``, nanoseconds), the wall time, and their
overlap (calling + others - wall: what the second core took off the step); the wall and the
calling thread's CPU inside each submission; then the same step under six device waits in
alternating rounds: ``wait_for_idle`` (the benchmarks' wait), ``wait_for_submit`` of the
step's last submission, a spin on ``is_submit_finished`` (plain, and with ``sched_yield``), a 300 us
spin then ``wait_for_idle``, and ``dev.wait()`` (pydiff's own poll on Vulkan: command_queue).
Linux only (schedstat). Run it for two checkouts alternating (``PYTHONPATH=<tree>``, from
``benchmarks/``). ``--per-submission``: instead, each submission waited on at once, and the
device threads' CPU it took (what each of the step's submissions puts on the device).

python benchmarks/bench_step_critical.py [--rounds 6] [--steps 50] [--per-submission] [--reverse]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import pydiff

from mlp_step import make_batch, make_mlp_step
from timing import describe


class _Submissions:
    """Stands for the queue's SlangPy device: counts each submission's wall and calling-thread
    CPU and keeps the last submission's id (for ``wait_for_submit``)."""

    def __init__(self, native, me: int, each: bool = False) -> None:
        self._native = native
        self._me = me
        self.each: list | None = [] if each else None  # (device CPU, wall) of each, waited on
        self.last = 0
        self.wall_ns = 0
        self.cpu_ns = 0
        self.count = 0

    def __getattr__(self, name):
        return getattr(self._native, name)

    def _timed(self, submit, buffers):
        if self.each is not None:
            o0, w0 = others_cpu_ns(self._me), time.perf_counter_ns()
            self.last = submit(buffers)
            self._native.wait_for_submit(self.last)
            w1 = time.perf_counter_ns()
            self.each.append(((others_cpu_ns(self._me) - o0) / 1e3, (w1 - w0) / 1e3))
            return self.last
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        self.last = submit(buffers)
        self.cpu_ns += time.thread_time_ns() - c0
        self.wall_ns += time.perf_counter_ns() - w0
        self.count += 1
        return self.last

    def submit_command_buffer(self, buffer):
        return self._timed(self._native.submit_command_buffer, buffer)

    def submit_command_buffers(self, buffers):
        return self._timed(self._native.submit_command_buffers, buffers)


def others_cpu_ns(me: int) -> int:
    """CPU time (ns) of the process's threads other than ``me`` (schedstat's first field)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:  # (a thread that ended meanwhile)
                pass
    return total


def per_submission(step, native, subs: _Submissions, steps: int) -> None:
    """Each submission of ``steps`` steps waited on at once: its device threads' CPU, wall."""
    rows = []
    for _ in range(steps):
        subs.each.clear()
        step()
        native.wait_for_idle()
        rows.append(list(subs.each))
    count = statistics.mode(len(r) for r in rows)
    print(f"each submission waited on at once, median of {steps} steps ({count} a step):")
    for j in range(count):
        cpu = statistics.median(r[j][0] for r in rows if len(r) > j)
        wall = statistics.median(r[j][1] for r in rows if len(r) > j)
        print(f"  submission {j}: device threads' CPU {cpu:.0f} us, submit + wait {wall:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--per-submission", action="store_true")
    ap.add_argument("--reverse", action="store_true", help="the waits' rounds in reverse order")
    args = ap.parse_args()
    dev = pydiff.default_device()
    native = dev.native
    me = threading.get_native_id()
    subs = _Submissions(native, me, each=args.per_submission)
    dev.queue.native = subs  # (the queue's submissions only; everything else is SlangPy's)
    xb, yb = make_batch()
    _, step = make_mlp_step(xb, yb)
    for _ in range(100):
        step()
        native.wait_for_idle()
    if args.per_submission:
        per_submission(step, native, subs, args.rounds * args.steps)
        return

    def spin():
        last = subs.last
        while not native.is_submit_finished(last):
            pass

    def spin_yield():
        last = subs.last
        while not native.is_submit_finished(last):
            os.sched_yield()

    def spin_then_block():
        last, until = subs.last, time.perf_counter() + 300e-6
        while time.perf_counter() < until:
            if native.is_submit_finished(last):
                return
        native.wait_for_idle()

    waits = {
        "wait_for_idle": native.wait_for_idle,
        "wait_for_submit(last)": lambda: native.wait_for_submit(subs.last),
        "spin": spin,
        "spin, sched_yield each poll": spin_yield,
        "spin 300 us, then wait_for_idle": spin_then_block,
        "dev.wait() (pydiff: poll, sched_yield, up to POLL_MAX_S)": dev.wait,
    }
    if args.reverse:
        waits = dict(reversed(waits.items()))
    split = {k: [] for k in ("wall", "calling", "others", "overlap", "sub_wall", "sub_cpu")}
    walls: dict[str, list] = {k: [] for k in waits}
    cpus: dict[str, list] = {k: [] for k in waits}  # process CPU per step
    n = args.steps
    for _ in range(args.rounds):
        for name, wait in waits.items():
            time.sleep(0.05)
            step()
            wait()
            s0, sw0, sc0 = subs.count, subs.wall_ns, subs.cpu_ns
            p0 = time.process_time_ns()
            o0, c0, w0 = others_cpu_ns(me), time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(n):
                step()
                wait()
            w1, c1, o1 = time.perf_counter_ns(), time.thread_time_ns(), others_cpu_ns(me)
            cpus[name].append((time.process_time_ns() - p0) / n / 1e3)
            wall = (w1 - w0) / n / 1e3
            walls[name].append(wall)
            if name == "wait_for_idle":
                calling, others = (c1 - c0) / n / 1e3, (o1 - o0) / n / 1e3
                per = max(subs.count - s0, 1)
                for key, value in (
                    ("wall", wall),
                    ("calling", calling),
                    ("others", others),
                    ("overlap", calling + others - wall),
                    ("sub_wall", (subs.wall_ns - sw0) / per / 1e3),
                    ("sub_cpu", (subs.cpu_ns - sc0) / per / 1e3),
                ):
                    split[key].append(value)
                submissions = (subs.count - s0) / n
    med = statistics.median
    print(f"device: {describe(dev)}; load average {os.getloadavg()[0]:.2f}")
    print(
        f"waited step (wait_for_idle), us, median of {args.rounds} rounds of {n} steps: "
        f"wall {med(split['wall']):.0f} = calling thread CPU {med(split['calling']):.0f} "
        f"+ other threads' CPU {med(split['others']):.0f} - overlap {med(split['overlap']):.0f}; "
        f"{submissions:.2f} submissions a step, each {med(split['sub_wall']):.0f} us wall "
        f"({med(split['sub_cpu']):.0f} us calling-thread CPU)"
    )
    for name, values in walls.items():
        values = sorted(values)
        print(
            f"  {name}: {med(values):.0f} us a step [{values[0]:.0f}..{values[-1]:.0f}], "
            f"process CPU {med(cpus[name]):.0f} us"
        )


if __name__ == "__main__":
    main()
