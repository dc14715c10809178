"""Devices, module loading, compile errors, the shader library and the trap guards."""

import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import pydiff
from conftest import SHADERS
from pathlib import Path


def test_available_devices_lists_what_opens():
    found = pydiff.available_devices()
    assert set(found) <= {"cuda", "d3d12", "vulkan"}
    for name in found:
        assert pydiff.create_device(name).type == name


def test_auto_prefers_first_available_and_env_override(monkeypatch):
    found = pydiff.available_devices()
    if not found:
        pytest.skip("no device opens here")
    assert pydiff.create_device("auto").type == found[0]
    monkeypatch.setenv("PYDIFF_DEVICE", found[-1])
    assert pydiff.create_device().type == found[-1]


def test_unknown_and_cpu_types():
    with pytest.raises(ValueError, match="type='tpu'"):
        pydiff.create_device("tpu")
    with pytest.raises(pydiff.DeviceUnavailableError, match="cannot dispatch"):
        pydiff.create_device("cpu")


def test_default_device_is_reused():
    assert pydiff.default_device() is pydiff.default_device()


def test_lavapipe_runs_inline_on_small_machines_unless_the_user_chose():
    from pydiff.device import LAVAPIPE_INLINE_MAX_CPUS, choose_lavapipe_threads

    env = {}
    assert choose_lavapipe_threads(env, cpus=LAVAPIPE_INLINE_MAX_CPUS) == "0"
    assert env == {"LP_NUM_THREADS": "0"}
    env = {"LP_NUM_THREADS": "3"}
    assert choose_lavapipe_threads(env, cpus=1) == "3" and env == {"LP_NUM_THREADS": "3"}
    env = {}
    assert choose_lavapipe_threads(env, cpus=LAVAPIPE_INLINE_MAX_CPUS + 1) is None and env == {}


def test_opening_a_device_applies_the_lavapipe_thread_choice():
    code = (
        "import os, pydiff\n"
        "pydiff.available_devices()\n"
        "print(os.environ.get('LP_NUM_THREADS'), len(os.sched_getaffinity(0)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()
    threads, cpus = out[-2], int(out[-1])
    assert threads == ("0" if cpus <= 2 else "None")


def test_shader_library_on_include_path(device):
    assert (pydiff.shader_dir() / "pydiff.slang").is_file()
    m = pydiff.load_module_from_source(
        "uses_lib",
        "import pydiff;\n"
        "[Differentiable] float twice_plus(float x) { return scale_add(2.0, x, 1.0); }",
        device=device,
    )
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    np.testing.assert_allclose(m.twice_plus(x, _result="tensor").numpy(), [3.0, 5.0])
    m.twice_plus.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0])


def test_missing_file_lists_searched_paths(device):
    with pytest.raises(
        FileNotFoundError, match=r"(?s)'nope\.slang' not found; searched:.*nope\.slang"
    ):
        pydiff.load_module("nope.slang", device=device)


def test_compile_error_has_file_and_line(device):
    with pytest.raises(
        pydiff.SlangCompileError, match=r"syntax_error\.slang:5: Slang compile error"
    ) as info:
        pydiff.load_module(SHADERS / "syntax_error.slang", device=device)
    assert info.value.line == 5 and info.value.file.endswith("syntax_error.slang")


def test_compile_error_from_source_names_module(device):
    with pytest.raises(
        pydiff.SlangCompileError, match=r"(?s)<broken_src>:2: .*undefined identifier"
    ):
        pydiff.load_module_from_source(
            "broken_src", "float g(float x) {\n  return y;\n}\n", device=device
        )


def test_unknown_function_suggests_close_match(device, load):
    m = load("calls", device)
    with pytest.raises(AttributeError, match=r"no function 'sqare'; did you mean 'square'"):
        m.sqare
    assert "square" in m.function_names()


