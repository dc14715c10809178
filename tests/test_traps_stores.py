"""A subscript store into an interface diff tensor followed by another use of that tensor
(breaker2 case 4): SlangPy 0.43.1's `.bwds` never finishes compiling (memory grows by GBs).

Each spelling is scanned (`pydiff.lint`) and run through raw SlangPy in a subprocess: a
refused one must really hang (no result in 60 s, or the runaway compile hits a 4 GB address
resident memory limit), an allowed one must build and give the gradients of a float64 NumPy model
(central differences). Found by experiment: the hang needs a *subscript* store (`t[i] = v`,
`t[i] += v`) followed, further down the same function, by any other load or store of `t`
(subscript, `.load`, `.store`) or a call passing `t`. A `.store(...)`, a helper's store, reads
in the store's own statement and `t.shape` are fine.
"""

from __future__ import annotations

import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from itertools import zip_longest

import numpy as np
import pytest
from cpu_watch import run_remembered, run_watched

import pydiff
from pydiff import lint_sources

HELPERS = """
[Differentiable] void put(IWDiffTensor<float, 1> t, int j, float v) { t[j] = v; }
[Differentiable] void putrw(IRWDiffTensor<float, 1> t, int j, float v) { t[j] = v; }
[Differentiable] float get(IRWDiffTensor<float, 1> t, int j) { return t[j]; }
[Differentiable] void put2(IWDiffTensor<float, 1> t, int j, float v) { t[j] = v; t[j + 3] = v * v; }
"""
SIGNATURE = (
    "void f(int i, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> d, IWDiffTensor<float, 1> y)"
)

# (id, body of f, NumPy model of one thread i (None: it hangs)); threads i = 0, 1, 2 on
# x = 1..6, d = 0.5 * (1..6), y = 0 (six elements each)
REFUSED = [
    ("iw-same-element-twice", "y[i] = x[i]; y[i] = x[i] * 2.0;"),
    ("iw-two-elements", "float a = x[i]; y[i] = a; y[i + 3] = a * a;"),
    ("iw-constant-then-store", "y[i] = 0.0; y[i] = x[i] * x[i];"),
    ("irw-read-back-same", "d[i] = x[i] * x[i]; y[i] = d[i];"),
    ("irw-read-other-element", "d[i] = x[i] * x[i]; y[i] = d[i + 3];"),
    ("irw-read-then-two-stores", "float v = d[i]; d[i] = v * x[i]; d[i + 3] = v;"),
    (
        "irw-twice-at",
        "float v = d[i]; d[i] = v * v; float w = d[i]; d[i] = w * 3.0 + v; y[i] = x[i];",
    ),
    ("compound-then-read", "d[i] += x[i]; y[i] = d[i + 3];"),
    ("subscript-then-store-method", "float a = x[i]; y[i] = a; y.store(i + 3, a * a);"),
    ("subscript-then-load-method", "d[i] = x[i] * x[i]; y[i] = d.load(i + 3);"),
    ("subscript-then-helper-store", "float a = x[i]; y[i] = a; put(y, i + 3, a * a);"),
    ("subscript-then-helper-read", "d[i] = x[i] * x[i]; y[i] = get(d, i + 3);"),
    ("helper-with-two-stores", "put2(y, i, x[i]);"),
]

ALLOWED = [
    ("load-then-store", "d[i] = d[i] * d[i] * x[i];", "d[i] = d[i] * d[i] * x[i]"),
    ("two-loads-one-store", "d[i] = d[i] * d[i + 3] + x[i];", "d[i] = d[i] * d[i + 3] + x[i]"),
    ("compound-alone", "d[i] += x[i] * x[i];", "d[i] += x[i] * x[i]"),
    ("iw-one-store", "y[i] = x[i] * x[i];", "y[i] = x[i] * x[i]"),
    (
        "stores-to-two-tensors",
        "float v = d[i]; d[i] = v * x[i]; y[i] = v + x[i];",
        "v = d[i]; d[i] = v * x[i]; y[i] = v + x[i]",
    ),
    (
        "shape-after-store",
        "y[i] = x[i] * x[i]; int n = y.shape[0]; d[i] = x[i] * float(n);",
        "y[i] = x[i] * x[i]; d[i] = x[i] * 6",
    ),
    (
        "two-helper-stores",
        "float a = x[i]; put(y, i, a); put(y, i + 3, a * a);",
        "y[i] = x[i]; y[i + 3] = x[i] * x[i]",
    ),
    (
        "helper-store-then-subscript-store",
        "float a = x[i]; put(y, i + 3, a * a); y[i] = a;",
        "y[i + 3] = x[i] * x[i]; y[i] = x[i]",
    ),
    (
        "store-methods-two-elements",
        "float a = x[i]; y.store(i, a); y.store(i + 3, a * a);",
        "y[i] = x[i]; y[i + 3] = x[i] * x[i]",
    ),
    (
        "store-method-then-subscript-store",
        "float a = x[i]; y.store(i, a); y[i + 3] = a * a;",
        "y[i] = x[i]; y[i + 3] = x[i] * x[i]",
    ),
]

