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


BUILTIN_SHARED = """
[Differentiable] float mad(float a, float b) { return a * b + 1.0; }
float lerp(float a, float b) { return a + b; }
float clamp(float x) { return x; }
float clamp(float x, float lo, float hi, float extra) { return x; }
"""


@pytest.fixture(scope="module")
def shared(device):
    return pydiff.load_module_from_source("overload_builtin", BUILTIN_SHARED, device=device)


@pytest.mark.parametrize(
    "name, args, own",
    [
        ("mad", 1, ["mad(float a, float b)"]),
        ("lerp", 5, ["lerp(float a, float b)"]),
        ("clamp", 2, ["clamp(float x)", "clamp(float x, float lo, float hi, float extra)"]),
    ],
)
def test_arity_error_separates_builtins_and_lists_each_once(device, shared, name, args, own):
    x = pydiff.tensor(np.ones(2, np.float32), device=device)
    with pytest.raises(TypeError, match=f"no overload takes {args} argument") as info:
        getattr(shared, name)(*[x] * args, _result="numpy")
    msg = str(info.value)
    head, _, builtins = msg.partition(f"Slang built-in functions also named '{name}'")
    assert builtins, msg  # the built-ins are said to be built-in
    for sig in own:  # the module's own overloads come first, each once
        assert head.count(f"overload_builtin.{sig}") == 1, msg
        assert sig not in builtins, msg
    listed = [ln.strip() for ln in builtins.splitlines()[1:] if ln.strip()]
    assert listed and len(listed) == len(set(listed)), msg
    assert all(f" {name}(" in ln for ln in listed), msg


def test_arity_error_without_builtins_says_nothing_of_them(device, m):
    x = pydiff.tensor(np.ones(2, np.float32), device=device)
    with pytest.raises(TypeError, match="no overload takes 3 argument") as info:
        m.myf(x, x, x, _result="numpy")
    assert "built-in" not in str(info.value)
    assert str(info.value).count("overload_hint.myf(float x)") == 1
