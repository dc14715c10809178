"""gradcheck with outputs that do not depend on the input (integer ones skipped, float ones a
zero Jacobian), torch inputs, the float32 step hint; `pydiff check FILE` reading a file
relative to the working directory, never one found on the shader search path."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pydiff
from pydiff import ops
from pydiff.finite_diff import float32_step_hint
from pydiff.modcheck import check_module

from conftest import SHADERS


def _x(device, data=(0.5, 0.6, 0.7)):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, requires_grad=True)


def _index(device):
    return pydiff.tensor(np.array([2, 0, 1], np.int32), device=device)


@pytest.mark.parametrize("check_forward", [None, True])
def test_integer_outputs_are_skipped(device, load, check_forward):
    x, idx = _x(device), _index(device)
    assert pydiff.gradcheck(lambda t: (ops.mul(t, 2.0), idx), (x,), check_forward=check_forward)
    assert pydiff.gradcheck(lambda t: (idx, ops.exp(t)), (x,), check_forward=check_forward)
    # a wrong derivative beside an integer output still fails (d x^3 = 3x^2, it says 2x^2)
    m = load("chain", device)
    with pytest.raises(pydiff.GradcheckError, match="input 0, element"):
        pydiff.gradcheck(lambda t: (idx, m.cube_wrong(t, _result="tensor")), (x,))
    with pytest.raises(pydiff.GradcheckError):
        pydiff.gradcheck(lambda t: (m.cube_wrong(t, _result="tensor"), idx), (x,))


def test_only_integer_outputs_are_refused(device):
    x, idx = _x(device), _index(device)
    with pytest.raises(ValueError, match="no floating-point tensor.*integer"):
        pydiff.gradcheck(lambda t: idx, (x,))


@pytest.mark.parametrize("check_forward", [None, True])
def test_unconnected_float_outputs_have_a_zero_jacobian(device, check_forward):
    x, idx = _x(device), _index(device)
    c = pydiff.tensor(np.array([1.0, 2.0], np.float32), device=device)
    for second in (c, idx.astype("float")):
        assert pydiff.gradcheck(
            lambda t, s=second: (ops.mul(t, 2.0), s), (x,), check_forward=check_forward
        )


def test_float_output_through_a_host_path_fails(device):
    # x**2 computed on the host: no recorded call, so AD says 0; d(x^2)/dx = 2x says not
    x = _x(device)

    def host(t):
        return ops.mul(t, 2.0), pydiff.tensor(t.numpy().astype(np.float64) ** 2, device=device)

    assert not pydiff.gradcheck(host, (x,), raise_exception=False)
    with pytest.raises(pydiff.GradcheckError, match="input 0"):
        pydiff.gradcheck(host, (x,))


def test_torch_input_with_requires_grad_points_to_from_torch(device, load):
    torch = pytest.importorskip("torch")
    m = load("chain", device)
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(TypeError, match=r"input 0 is a torch tensor.*pydiff\.from_torch"):
        pydiff.gradcheck(m.square, (x,))
    # beside a pydiff tensor that is checked, too: its gradient would go unchecked
    with pytest.raises(TypeError, match=r"input 1\[0\] is a torch tensor"):
        pydiff.gradcheck(lambda a, b: m.square(a, _result="tensor"), (_x(device), [x]))
    # converted as the message says, it is checked
    assert pydiff.gradcheck(
        m.square, (pydiff.from_torch(x.detach(), device=device, requires_grad=True),)
    )


def test_large_inputs_fail_with_a_float32_hint_that_works(device, load):
    m = load("chain", device)
    x = _x(device, [1e3, 2e3, -3e3])
    with pytest.raises(pydiff.GradcheckError, match=r"hint: inputs reach \|x\| = 3000.*eps=3"):
        pydiff.gradcheck(m.square, (x,))
    assert pydiff.gradcheck(m.square, (x,), eps=3.0)  # the hint's step: a right x^2 passes
    with pytest.raises(pydiff.GradcheckError):  # and a wrong derivative still fails there
        pydiff.gradcheck(m.cube_wrong, (x,), eps=3.0)
    # near 1 a failure is a failure, with no hint to blame rounding
    with pytest.raises(pydiff.GradcheckError) as caught:
        pydiff.gradcheck(m.cube_wrong, (_x(device),))
    assert "hint" not in str(caught.value)


def test_float32_step_hint_threshold():
    # float32 spacing at 1024 is 2^-13; the step 2*eps = 2e-3; ratio 6.1%, rtol / 4 = 0.25%
    assert "6.1%" in float32_step_hint(1024.0, 1e-3, 1e-2)
    assert float32_step_hint(1.0, 1e-3, 1e-2) == ""  # 2^-23 / 2e-3 = 0.006%
    assert float32_step_hint(1024.0, 1.0, 1e-2) == ""


def _cli(cwd, *args, device=None):
    env = dict(os.environ)
    if device is not None:
        env["PYDIFF_DEVICE"] = device.type
    return subprocess.run(
        [sys.executable, "-m", "pydiff", "check", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        env=env,
    )


@pytest.mark.parametrize("name", ["pydiff.slang", "ops/softmax.slang", "missing.slang"])
def test_check_missing_file_exits_2_not_a_library_shader(tmp_path, name):
    out = _cli(tmp_path, name)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no such file" in out.stderr and name in out.stderr
    assert "nothing to check" not in out.stdout
    js = _cli(tmp_path, name, "--json")
    assert js.returncode == 2
    report = json.loads(js.stdout)
    assert not report["passed"] and "no such file" in report["error"]


def test_check_directory_exits_2(tmp_path):
    (tmp_path / "adir").mkdir()
    out = _cli(tmp_path, "adir")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "is a directory" in out.stderr and "not found" not in out.stderr


def test_check_reads_a_relative_file_from_the_working_directory(tmp_path, device):
    shutil.copy(SHADERS / "check_wrong.slang", tmp_path / "mine.slang")
    out = _cli(tmp_path, "mine.slang", device=device)
    assert out.returncode == 1, out.stdout + out.stderr  # cube's backward is wrong
    assert "FAIL" in out.stdout and "PASS" in out.stdout


def test_check_module_refuses_a_name_on_the_search_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_module("pydiff.slang")
    with pytest.raises(IsADirectoryError):
        check_module(tmp_path)