_RAW = """
import sys, numpy as np, slangpy as spy
dev = spy.create_device(type=spy.DeviceType.vulkan)
m = spy.Module.load_from_source(dev, "stores", sys.argv[1])
x = spy.Tensor.from_numpy(dev, np.arange(1, 7, dtype=np.float32)).with_grads(zero=True)
d = spy.Tensor.from_numpy(dev, np.arange(1, 7, dtype=np.float32) * 0.5).with_grads(zero=True)
y = spy.Tensor.zeros(dev, (6,), "float").with_grads(zero=True)
m.f(spy.grid((3,)), x, d, y)
print("forward ok", flush=True)
m.f.bwds(spy.grid((3,)), x, d, y)
print("ok")
"""

# the allowed spellings through pydiff, whose .bwds of an in-place call differentiates the
# values before the call (raw SlangPy reads the tensor's current values and adds into one
# gradient buffer, docs/tensors-and-gradients.md)
_PYDIFF = """
import sys, warnings, numpy as np, pydiff, slangpy as spy
src, expected = sys.argv[1], sys.argv[2]
dev = pydiff.create_device("vulkan")
m = pydiff.load_module_from_source("stores", src, device=dev)
x = pydiff.tensor(np.arange(1, 7, dtype=np.float32), device=dev, requires_grad=True)
d = pydiff.tensor(np.arange(1, 7, dtype=np.float32) * 0.5, device=dev, requires_grad=True)
y = pydiff.zeros((6,), device=dev, requires_grad=True)
m.f(spy.grid((3,)), x, d, y)
print("forward ok", flush=True)
d.grad.copy_from_numpy(np.arange(1, 7, dtype=np.float32))
y.grad.copy_from_numpy(np.arange(1, 7, dtype=np.float32) * 10)
m.f.bwds(spy.grid((3,)), x, d, y)
got = np.concatenate([x.grad.numpy(), d.grad.numpy()])
want = np.array([float(v) for v in expected.split(",")])
print("ok" if np.allclose(got, want, rtol=1e-4, atol=1e-4) else f"wrong {got.tolist()}")
"""


def _source(body: str) -> str:
    return f"import slangpy;\n{HELPERS}\n[Differentiable]\n{SIGNATURE}\n{{\n{body}\n}}\n"


def _model_vjp(model: str) -> str:
    """x.grad and d.grad (float64 central differences) of the NumPy model of the threads."""
    step = compile(model.replace("; ", "\n"), "<model>", "exec")

    def run(xd):
        x, d, y = xd[:6].copy(), xd[6:].copy(), np.zeros(6)
        for i in range(3):
            exec(step, {}, {"x": x, "d": d, "y": y, "i": i})
        return np.concatenate([d, y])

    x0 = np.concatenate([np.arange(1.0, 7.0), 0.5 * np.arange(1.0, 7.0)])
    up = np.concatenate([np.arange(1.0, 7.0), 10 * np.arange(1.0, 7.0)])
    grad = np.zeros(12)
    for k in range(12):
        e = np.zeros(12)
        e[k] = 1e-6
        grad[k] = (up @ run(x0 + e) - up @ run(x0 - e)) / 2e-6
    return ",".join(f"{g:.9g}" for g in grad)


def _run_watched(args: list[str], timeout: float = 60, max_rss: int = 3 << 29):
    """(returncode, stdout, stderr), or None when the child used ``timeout`` seconds of its
    own CPU time or its resident memory passed ``max_rss`` (then it is killed: the runaway
    compile). CPU time, not wall time: under load a healthy compile is slow, not a hang."""
    return run_watched(args, cpu_budget=timeout, max_rss=max_rss)


def _verdict(script: str, body: str, expected: str = "") -> str:
    """'ok', 'wrong ...', 'hang' (no result in 60 s, or past 1.5 GB of memory: the runaway
    compiles grow by about 150 MB/s) or 'error ...'."""
    args = [sys.executable, "-c", script, _source(body), expected]
    if script is _RAW:  # (raw SlangPy's verdict, remembered; pydiff's own runs each time)
        done = run_remembered(args, cpu_budget=60, max_rss=3 << 29)
    else:
        done = _run_watched(args)
    if done is None:
        return "hang"
    rc, out, err = done
    if rc != 0:
        return f"error {rc} {out[-200:]} {err[-400:]}"
    return out.strip().splitlines()[-1]