def test_trap_warnings_at_load_and_errors_at_bwds(device):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = pydiff.load_module(SHADERS / "traps.slang", device=device)
    kinds = " ".join(str(w.message) for w in caught)
    assert "x.load(idx)" in kinds and "declare the loop counter / index as 'int'" in kinds
    assert all(issubclass(w.category, pydiff.ShaderTrapWarning) for w in caught)
    import slangpy as spy

    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    with pytest.raises(
        pydiff.ShaderTrapError, match=r"traps\.slang:8: in load_through_interface\(\)"
    ):
        m.load_through_interface.bwds(spy.grid((2,)), x, y)
    with pytest.raises(pydiff.ShaderTrapError, match="traps.slang:8"):  # inherited by a caller
        m.calls_trapped.bwds(spy.grid((2,)), x, y, _result=1.0)
    with pytest.raises(
        pydiff.ShaderTrapError, match=r"'input\[i\]'.*'bias\[idx\]'.*segfault.*as 'int'"
    ):
        m.linear_uint.bwds(spy.grid((2,)), pydiff.zeros((2, 2), device=device), x, x, y)
    # Forward calls and untouched functions still work.
    m.load_through_interface(spy.grid((2,)), x, y)
    np.testing.assert_allclose(y.numpy(), [1.0, 4.0])
    m.fine.bwds(x, _result=1.0)


SAMPLE_RUNS = [
    ("polynomial.py", "dy/dx      = [12. 16. 20. 24.]"),
    ("seeds_tour.py", "polynomial       [ 9. 23. 41. 63.]"),
    ("legendre_function.py", "gradcheck: True"),
    ("capture_user_step.py --steps 40 --n 64", "eager and captured against NumPy float64"),
    (
        "deterministic_gradients.py --log2 16 --runs 3",
        "pydiff                        1 bit pattern(s)",
    ),
    (
        "attention_block.py --steps 60",
        "gradcheck of the block (layer_norm, attention, silu_and_mul, linear): True",
    ),
]


@pytest.mark.parametrize("sample, expected", SAMPLE_RUNS)
def test_samples_run(sample, expected):
    out = _run_sample(*sample.split())
    assert expected in out.stdout


# Samples whose result is a fit: the figure they print, parsed, against the truth.
FITTING_SAMPLES = {
    "fit_chain.py --steps 300 --plot=": (
        r"fitted a, b, c = ([-\d.]+), ([-\d.]+), ([-\d.]+)",
        lambda a, b, c: abs(a - 1.5) < 0.05 and abs(b - 1.2) < 0.05 and abs(c - 0.3) < 0.05,
    ),
    "pinn_poisson.py --steps 300 --plot=": (
        r"max \|u - sin\(pi x\)\| on \[0, 1\] = ([-\d.e+]+)",
        lambda err: err < 1e-2,  # 1.0e-3 measured; the exact solution is sin(pi x)
    ),
    "train_mlp.py --epochs 5 --plot=": (
        r"test accuracy ([\d.]+)%",
        lambda acc: acc > 50.0,  # 3 classes (or 10 digits with scikit-learn): chance is <= 33%
    ),
}


@pytest.mark.parametrize("sample", list(FITTING_SAMPLES))
def test_fitting_samples_reach_the_truth(sample):
    pattern, good = FITTING_SAMPLES[sample]
    out = _run_sample(*sample.split())
    found = re.search(pattern, out.stdout)
    assert found, out.stdout[-2000:]
    assert good(*map(float, found.groups())), found.group(0)
    assert "Warning" not in out.stderr, out.stderr[-2000:]


def test_torch_layer_sample_trains_and_its_gradients_match_torch():
    pytest.importorskip("torch")
    out = _run_sample("torch_layer.py", "--steps", "300", "--plot=")
    diff = re.search(r"layer gradients vs torch float64: max difference ([\d.e+-]+)", out.stdout)
    assert diff and float(diff.group(1)) < 1e-5, out.stdout[-2000:]
    mse = re.search(r"mse: first step ([\d.]+), last step ([\d.]+)", out.stdout)
    assert mse and float(mse.group(2)) < 0.01 * float(mse.group(1)), out.stdout[-2000:]


def test_implicit_layer_sample_matches_finite_differences_and_trains():
    out = _run_sample("implicit_layer.py", "--steps", "60")
    diff = re.search(
        r"gradient vs float64 finite differences: max difference ([\d.e+-]+) "
        r"\(max \|grad\| ([\d.e+-]+)\)",
        out.stdout,
    )
    assert diff and float(diff.group(1)) < 1e-4 * float(diff.group(2)), out.stdout[-2000:]
    mse = re.search(r"mse: first step ([\d.]+), after \d+ steps ([\d.]+)", out.stdout)
    assert mse and float(mse.group(2)) < 0.1 * float(mse.group(1)), out.stdout[-2000:]
    assert "Warning" not in out.stderr, out.stderr[-2000:]


