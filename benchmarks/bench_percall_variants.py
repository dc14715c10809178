"""Per-call cost of a 16-element call under pydiff's path switches, each in a fresh process.

    python benchmarks/bench_percall_variants.py cuda            # or vulkan
    python benchmarks/bench_percall_variants.py cuda profile    # cProfile of the default

Runs bench_core's per-call case (pydiff against raw SlangPy, alternating rounds) with the
generated kernels as they are, with small call plans kept on SlangPy's call
(PYDIFF_GENERATED_PLANNED_AFTER huge), with the generated kernels off, and with every
command submitted at once (PYDIFF_DEFER=0). Timings only; the tests never assert on speed.
"""

import cProfile
import io
import os
import pstats
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "default": {},
    "planned off": {"PYDIFF_GENERATED_PLANNED_AFTER": "1000000000"},
    # on a GPU small calls keep SlangPy's call unless the variable is set (generated_switch)
    "planned after 1000": {"PYDIFF_GENERATED_PLANNED_AFTER": "1000"},
    "generated off": {"PYDIFF_GENERATED": "0"},
    "defer off": {"PYDIFF_DEFER": "0"},
}
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
if len(sys.argv) > 2 and sys.argv[2] == "profile":
    import numpy as np
    import pydiff

    d = pydiff.create_device(dev)
    m = pydiff.load_module(
        Path(__file__).resolve().parent.parent / "samples" / "polynomial.slang", device=d
    )
    xs = np.linspace(-1, 1, 16).astype(np.float32)
    px = pydiff.tensor(xs, device=d, requires_grad=True)
    py = pydiff.zeros((16,), device=d).with_grads(ones=True)

    def call():
        m.polynomial(2.0, 8.0, -1.0, px, _result=py)

    def bwds():
        m.polynomial.bwds(2.0, 8.0, -1.0, px, _result=py)

    for f in (call, bwds):
        for _ in range(1500):
            f()
    d.native.wait_for_idle()
    print(pydiff.generated.stats())
    for name, f in (("call", call), ("bwds", bwds)):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            f()
        d.native.wait_for_idle()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print(f"== profile {name}, 2000 calls")
        print(s.getvalue()[-4500:])
    sys.exit()
for name, env in VARIANTS.items():
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parent / "bench_core.py"),
            "--device",
            dev,
            "--large",
            "16",
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = [r for r in out.stdout.splitlines() if "16" in r and ("call" in r or "bwds" in r)]
    print(
        f"-- {name}: "
        + " | ".join(" ".join(r.split()) for r in rows)
        + (out.stderr[-500:] if out.returncode else "")
    )