def _refused(body: str) -> list:
    return lint_sources.scan_module(_source(body), "<stores>", []).traps.get("f", [])


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_scan_refuses(case):
    found = _refused(case[1])
    assert found and all(f.kind == "interface-store-then-access" for f in found), found


@pytest.mark.parametrize("case", ALLOWED, ids=[c[0] for c in ALLOWED])
def test_scan_allows(case):
    assert not _refused(case[1])


def test_finding_names_file_line_and_fix():
    src = "import slangpy;\n" + textwrap.dedent(
        """\
        [Differentiable]
        void twice(int i, IRWDiffTensor<float, 2> d)
        {
            float v = d[i, 0];
            d[i, 0] = v * v;
            d[i, 1] = v;
        }
        [Differentiable]
        void outer(int i, IRWDiffTensor<float, 2> d) { twice(i, d); }
        """
    )
    traps = lint_sources.scan_module(src, "lib.slang", []).traps
    (f,) = traps["twice"]
    assert (f.file, f.line, f.kind) == ("lib.slang", 6, "interface-store-then-access")
    assert "'d[i, 0] = v * v'" in f.message and "'d[i, 1] = v'" in f.message
    assert "store each element once" in f.message and "DiffTensor" in f.message
    assert str(f).startswith("lib.slang:6: in twice(): ")
    assert traps["outer"] == [f]
    assert not lint_sources.scan_module(src.replace("IRWDiffTensor", "RWDiffTensor"), "c", []).traps


@pytest.fixture(scope="module")
def verdicts():
    """Raw SlangPy's verdict on every case, four subprocesses at a time (at most 6 GB; most
    hangs end at the memory bound), hangs and right cases interleaved."""
    if "vulkan" not in pydiff.available_devices():
        pytest.skip("the oracle runs on Vulkan")
    refused = [(c[0], _RAW, c[1], "") for c in REFUSED]
    allowed = [(c[0], _PYDIFF, c[1], _model_vjp(c[2])) for c in ALLOWED]
    jobs = [job for pair in zip_longest(refused, allowed) for job in pair if job]
    with ThreadPoolExecutor(4) as pool:
        outcomes = pool.map(lambda job: _verdict(*job[1:]), jobs)
        return dict(zip((j[0] for j in jobs), outcomes))


@pytest.mark.slow
@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_really_hangs(verdicts, case):
    assert verdicts[case[0]] == "hang", verdicts[case[0]]


@pytest.mark.slow
@pytest.mark.parametrize("case", ALLOWED, ids=[c[0] for c in ALLOWED])
def test_allowed_really_right(verdicts, case):
    assert verdicts[case[0]] == "ok", verdicts[case[0]]


def test_refused_through_pydiff_without_hanging(device):
    """pydiff refuses .bwds at once (in a subprocess, so that a regression cannot hang the run);
    the forward call still runs."""
    src = _source(REFUSED[1][1])
    line = src.splitlines().index(REFUSED[1][1]) + 1
    code = textwrap.dedent(
        f"""
        import warnings, numpy as np, pydiff, slangpy as spy
        warnings.simplefilter("ignore")
        dev = pydiff.create_device({device.type!r})
        m = pydiff.load_module_from_source("stores", {src!r}, device=dev)
        x = pydiff.tensor(np.arange(1, 7, dtype=np.float32), device=dev, requires_grad=True)
        d = pydiff.tensor(np.ones(6, np.float32), device=dev, requires_grad=True)
        y = pydiff.zeros((6,), device=dev, requires_grad=True)
        m.f(spy.grid((3,)), x, d, y)
        print("FORWARD", y.numpy().tolist())
        try:
            m.f.bwds(spy.grid((3,)), x, d, y)
            print("GRAD", x.grad.numpy().tolist())
        except pydiff.ShaderTrapError as exc:
            print("REFUSED", str(exc))
        """
    )
    done = _run_watched([sys.executable, "-c", code], timeout=120)
    if done is None:
        pytest.fail(".bwds hung instead of being refused")
    rc, out, err = done
    assert rc == 0, err[-400:]
    assert "FORWARD [1.0, 2.0, 3.0, 1.0, 4.0, 9.0]" in out, out
    assert "REFUSED" in out and f"<stores>:{line}:" in out, out
    assert "store each element once" in out, out
