"""The pydiff command line, run as a subprocess on good and deliberately broken shaders."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SHADERS = Path(__file__).parent / "shaders"


def pydiff_cli(*args: str, device=None, **variables: str):
    env = {**os.environ, **variables}
    if device is not None:
        env["PYDIFF_DEVICE"] = device.type
    return subprocess.run(
        [sys.executable, "-m", "pydiff", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env=env,
    )


def test_check_passes_correct_functions_with_kinks_and_domains(device):
    out = pydiff_cli("check", str(SHADERS / "check_good.slang"), "--json", device=device)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["passed"]
    rows = {(r["function"], r["parameter"], r["mode"]): r for r in report["results"]}
    for fn in ("smooth", "kink", "logarithm", "field", "split", "cube", "dense"):
        assert rows[(fn, "(all)", "adjoint")]["status"] == "PASS", fn
        if fn != "dense":  # SlangPy's tensor loads have no forward derivative
            assert rows[(fn, "(all)", "forward")]["status"] == "PASS", fn
    assert rows[("smooth", "y", "backward")]["status"] == "PASS"
    assert rows[("field", "p", "backward")]["status"] == "PASS"
    assert (
        rows[("dense", "w", "backward")]["status"] == "PASS"
    )  # tensors of 4 elements per dimension
    # 4 elements, then the 11 past them in the second probe at 15 per dimension (w is 2-D:
    # the size is shared, so the 1-D x gets 15 too, not 31)
    assert rows[("dense", "x", "backward")]["points"] == 4 + 1 + 11  # (+ element 0 at 15)
    assert ("field", "k", "backward") not in rows  # no_diff: held fixed
    assert (
        rows[("logarithm", "x", "backward")]["points"] == 8
    )  # negative samples: outside the domain
    assert rows[("logarithm", "x", "backward")]["outside_domain"] == 8
    assert not any(r["function"] == "not_differentiable" for r in report["results"])


def test_check_flags_a_wrong_backward_derivative(device):
    out = pydiff_cli("check", str(SHADERS / "check_wrong.slang"), device=device)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(ln.startswith("cube") and " backward " in ln and "FAIL" in ln for ln in lines), (
        out.stdout
    )
    assert any(ln.startswith("fine") and " backward " in ln and "PASS" in ln for ln in lines), (
        out.stdout
    )
    assert "1 failed" in out.stdout or "2 failed" in out.stdout
    only_fine = pydiff_cli(
        "check", str(SHADERS / "check_wrong.slang"), "--function", "fine", device=device
    )
    assert only_fine.returncode == 0, only_fine.stdout


def test_check_reports_skips_with_reasons(device):
    out = pydiff_cli("check", str(SHADERS / "chain.slang"), "--json", device=device)
    report = json.loads(out.stdout)
    rows = {(r["function"], r["parameter"], r["mode"]): r for r in report["results"]}
    assert rows[("halve_sum", "x", "backward")]["status"] == "PASS"  # a tensor function once
    # inout parameters are checked (issue 15), not skipped
    assert rows[("double_in_place", "v", "backward")]["status"] == "PASS"
    assert rows[("double_in_place", "(all)", "forward")]["status"] == "PASS"
    skipped = {r["function"]: r["why"] for r in report["results"] if r["status"] == "SKIPPED"}
    assert "double_in_place" not in skipped


def _strict(text):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_check_json_is_strict_and_nan_gradients_fail(device):
    out = pydiff_cli("check", str(SHADERS / "check_nan.slang"), "--json", device=device)
    assert out.returncode == 1, out.stdout + out.stderr
    report = _strict(out.stdout)  # no bare NaN / Infinity
    assert report["passed"] is False
    rows = {(r["function"], r["parameter"], r["mode"]): r for r in report["results"]}
    for fn in ("nan_grad", "inf_grad", "half_nan"):
        row = rows[(fn, "x", "backward")]
        assert row["status"] == "FAIL" and "NaN or infinite" in row["why"]
        assert row["max_abs_error"] in ("nan", "inf")
    assert rows[("fine", "x", "backward")]["status"] == "PASS"
    assert isinstance(rows[("fine", "x", "backward")]["max_abs_error"], float)
    text = pydiff_cli("check", str(SHADERS / "check_nan.slang"), device=device)
    assert text.returncode == 1 and "NaN or infinite" in text.stdout


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ("check", "tests/shaders/syntax_error.slang"),
            2,
            r"syntax_error.slang:\d+: Slang compile error",
        ),
        (("check", "tests/shaders/no_such_file.slang"), 2, "not found"),
        (
            ("check", "tests/shaders/check_wrong.slang", "--function", "nope"),
            2,
            "no \\[Differentiable\\] function named nope",
        ),
        # a step or tolerance that would make every check pass without checking (exit 0)
        (("check", "tests/shaders/check_wrong.slang", "--eps", "0"), 2, "--eps: '0': expected"),
        (("check", "tests/shaders/check_wrong.slang", "--eps", "nan"), 2, "--eps: 'nan'"),
        (("check", "tests/shaders/check_wrong.slang", "--atol", "nan"), 2, "--atol: 'nan'"),
        (("check", "tests/shaders/check_wrong.slang", "--rtol", "-1"), 2, "--rtol: '-1'"),
        (("check", "tests/shaders/check_wrong.slang", "--points", "0"), 2, "--points: '0'"),
        (("check", "tests/shaders/check_wrong.slang", "--points", "2.5"), 2, "not a whole"),
        (("check", "tests/shaders/check_wrong.slang", "--seed", "-1"), 2, "--seed: '-1'"),
    ],
)
def test_check_errors_are_messages_not_tracebacks(device, args, code, message):
    import re

    out = pydiff_cli(*args, device=device)
    assert out.returncode == code
    assert re.search(message, out.stderr), out.stderr
    assert "Traceback" not in out.stderr


def test_check_with_nothing_to_check(device):
    out = pydiff_cli("check", str(SHADERS / "check_none.slang"), device=device)
    assert out.returncode == 0
    assert "no [Differentiable] functions: nothing to check" in out.stdout


def test_info_lists_versions_devices_and_paths(device):
    out = pydiff_cli("info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["slangpy"] == "0.43.1"
    opened = {d["type"]: d for d in data["devices"] if d["opens"]}
    assert device.type in opened
    assert set(opened[device.type]["features"]) >= {"atomic_float", "atomic_int64"}
    assert data["shader_dir"] in opened[device.type]["include_paths"]
    text = pydiff_cli("info").stdout
    assert "slangpy  0.43.1" in text and "float atomics" in text
    fast = opened[device.type]["fast_kernels"]
    assert fast == {
        "loads": "typed" if device.typed_loads else "structured",
        "stores": "paired 64-bit" if device.kernels.paired_stores else "float4",
        "float4s_per_thread": device.kernels.chunk,
        "shapes": "GPU" if device.kernels.gpu else "lavapipe",
    }
    assert f"fast kernels: {fast['loads']} float4 loads, {fast['stores']} stores" in text
    cache = data["compile_cache"]
    assert set(cache) >= {"enabled", "path", "bytes", "max_bytes"}
    assert ("compile cache: " + (cache["path"] or "off")) in text


def test_check_lists_generic_functions_and_takes_several_names(device, tmp_path):
    src = tmp_path / "generic.slang"
    src.write_text(
        "[Differentiable] float g<let N : int>(float x) { return N * x * x; }\n"
        "[Differentiable] float h(float x) { return x; }\n"
        "[Differentiable] float k(float x) { return 3.0 * x; }\n"
    )
    out = pydiff_cli("check", str(src), "--json", device=device)
    report = json.loads(out.stdout)
    assert {r["function"]: r["why"] for r in report["results"] if r["status"] == "SKIPPED"} == {
        "g": "generic function: pydiff check cannot choose its type arguments"
    }
    both = json.loads(
        pydiff_cli("check", str(src), "--json", "--function", "h", "k", device=device).stdout
    )
    assert {r["function"] for r in both["results"]} == {"h", "k"}
    missing = pydiff_cli("check", str(tmp_path / "none.slang"), "--json", device=device)
    assert missing.returncode == 2 and "not found" in json.loads(missing.stdout)["error"]


@pytest.mark.parametrize(
    "command",
    [("info",), ("cache",), ("cache", "clear"), ("check", "tests/shaders/check_none.slang")],
)
def test_a_bad_switch_is_one_line_and_exit_2(device, command, tmp_path):
    if device.type != "vulkan":
        pytest.skip("the parsing is the same on every backend; checked once, on Vulkan")
    # (a cache of its own: `cache clear` must stop before removing anything, but if not...)
    out = pydiff_cli(*command, PYDIFF_CACHE_MAX_MB="abc", PYDIFF_CACHE_DIR=str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == (
        f"pydiff {command[0]}: PYDIFF_CACHE_MAX_MB='abc': expected a positive number of MB "
        "(or unset)"
    )


def test_cache_says_when_its_folder_is_a_file(device, tmp_path):
    if device.type != "vulkan":
        pytest.skip("checked once, on Vulkan")
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("x")
    out = pydiff_cli("cache", PYDIFF_CACHE_DIR=str(not_a_folder), PYDIFF_CACHE="1")
    assert out.returncode == 0, out.stderr
    assert f"{not_a_folder}: not a folder" in out.stdout
