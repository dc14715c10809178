"""A shader function given a temporary copy (indexing and .T return copies) at a parameter it
writes (out, inout, _result=) is refused: m.scale2(x[1:3]) wrote the copy and dropped it, x
silently unchanged (break48b). A named copy is written as any tensor. References: NumPy
arrays given the same operations."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

SOURCE = """
void scale2(inout float x) { x = 2.0 * x; }
void setv(float v, out float y) { y = v; }
float sq(float a) { return a * a; }
void pick(float v, out float y) { y = v; }
void pick(float v, float w, out float y) { y = v + w; }
"""


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("s48_written_copies", SOURCE, device=device)


def _x(device):
    return pydiff.tensor(np.arange(6.0, dtype=np.float32), device=device)


CALLS = {
    "inout": lambda m, x: m.scale2(x[1:3]),
    "out": lambda m, x: m.setv(7.0, x[1:3]),
    "out by name": lambda m, x: m.setv(7.0, y=x[1:3]),
    "all by name": lambda m, x: m.setv(v=7.0, y=x[1:3]),
    "_result": lambda m, x: m.sq(
        pydiff.tensor(np.ones(2, np.float32), device=x.device), _result=x[1:3]
    ),
    "overloaded": lambda m, x: m.pick(1.0, 2.0, x[2:4]),
    "transpose": lambda m, x: m.scale2(x.T),
}


@pytest.mark.parametrize("case", sorted(CALLS))
def test_a_written_temporary_copy_is_refused(device, m, case):
    x = _x(device)
    with pytest.raises(TypeError, match="temporary copy") as info:
        CALLS[case](m, x)
    assert "c = x" in str(info.value)  # (the advice names the copy to keep)
    np.testing.assert_array_equal(x.numpy(), np.arange(6.0))  # nothing written, as before


def test_named_and_held_copies_are_written(device, m):
    x = _x(device)
    c = x[1:3]
    m.scale2(c)
    np.testing.assert_array_equal(c.numpy(), [2.0, 4.0])
    held = [x[2:5]]
    m.setv(7.0, held[0])
    np.testing.assert_array_equal(held[0].numpy(), [7.0, 7.0, 7.0])
    x[1:3] = c  # the documented way back into x
    ref = np.arange(6.0)
    ref[1:3] *= 2
    np.testing.assert_array_equal(x.numpy(), ref)


def test_reading_a_temporary_copy_is_not_refused(device, m):
    x = _x(device)
    y = m.sq(x[1:4], _result="tensor")  # (an `in` parameter: the copy is only read)
    np.testing.assert_array_equal(y.numpy(), np.arange(1.0, 4.0) ** 2)
    m.scale2(x)  # x itself, no copy
    np.testing.assert_array_equal(x.numpy(), 2 * np.arange(6.0))
