"""`pydiff info` and `create_device("auto")` with a PYDIFF_DEVICE pydiff does not take: one
line naming the variable and its values, exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pydiff
from pydiff.device_names import auto_override
from pydiff.errors import EnvironmentSettingError

ROOT = Path(__file__).parent.parent
BAD_DEVICE = (
    "PYDIFF_DEVICE='bogus': unknown device type; expected one of auto, cuda, d3d12, metal, "
    "vulkan (or unset)"
)


def pydiff_cli(*args: str, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pydiff", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, **variables},
    )


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
    check = pydiff_cli("check", "tests/shaders/check_none.slang", PYDIFF_DEVICE="bogus")
    assert check.returncode == 2 and check.stderr.strip() == f"pydiff check: {BAD_DEVICE}"
    good = pydiff_cli("info", "--json", PYDIFF_DEVICE=device.type.upper())
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["pydiff_device"] == device.type
