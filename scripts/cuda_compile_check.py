"""Compile every kernel pydiff builds for CUDA (to PTX for sm_90) on a machine without a GPU.

    python scripts/cuda_compile_check.py            # collect on Vulkan (lavapipe), compile
    python scripts/cuda_compile_check.py --limit 8  # the first 8 kernels only
    python scripts/cuda_compile_check.py --sources kernels.jsonl  # an earlier collection

Two steps. (1) A representative workload (the polynomial's generated forward, `.bwds`,
`.fwds`, broadcast sums and fused tape step, float-vector kernels, grid calls, pydiff's ops,
optimizers, a `Function`'s gradient add and a captured step) runs on the Vulkan device in a
child process with ``PYDIFF_KERNEL_SOURCES`` set, which makes pydiff record the Slang text
of every compute kernel it compiles and of every module they import that exists only as
text (``pydiff/kernel_sources.py``), in the forms a GPU gets (structured float4 loads,
float4 stores, the GPU's kernel shapes, one float4 per thread). SlangPy's own call kernels
(``SLANGPY_DUMP_GENERATED_SHADERS``) are collected beside them. (2) Each kernel is compiled
with ``slangc -target cuda`` with the macros, include paths and options SlangPy's CUDA
device compiles with, then to PTX with ``nvcc -arch=sm_90``; a kernel passes when the PTX
has its ``.entry`` and ``ptxas`` assembles it (as the driver would). Every
``[shader("compute")]`` entry point of ``shaders/`` should have been compiled at least once
(those the workload missed are named).

``slangc`` comes from ``$PYDIFF_SLANGC``, else the ``slangtorch`` wheel (downloaded once with
``pip download --no-deps`` into ``~/.cache/pydiff-slangc``; not a pydiff dependency). Without
``nvcc`` or ``slangc`` the check says so and exits 0 (``--require`` makes that exit 2).
What it cannot show: anything about running the kernels (values, races, timing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHADERS = ROOT / "shaders"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pydiff-slangc"
#: The forms of pydiff's kernels a CUDA device compiles (pydiff/kernels.py, buffer_pool.py).
GPU_FORMS = {
    "PYDIFF_FLOAT4_LOADS": "structured",
    "PYDIFF_FLOAT4_STORES": "float4",
    "PYDIFF_KERNEL_SHAPES": "gpu",
    "PYDIFF_FLOAT4_CHUNK": "1",
}
#: What SlangPy's CUDA device adds to every compile (sgl's SlangSession::create_session):
#: its target and shader-model macros, no NVAPI or device printing, row-major matrices,
#: warning 30856 off, loop inversion; its target is PTX through NVRTC, here nvcc.
SLANGC_OPTIONS = [
    "-D__TARGET_CUDA__=1",
    "-D__SHADER_TARGET_MAJOR=6",
    "-D__SHADER_TARGET_MINOR=7",
    "-DSGL_ENABLE_NVAPI=0",
    "-DSGL_ENABLE_PRINT=0",
    "-matrix-layout-row-major",
    "-warnings-disable",
    "30856",
    "-loop-inversion",
]
NVCC_OPTIONS = ["-arch=sm_90", "-ptx", "-diag-suppress", "1444,177,550,20012"]


# --------------------------------------------------------------------------------------------
# the tools


def find_slangc(download: bool = True) -> tuple[Path | None, str]:
    """The slangc to use, or None and why not."""
    given = os.environ.get("PYDIFF_SLANGC")
    if given:
        return (Path(given), "") if Path(given).is_file() else (None, f"PYDIFF_SLANGC={given}")
    found = sorted(CACHE.glob("slangtorch/bin/slangc"))
    if found:
        return found[0], ""
    if not download:
        return None, "no slangc cached (run scripts/cuda_compile_check.py once to fetch it)"
    CACHE.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE)]
        + ["slangtorch"],
        capture_output=True,
        text=True,
    )
    wheels = sorted(CACHE.glob("slangtorch-*.whl"))
    if got.returncode or not wheels:
        return None, "pip download slangtorch failed: " + (got.stderr.strip()[-300:] or "?")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for member in wheel.namelist():
            if member.startswith("slangtorch/bin/"):
                wheel.extract(member, CACHE)
    slangc = CACHE / "slangtorch/bin/slangc"
    if not slangc.is_file():
        return None, f"{wheels[-1].name} has no slangtorch/bin/slangc"
    slangc.chmod(0o755)
    return slangc, ""


def tools(download: bool = True) -> tuple[Path | None, str | None, str]:
    """(slangc, nvcc, why one is missing)."""
    nvcc = shutil.which("nvcc") or next(
        (str(p) for p in [Path("/usr/local/cuda/bin/nvcc")] if p.is_file()), None
    )
    if nvcc is None:
        return None, None, "no nvcc on PATH (install the CUDA toolkit)"
    slangc, why = find_slangc(download)
    return slangc, nvcc, why


# --------------------------------------------------------------------------------------------
# step 1: the workload, in a child process


WORKLOAD_SLANG = """
[Differentiable]
float poly(float a, float b, float c, float x) { return a * x * x + b * x + c; }
[Differentiable]
float3 shade(float3 n, float3 l, float k) { return n * (k * dot(n, l)); }
[Differentiable]
float2 rot(float2 p, float t)
{ return float2(p.x * cos(t) - p.y * sin(t), p.x * sin(t) + p.y * cos(t)); }
"""
GRID_SLANG = """
import slangpy;
[Differentiable]
void gpoly(int idx, float a, float b, float c, IDiffTensor<float, 1> x,
           IWDiffTensor<float, 1> result)
{
    float xval = x[idx];
    result[idx] = a * xval * xval + b * xval + c;
}
"""


def workload(parts: str) -> None:
    """Calls that make pydiff compile each kind of kernel it has (values are not checked);
    ``parts``: the comma-separated names of the groups to run."""
    import numpy as np
    import slangpy as spy

    import pydiff
    from pydiff import nn, ops, optim

    rng = np.random.default_rng(0)
    n = 1 << 14

    def rand(*shape: int) -> pydiff.Tensor:
        return pydiff.tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=True)

    def step(name: str, run) -> None:  # one failure must not hide the other kernels
        try:
            run()
        except Exception as exc:  # noqa: BLE001
            print(f"workload {name}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)

    poly_file = pydiff.load_module(str(ROOT / "samples/polynomial.slang"))
    m = pydiff.load_module_from_source("cudacheck_funcs", WORKLOAD_SLANG)
    x = rand(n)

    def elementwise() -> None:
        y = poly_file.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
        poly_file.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y.with_grads(ones=True))
        a, b = rand(1), rand(n)
        y = m.poly(a, b, -1.0, x, _result="tensor")  # broadcast partials, scalar parameter
        m.poly.bwds(a, b, -1.0, x, _result=y.with_grads(ones=True))
        m.poly.fwds(2.0, 8.0, -1.0, (x, pydiff.ones((n,))), _result="tensor")
        with pydiff.Tape() as tape:  # fused forward + backward
            z = m.poly(2.0, a, 1.0, x, _result="tensor")
        tape.backward(z, grad=np.ones(n, np.float32))

    def vectors() -> None:
        k = n // 4
        nn_, ll = rand(k, 3), rand(k, 3)
        out = m.shade(nn_, ll, 0.5, _result="tensor")
        m.shade.bwds(nn_, ll, 0.5, _result=out.with_grads(ones=True))
        m.shade.fwds((nn_, pydiff.ones((k, 3))), ll, 0.5, _result="tensor")
        p, t = rand(k, 2), rand(k)
        r = m.rot(p, t, _result="tensor")
        m.rot.bwds(p, t, _result=r.with_grads(ones=True))

    def grid() -> None:
        g = pydiff.load_module_from_source("cudacheck_grid", GRID_SLANG)
        xg = pydiff.tensor(np.linspace(-1, 1, n, dtype=np.float32)).with_grads(zero=True)
        result = pydiff.zeros((n,)).with_grads(ones=True)
        g.gpoly(spy.grid((n,)), 2.0, 8.0, -1.0, xg, result)
        g.gpoly.bwds(spy.grid((n,)), 2.0, 8.0, -1.0, xg, result)

    def operations() -> None:
        # (64, 64, 8): the narrow one-kernel backward (lavapipe's shapes); 8192 rows: the
        # bias gradient by the column-sum kernel
        for batch, fin, fout in ((64, 64, 8), (8, 12, 5), (256, 128, 256), (8192, 16, 16)):
            xb, w, b = rand(batch, fin), rand(fout, fin), rand(fout)
            for act in (None, "relu"):
                with pydiff.Tape() as tape:
                    h = ops.linear(xb, w, b, activation=act)
                    loss = ops.mean(ops.softmax(h))
                tape.backward(loss)
        for shape in ((16, 24), (4, 6, 8)):
            z, wt, bt = rand(*shape), rand(shape[-1]), rand(shape[-1])
            with pydiff.Tape() as tape:
                outs = [ops.softmax(z), ops.log_softmax(z, axis=0)]
                outs += [ops.rms_norm(z, wt)] if len(shape) == 2 else []
                outs += [ops.layer_norm(z, wt, bt), ops.sum(z, axis=0), ops.mean(z)]
                outs += [ops.exp(z), ops.tanh(z), ops.gelu(z), ops.silu(z), ops.sigmoid(z)]
                loss = ops.sum(ops.mul(z, z))
                for o in outs:
                    loss = ops.add(loss, ops.sum(o))
            tape.backward(loss)
        logits, labels = rand(32, 10), rng.integers(0, 10, 32).astype(np.int32)
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(logits, pydiff.tensor(labels))
        tape.backward(loss)
        q, kk, v = rand(2, 2, 16, 8), rand(2, 2, 16, 8), rand(2, 2, 16, 8)
        for causal in (False, True):
            with pydiff.Tape() as tape:
                loss = ops.sum(ops.attention(q, kk, v, causal=causal))
            tape.backward(loss)
        s = rand(16, 32)
        with pydiff.Tape() as tape:
            loss = ops.sum(ops.silu_and_mul(s)) + ops.sum(ops.dropout(s, 0.25, seed=1))
            loss = ops.add(loss, ops.mse_loss(s, pydiff.zeros((16, 32))))
        tape.backward(loss)
        r = rand(64, 64)
        with pydiff.Tape() as tape:
            loss = ops.sum(ops.relu(r))
        tape.backward(loss)
        kernels = pydiff.default_device().kernels  # (benchmarks' reference copy)
        kernels.get("ops/elementwise.slang", "copy4", CHUNK=kernels.chunk)
        a2, b2 = rand(33, 17), rand(17, 40)
        with pydiff.Tape() as tape:
            loss = ops.sum(ops.matmul(a2, b2))
        tape.backward(loss)

    def training() -> None:
        xb = pydiff.tensor(rng.standard_normal((32, 16)).astype(np.float32))
        yb = pydiff.empty((32,), dtype="int")
        yb.copy_from_numpy(rng.integers(0, 4, 32).astype(np.int32))
        kept = []
        for make in (
            lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
            lambda ps: optim.Adam(ps, lr=1e-3),
            lambda ps: optim.AdamW(ps, lr=1e-3, weight_decay=1e-2),
        ):
            layers = [nn.Linear(16, 32, seed=0, activation="relu"), nn.Linear(32, 4, seed=1)]
            opt = make([p for layer in layers for p in layer.parameters()])

            def train_step():
                opt.zero_grad()
                with pydiff.Tape() as tape:
                    loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
                tape.backward(loss, retain_graph=False)
                opt.step()
                return loss

            train_step()
            captured = pydiff.capture(train_step)
            captured.replay()
            kept.append((layers, opt, captured))

    def function_grad() -> None:
        class Square(pydiff.Function):
            @staticmethod
            def forward(ctx, t):
                ctx.save_for_backward(t)
                return ops.mul(t, t)

            @staticmethod
            def backward(ctx, g):
                (t,) = ctx.saved_tensors
                return ops.mul(ops.mul(g, t), pydiff.full(t.shape, 2.0))

        t = rand(n)
        with pydiff.Tape() as tape:
            y1 = Square.apply(t)
            y2 = Square.apply(t)
            loss = ops.add(ops.sum(y1), ops.sum(y2))
        tape.backward(loss)

    for name, run in (
        ("elementwise", elementwise),
        ("vectors", vectors),
        ("grid", grid),
        ("ops", operations),
        ("training", training),
        ("function", function_grad),
    ):
        if name in parts.split(","):
            step(name, run)
    pydiff.default_device().native.wait_for_idle()


ALL_PARTS = "elementwise,vectors,grid,ops,training,function"
#: A second pass in lavapipe's kernel shapes (still the GPU's float4 loads and stores): the
#: kernels only those shapes pick (``linear_bwd_narrow``, ``mm_tn``, 4 float4s per thread).
CPU_SHAPES_PARTS = "ops,training"


def collect(out: Path, workdir: Path, parts: str = ALL_PARTS, cpu_shapes: bool = True) -> None:
    """Run ``workload`` in child processes, recording into ``out`` (JSON lines) and SlangPy's
    call kernels into ``workdir/.temp``."""
    passes = [(parts, GPU_FORMS)]
    if cpu_shapes and any(p in CPU_SHAPES_PARTS.split(",") for p in parts.split(",")):
        cpu = {k: v for k, v in GPU_FORMS.items() if "SHAPES" not in k and "CHUNK" not in k}
        passes.append((CPU_SHAPES_PARTS, cpu))
    for which, forms in passes:
        env = {k: v for k, v in os.environ.items() if k not in GPU_FORMS}
        env.update(
            forms,
            PYDIFF_KERNEL_SOURCES=str(out),
            PYDIFF_DEVICE="vulkan",
            PYDIFF_CACHE="0",
            SLANGPY_DUMP_GENERATED_SHADERS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        run = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--workload", which],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
        )
        for line in run.stderr.splitlines():
            if line.startswith("workload ") or run.returncode:
                print(line[:400])
        if run.returncode:
            raise SystemExit(f"the workload failed (exit {run.returncode})")


# --------------------------------------------------------------------------------------------
# step 2: compiling


def load_records(path: Path) -> tuple[list[dict], dict[str, str]]:
    """(the kernels, one per source; the text modules by name)."""
    kernels, modules, seen = [], {}, set()
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec["kind"] == "module":
            modules.setdefault(rec["name"], rec["source"])
        elif (rec["source"], rec["entry"]) not in seen:
            seen.add((rec["source"], rec["entry"]))
            kernels.append(rec)
    return kernels, modules


def slangpy_records(workdir: Path) -> list[dict]:
    """SlangPy's call kernels dumped by the workload (entry point ``compute_main``)."""
    out = []
    for file in sorted((workdir / ".temp").glob("*.slang")):
        out.append(
            {
                "kind": "kernel",
                "name": "slangpy_" + re.sub(r"\W", "_", file.stem)[:80],
                "entry": "compute_main",
                "source": file.read_text(encoding="utf-8", errors="replace"),
                "site": "slangpy",
            }
        )
    return out


