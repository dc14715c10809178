"""The overload-resolution error says a name is a Slang built-in only when it is one."""

import numpy as np
import pytest

import pydiff
from pydiff.arguments import is_builtin_name

SOURCE = """
float myf(float x) { return x; }
float myf(float2 x) { return x.x; }
float myf(float3 x) { return x.x; }
float myf(float4 x) { return x.x; }
float myf(float x, float y) { return x; }
float lerp(float a, float b) { return a + b; }
"""


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("overload_hint", SOURCE, device=device)


def test_builtin_names_by_reflection(device):
    for name in ("lerp", "exp", "dot", "max"):
        assert is_builtin_name(device, name), name
    for name in ("myf", "square", "accumulate", "my_lerp"):
        assert not is_builtin_name(device, name), name


def test_hint_only_for_a_builtin_name(m):
    bad = np.zeros((2, 2, 2, 2, 2), np.int32)  # no overload takes this
    with pytest.raises(TypeError, match="could not match") as own:
        m.myf(bad, _result="tensor")
    assert "built-in" not in str(own.value)  # five overloads, all the user's
    with pytest.raises(TypeError, match="could not match") as builtin:
        # (an int NumPy array would be converted to float: an int tensor is not)
        m.lerp(pydiff.zeros((2, 2), dtype="int", device=m.device), 1, _result="tensor")
    assert "'lerp' is also the name of Slang built-in functions" in str(builtin.value)
