"""The pydiff command line's refusals (a bad PYDIFF_DEVICE in `info`, usage errors under
--json, a --points too large to allocate) and Slang's E31159 warning about SlangPy's generated
loads of struct arguments, which no longer reaches the user's console."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import cli
from pydiff.device_names import auto_override
from pydiff.errors import EnvironmentSettingError
from pydiff.modcheck import MAX_POINTS, check_module
from test_cli import pydiff_cli

ROOT = Path(__file__).parent.parent
WRONG = "tests/shaders/check_wrong.slang"
BAD_DEVICE = (
    "PYDIFF_DEVICE='bogus': unknown device type; expected one of auto, cuda, d3d12, metal, "
    "vulkan (or unset)"
)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """cli.main in this process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# -- 1. PYDIFF_DEVICE: read and refused like every other switch, by `info` too


def test_pydiff_device_values(monkeypatch):
    for value, expected in (("Vulkan", "vulkan"), (" cuda ", "cuda"), ("auto", None), ("", None)):
        monkeypatch.setenv("PYDIFF_DEVICE", value)
        assert auto_override() == expected, value
    monkeypatch.setenv("PYDIFF_DEVICE", "bogus")
    with pytest.raises(EnvironmentSettingError) as info:
        auto_override()
    assert str(info.value) == BAD_DEVICE
    monkeypatch.setenv("PYDIFF_DEVICE", "cpu")  # a backend pydiff refuses: why, and the variable
    with pytest.raises(EnvironmentSettingError, match=r"PYDIFF_DEVICE='cpu': SlangPy 0.43's CPU"):
        auto_override()


def test_create_device_auto_names_the_variable(monkeypatch):
    monkeypatch.setenv("PYDIFF_DEVICE", "bogus")  # it said "type='bogus'", an argument not given
    with pytest.raises(EnvironmentSettingError) as info:
        pydiff.create_device("auto")
    assert str(info.value) == BAD_DEVICE
    with pytest.raises(ValueError, match=r"^type='nope': unknown device type"):
        pydiff.create_device("nope")  # the argument's own message is unchanged


def test_info_refuses_a_bad_pydiff_device(device):
    if device.type != "vulkan":
        pytest.skip("the parsing is the same on every backend; checked once, on Vulkan")
    out = pydiff_cli("info", PYDIFF_DEVICE="bogus")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == f"pydiff info: {BAD_DEVICE}"
    assert out.stdout == ""  # refused first: no listing as if the variable were unset
    as_json = pydiff_cli("info", "--json", PYDIFF_DEVICE="bogus")
    assert as_json.returncode == 2
    assert json.loads(as_json.stdout) == {"error": BAD_DEVICE}
    check = pydiff_cli("check", "tests/shaders/check_none.slang", PYDIFF_DEVICE="bogus")
    assert check.returncode == 2 and check.stderr.strip() == f"pydiff check: {BAD_DEVICE}"
    good = pydiff_cli("info", "--json", PYDIFF_DEVICE=device.type.upper())
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["pydiff_device"] == device.type


# -- 2. usage errors under --json: a JSON object on stdout as well


@pytest.mark.parametrize(
    "args, error",
    [
        (("check", WRONG, "--json", "--points", "0"), "argument --points: '0': expected"),
        (("check", "--json", WRONG, "--eps", "x"), "argument --eps: 'x' is not a number"),
        (("check", WRONG, "--js", "--rtol", "-1"), "argument --rtol: '-1'"),  # abbreviated
        (("check", WRONG, "--json", "--device", "bogus"), "argument --device: 'bogus'"),
        (("check", "--json"), "the following arguments are required: file"),
        (("check", WRONG, "--json", "--nope"), "unrecognized arguments: --nope"),
    ],
)
def test_check_json_usage_errors_are_json(capsys, args, error):
    code, out, err = run_main(capsys, *args)
    assert code == 2
    report = json.loads(out)
    assert report["passed"] is False and report["results"] == [] and report["file"] is None
    assert report["error"].startswith(error), report
    assert error in err  # the human message (and usage) still on stderr


def test_usage_errors_without_json_print_nothing_on_stdout(capsys):
    code, out, err = run_main(capsys, "check", WRONG, "--points", "0")
    assert (code, out) == (2, "") and "argument --points: '0'" in err
    code, out, err = run_main(capsys, "info", "--json", "--bogus")
    assert code == 2 and json.loads(out) == {"error": "unrecognized arguments: --bogus"}


# -- 3. --points: bounded before anything is allocated


def test_huge_points_are_refused_naming_the_bound(capsys):
    code, out, err = run_main(capsys, "check", WRONG, "--points", "10000000000")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == (
        f"pydiff check: error: argument --points: '10000000000': expected a whole number "
        f"<= {MAX_POINTS}"
    )
    assert "MemoryError" not in err and "Traceback" not in err
    with pytest.raises(ValueError, match=rf"points=10000000000 must be .* 1 to {MAX_POINTS}"):
        check_module(WRONG, points=10**10)


def test_points_at_the_bound_still_check(device):
    rows = check_module(ROOT / WRONG, ["fine"], device=device, points=MAX_POINTS)
    assert {r.status for r in rows} == {"PASS"}
    assert max(r.points for r in rows) == MAX_POINTS


# -- 4. E31159 on SlangPy's generated struct loads: silenced there, kept for the user's code

_STRUCTS = """
import numpy as np, pydiff
src = '''
struct Q : IDifferentiable { float a; float b; };
[Differentiable] float sq(Q q, float x) { return q.a * x * x + q.b; }
'''
m = pydiff.load_module_from_source("s27_struct_loads", src)
a = pydiff.tensor(np.array([0.5, -1.0, 2.0], np.float32), requires_grad=True)
with pydiff.Tape() as tape:
    y = m.sq({"a": a, "b": 1.0}, 2.0, _result="tensor")
tape.backward(y, grad=np.ones(3, np.float32))
print("grad", a.grad.numpy().tolist(), flush=True)
"""

_USERS_OWN = """
import pydiff
pydiff.load_module_from_source("s27_users_struct", '''
struct Scale { float k; [Differentiable] float apply(float x) { return x * k; } };
[Differentiable] float g(float x) { Scale s; s.k = 2.0; return s.apply(x); }
''')
print("loaded", flush=True)
"""


def _fresh_compile(code: str, device) -> str:
    env = {**os.environ, "PYDIFF_CACHE": "0", "PYDIFF_DEVICE": device.type}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


def test_struct_argument_backward_prints_no_slang_warning(device):
    if device.type != "vulkan":
        pytest.skip("Slang's front end warns alike on every backend; checked once")
    text = _fresh_compile(_STRUCTS, device)
    # d/da (a x^2 + b) at x = 2 is 4 per element, whatever b
    grad = next(ln for ln in text.splitlines() if ln.startswith("grad "))
    np.testing.assert_allclose(json.loads(grad[5:]), [4.0, 4.0, 4.0], rtol=1e-6)
    assert "E31159" not in text and "warning" not in text.lower(), text


def test_the_users_own_method_still_gets_the_warning(device):
    if device.type != "vulkan":
        pytest.skip("checked once, on Vulkan")
    text = _fresh_compile(_USERS_OWN, device)
    assert "warning[E31159]" in text and "member 'k'" in text and "'apply'" in text, text