#: Kernels pydiff never builds on a CUDA device, by site: compiled all the same (they show
#: the gap), reported apart and not counted as failures.
NOT_ON_CUDA = {
    "grid": "generated_grid declines CUDA devices: SlangPy's tensor types hold pointers there, "
    "and the generated source assigns buffers to them"
}


def site(rec: dict) -> str:
    """Which part of pydiff a kernel comes from."""
    name = rec["name"]
    for prefix, what in (
        ("pydiff_kernel_", "shaders"),
        ("pydiff_gen_", "generated"),
        ("pydiff_grid_", "grid"),
    ):
        if name.startswith(prefix):
            return what
    return rec.get("site", "other")


def include_paths() -> list[str]:
    import slangpy as spy

    runtime = Path(spy.__file__).parent
    return [str(SHADERS), str(spy.SHADER_PATH), str(runtime / "shaders"), str(ROOT / "samples")]


def first_error(text: str) -> str:
    for line in text.splitlines():
        if re.search(r"\berror\b", line, re.I):
            return line.strip()[:300]
    lines = [x for x in text.splitlines() if x.strip()]
    return (lines[0] if lines else "(no output)")[:300]


def compile_one(
    rec: dict, slangc: Path, nvcc: str, moddir: Path, workdir: Path, index: int
) -> tuple[bool, str, float]:
    """(passed, the first error line or '', seconds) for one kernel."""
    start = time.perf_counter()
    stem = f"k{index:04d}"
    src = workdir / f"{stem}.slang"
    src.write_text(rec["source"], encoding="utf-8")
    cu, ptx = workdir / f"{stem}.cu", workdir / f"{stem}.ptx"
    env = dict(os.environ, LD_LIBRARY_PATH=str(slangc.parent))
    args = [str(slangc), str(src), "-entry", rec["entry"], "-stage", "compute"]
    reflection = workdir / f"{stem}.json"
    args += ["-target", "cuda", "-o", str(cu), "-reflection-json", str(reflection)]
    args += [*SLANGC_OPTIONS, "-I", str(moddir)]
    for path in include_paths():
        args += ["-I", path]
    got = subprocess.run(args, capture_output=True, text=True, env=env)
    if got.returncode or not cu.is_file():
        return False, "slangc: " + first_error(got.stderr + got.stdout), time.perf_counter() - start
    got = subprocess.run(
        [nvcc, *NVCC_OPTIONS, str(cu), "-o", str(ptx)], capture_output=True, text=True
    )
    if got.returncode or not ptx.is_file():
        return False, "nvcc: " + first_error(got.stderr + got.stdout), time.perf_counter() - start
    entries = re.findall(r"\.entry\s+(\w+)", ptx.read_text(errors="replace"))
    if rec["entry"] not in entries:
        return False, f"ptx has no .entry {rec['entry']} ({entries})", time.perf_counter() - start
    # ptxas: what the driver does with the PTX when it loads the kernel (shared memory and
    # register limits, PTX the assembler refuses)
    ptxas = str(Path(nvcc).with_name("ptxas"))
    got = subprocess.run(
        [ptxas if Path(ptxas).is_file() else "ptxas", "-arch=sm_90", "-v", str(ptx)]
        + ["-o", os.devnull],
        capture_output=True,
        text=True,
    )
    if got.returncode:
        return False, "ptxas: " + first_error(got.stderr + got.stdout), time.perf_counter() - start
    info = got.stderr + got.stdout
    why = launch_limits(info, reflection, rec["entry"])
    if why:
        return False, why, time.perf_counter() - start
    regs = re.search(r"Used (\d+) registers", info)
    return True, f"{regs.group(1)} registers" if regs else "", time.perf_counter() - start


