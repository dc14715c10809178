"""pydiff.testing as a pytest plugin in somebody else's test suite (pytester)."""

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = """
import numpy as np
import pydiff
from pydiff.testing import assert_gradients_close

SRC = "[Differentiable] float cube(float x) { return x * x * x; }"

def test_gradcheck(device):
    m = pydiff.load_module_from_source("user_cube", SRC, device=device)
    x = pydiff.tensor([0.5, -1.0, 2.0], device=device, requires_grad=True)
    assert_gradients_close(m.cube, (x,))
    assert_gradients_close(m.cube, (x,), expected=[3 * x.numpy() ** 2])

def test_wrong_expectation_fails(device):
    m = pydiff.load_module_from_source("user_cube2", SRC, device=device)
    x = pydiff.tensor([0.5, -1.0], device=device, requires_grad=True)
    assert_gradients_close(m.cube, (x,), expected=[2 * x.numpy() ** 2])
"""


def test_plugin_fixture_and_helper(pytester, device):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess(
        f"--pydiff-device={device.type},cuda", "-p", "no:cacheprovider"
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 1, result.stdout.str()
    assert outcomes.get("failed") == 1
    result.stdout.fnmatch_lines(["*gradient of input 0 of *cube*"])
    if device.type != "cuda":
        assert outcomes.get("skipped") == 2  # cuda does not open here


def test_unknown_backend_is_a_usage_error(pytester):
    pytester.makepyfile(test_user="def test_x(device):\n    pass\n")
    result = pytester.runpytest_subprocess("--pydiff-device=vulkn")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown device type(s) *vulkn*"])


def test_a_users_own_device_fixture_wins(pytester):
    pytester.makeconftest("import pytest\n@pytest.fixture\ndef device():\n    return 'mine'\n")
    pytester.makepyfile(test_user="def test_x(device):\n    assert device == 'mine'\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
