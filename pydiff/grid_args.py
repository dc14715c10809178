"""SlangPy's grid argument (``spy.grid``), as every layer that treats it apart recognises it:
its type, and the index parameter types a grid fills.

    if is_grid(value): shape = value.shape.as_tuple()
    index_type("int2")            # ("int", 2); ("", 0): not an index a grid fills
    plain(spy.grid((4, 4)), 2)    # True: known sizes, stride 1, offset 0, two axes
"""

from __future__ import annotations

import re
from typing import Any

import slangpy as spy

GRID = type(spy.grid((1,)))  # (slangpy.experimental.gridarg.GridArg)

#: An index parameter a grid of its dimensions fills (SlangPy's VectorizeGridArgTo): int or
#: uint, or their vectors of 2 or 3, as written or as reflection names them (vector<int,2>).
INDEX = re.compile(r"(u?int)([23])?|vector\s*<\s*(u?int)\s*,\s*([23])\s*>")
#: A scalar integer index: SlangPy loads the thread's id there, dropping a grid's stride and
#: offset (call_shape refuses such a grid).
SCALAR_INDEX = re.compile(r"u?int(?:8|16|32|64)?(?:_t)?")


def is_grid(value: Any) -> bool:
    """Whether ``value`` is SlangPy's ``grid(...)`` argument.

    >>> is_grid(spy.grid((4, 4)))     # True; a tensor or a number: False
    """
    return type(value) is GRID


def index_type(type_name: str) -> tuple[str, int]:
    """An index parameter's integer type and dimensions (``("int", 2)`` for ``int2``);
    ``("", 0)``: not one a grid fills.

    >>> index_type("vector<uint,3>")  # ("uint", 3)
    """
    m = INDEX.fullmatch(type_name.strip())
    if m is None:
        return "", 0
    scalar, dims = m.group(1) or m.group(3), m.group(2) or m.group(4) or "1"
    return scalar, int(dims)


def plain(grid: Any, dims: int) -> bool:
    """A grid of ``dims`` axes of known sizes, stride 1 and offset 0 on each (the ids it
    yields are the elements of a tensor of its shape).

    >>> plain(spy.grid((8,), stride=(2,)), 1)   # False: it yields 0, 2, 4, ...
    """
    shape = grid.shape.as_tuple()
    return (
        len(shape) == dims
        and all(int(size) >= 0 for size in shape)  # (-1: a size the call decides)
        and list(grid.stride) == [1] * dims
        and list(grid.offset) == [0] * dims
    )