def test_newton_jacobians_sample_matches_closed_forms_and_converges():
    out = _run_sample("newton_jacobians.py").stdout

    def figure(label: str) -> float:
        found = re.search(label + r": max difference ([\d.e+-]+)", out)
        assert found, out[-2000:]
        return float(found.group(1))

    assert figure("jacfwd vs A") < 1e-5 and figure("jacrev vs jacfwd") < 1e-6, out
    assert figure("hvp vs closed form") < 1e-5 and figure("hessian vs closed form") < 1e-5, out
    final = re.search(r"final \|grad f\| in float64: ([\d.e+-]+)", out)
    assert final and float(final.group(1)) < 1e-4, out[-2000:]  # from 2.8 at the start


def test_every_sample_script_is_run_by_a_test():
    run = {s.split()[0] for s in FITTING_SAMPLES} | {"torch_layer.py", "implicit_layer.py"}
    run |= {"newton_jacobians.py"}
    run |= {"train_mlp_distributed.py"}  # run by tests/test_distributed.py (needs torch)
    run |= {s.split()[0] for s, _ in SAMPLE_RUNS}
    helpers = {"plotting.py"}  # imported by the others
    scripts = {p.name for p in (Path(__file__).parent.parent / "samples").glob("*.py")}
    assert scripts - helpers <= run, (
        f"samples not run by any test: {sorted(scripts - helpers - run)}"
    )


def _run_sample(*args: str) -> subprocess.CompletedProcess:
    """Run samples/<args[0]> with the rest as arguments from the repository root; must succeed."""
    out = subprocess.run(
        [sys.executable, f"samples/{args[0]}", *args[1:]],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out


def test_batched_mixed_index_kinds_refused(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pydiff.load_module(SHADERS / "traps.slang", device=device)
    import slangpy as spy

    x = pydiff.zeros((2, 3), device=device, requires_grad=True)
    w = pydiff.zeros((4, 3), device=device, requires_grad=True)
    y = pydiff.zeros((2, 4), device=device).with_grads(ones=True)
    with pytest.raises(
        pydiff.ShaderTrapError,
        match=r"'x\[xi\]'.*'w\[j, k\]'.*index every interface tensor the same way",
    ):
        m.dense_multi_index.bwds(spy.grid((2, 4)), x, w, y)


def test_lint_vector_index_warns_without_refusing():
    from pydiff import lint

    src = """[Differentiable]
void f(int2 tid, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y) { y[tid] = x[tid]; }"""
    found = lint.scan_source(src, "v.slang")
    assert [f.kind for f in found] == ["vector-index-order"]
    assert "reversed order" in str(found[0]) and not found[0].refuses_bwds
    assert lint.affected_functions(src, found) == {}


def test_lint_ignores_comments_and_plain_functions():
    from pydiff import lint

    src = """// x.load(i) in a comment
float g(IDiffTensor<float, 1> x, int i) { return x.load(i); }   // not differentiable
[Differentiable] float h(int i, IDiffTensor<float, 1> x) { return x[i]; /* x.load(i) */ }"""
    assert lint.scan_source(src) == []


def test_fit_chain_recovers_parameters():
    out = _run_sample("fit_chain.py", "--steps", "200", "--plot=")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("fitted a, b, c ="))
    fitted = [float(v) for v in line.split("=")[1].split("truth")[0].split(",")]
    np.testing.assert_allclose(fitted, [1.5, 1.2, 0.3], atol=0.03)


def test_pinn_sample_solves_poisson():
    out = _run_sample("pinn_poisson.py", "--steps", "600", "--plot=")
    check = next(
        ln for ln in out.stdout.splitlines() if ln.startswith("u'' written out vs pydiff.hvp")
    )
    assert float(check.split()[-1]) < 1e-4
    final = next(ln for ln in out.stdout.splitlines() if "max |u - sin(pi x)|" in ln)
    assert float(final.split("=")[-1]) < 2e-2, final


def test_backends_without_a_driver_are_not_probed(monkeypatch):
    """A missing platform or driver is said at once, without SlangPy's slow failed probe."""
    from pydiff.device import missing_driver

    monkeypatch.setattr(sys, "platform", "linux")
    assert "Windows" in missing_driver("d3d12")
    assert "macOS" in missing_driver("metal")
    assert missing_driver("vulkan") is None
    monkeypatch.setattr(sys, "platform", "darwin")
    assert "macOS" in missing_driver("cuda")