def launch_limits(ptxas_info: str, reflection: Path, entry: str) -> str:
    """Why a launch of the kernel's thread group would fail on an sm_90 GPU, or ''. The
    PTX carries no bound on the group's size (Slang writes no ``__launch_bounds__``), so
    ptxas may use more registers than a group of ``[numthreads]`` threads can have: the
    launch fails (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES), as does static shared memory past
    48 KiB."""
    try:
        points = json.loads(reflection.read_text())["entryPoints"]
        size = next(p for p in points if p["name"] == entry)["threadGroupSize"]
    except (OSError, ValueError, KeyError, StopIteration):
        return ""
    threads = size[0] * size[1] * size[2]
    regs = re.search(r"Used (\d+) registers", ptxas_info)
    smem = re.search(r"(\d+) bytes smem", ptxas_info)
    if threads > 1024:
        return f"launch: {threads} threads a group (CUDA: at most 1024)"
    if regs:  # registers are allocated per warp, 8 a thread at a time, 64K a block
        per_thread = -(-int(regs.group(1)) // 8) * 8
        if per_thread * 32 * -(-threads // 32) > 65536:
            return (
                f"launch: {regs.group(1)} registers a thread x {threads} threads a group "
                "exceed the 65536 registers of a block"
            )
    if smem and int(smem.group(1)) > 48 * 1024:
        return f"launch: {smem.group(1)} bytes of static shared memory (CUDA: at most 48 KiB)"
    return ""


def shader_entries() -> set[tuple[str, str]]:
    """Every (file, entry) of ``[shader("compute")]`` in shaders/."""
    found = set()
    for file in SHADERS.rglob("*.slang"):
        text = file.read_text(encoding="utf-8")
        for m in re.finditer(r'\[shader\("compute"\)\][^\n]*\n?\s*\w+\s+(\w+)\s*\(', text):
            found.add((str(file.relative_to(SHADERS)), m.group(1)))
    return found


def run_check(
    kernels: list[dict], modules: dict[str, str], slangc: Path, nvcc: str, jobs: int
) -> list[tuple[dict, bool, str, float]]:
    with tempfile.TemporaryDirectory(prefix="pydiff-cudacheck-") as tmp:
        moddir, workdir = Path(tmp, "modules"), Path(tmp, "kernels")
        moddir.mkdir()
        workdir.mkdir()
        for name, source in modules.items():
            (moddir / f"{name}.slang").write_text(source, encoding="utf-8")
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(
                pool.map(
                    lambda ir: compile_one(ir[1], slangc, nvcc, moddir, workdir, ir[0]),
                    enumerate(kernels),
                )
            )
    return [(rec, *res) for rec, res in zip(kernels, results)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default=ALL_PARTS, help=f"workload groups ({ALL_PARTS})")
    parser.add_argument("--sources", type=Path, help="a JSON-lines collection to compile")
    parser.add_argument("--save", type=Path, help="keep the collection here")
    parser.add_argument("--limit", type=int, default=0, help="compile only the first N kernels")
    parser.add_argument("--only", default="", help="only kernels whose name contains this")
    parser.add_argument("--no-slangpy", action="store_true", help="skip SlangPy's call kernels")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--require", action="store_true", help="exit 2 when a tool is missing")
    args = parser.parse_args(argv)
    if args.workload:
        workload(args.workload)
        return 0
    slangc, nvcc, why = tools()
    if slangc is None or nvcc is None:
        print(f"cuda-compile-check: skipped: {why}")
        return 2 if args.require else 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pydiff-collect-") as tmp:
        extra = []
        if args.sources is None:
            sources = Path(tmp, "kernels.jsonl")
            collect(sources, Path(tmp), args.parts)
            extra = [] if args.no_slangpy else slangpy_records(Path(tmp))
            if args.save:
                lines = sources.read_text() + "".join(json.dumps(r) + "\n" for r in extra)
                args.save.write_text(lines)
        else:
            sources = args.sources
        kernels, modules = load_records(sources)
        kernels += [r for r in extra if r not in kernels]
    if args.no_slangpy:
        kernels = [k for k in kernels if site(k) != "slangpy"]
    collected = time.perf_counter() - start
    if args.only:
        kernels = [k for k in kernels if args.only in k["name"]]
    if args.limit:
        kernels = kernels[: args.limit]
    results = run_check(kernels, modules, slangc, nvcc, args.jobs)
    failed = [r for r in results if not r[1] and site(r[0]) not in NOT_ON_CUDA]
    for rec, ok, error, seconds in results:
        entry = f"{site(rec)}:{rec['name']}:{rec['entry']}"
        word = (
            "PASS" if ok else ("fail (not built on CUDA)" if site(rec) in NOT_ON_CUDA else "FAIL")
        )
        print(f"{word} {seconds:5.1f}s {entry}" + (f" ({error})" if ok else f"\n    {error}"))
    for what, why in NOT_ON_CUDA.items():
        if any(site(r[0]) == what for r in results):
            print(f"({what}: {why})")
    reached = {
        k["entry"] for k in kernels if site(k) == "shaders" and k["source"]
    }  # (by entry name: each shader entry's name is unique)
    missing = sorted(e for f, e in shader_entries() if e not in reached)
    counts: dict[str, int] = {}
    for rec, *_ in results:
        counts[site(rec)] = counts.get(site(rec), 0) + 1
    total = time.perf_counter() - start
    print(
        f"cuda-compile-check: {len(failed)} of {len(results)} kernels failed to compile "
        f"for CUDA sm_90 ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); "
        f"collecting {collected:.0f} s, total {total:.0f} s, {args.jobs} jobs"
    )
    if missing and not (args.limit or args.only):
        print(f"shader entry points the workload never compiled: {', '.join(missing)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
