"""What ``pydiff check`` generates for a function of numbers: every parameter broken into
leaves (float scalars/vectors/matrices, ints, and the fields of structs, nested), random
values per sample point, and the arguments of one vectorised call.

    layout = Layout.of(fn)                       # or a str: why fn cannot be sampled
    values = layout.random_values(16, rng)       # leaf key -> (points, ...) array
    args, written = layout.arguments(values, 16, device)

Float leaves get values half positive, half negative, none near 0 (for a function with
half values: multiples of 2^-10, which half holds exactly, as it does the check's steps);
int leaves (``int``, ``uint2``, ...) small values 1..3 (valid as counts, exponents or small
indices); ``out`` parameters zeros. A leaf's key is its parameter name, with field names
after a dot for struct fields (``p.a``). Every call builds its tensors afresh from the
values, so an ``inout`` argument written by one call
never leaks into the next.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .creation import tensor as make_tensor
from .module import ShaderFunction

_SCALAR = {"float": (), "half": (), "double": ()}
_VECTOR = re.compile(r"^(?:vector<(float|half),\s*(\d)>|(float|half)(\d))$")
_MATRIX = re.compile(r"^(?:matrix<(float|half),\s*(\d),\s*(\d)>|(float|half)(\d)x(\d))$")
_INT = {"int": "int", "uint": "uint", "int32_t": "int", "uint32_t": "uint"}
_INT_VECTOR = re.compile(r"^(?:vector<(int|uint),\s*(\d)>|(int|uint)(\d))$")


def int_shape(type_name: str) -> tuple[str, tuple[int, ...]] | None:
    """(pydiff dtype, trailing NumPy dims) of an int/uint scalar or vector type, else None.

    >>> int_shape("int"), int_shape("uint2"), int_shape("vector<int, 3>"), int_shape("float")
    (('int', ()), ('uint2', (2,)), ('int3', (3,)), None)
    """
    if type_name in _INT:
        return _INT[type_name], ()
    m = _INT_VECTOR.match(type_name)
    if m:
        base, n = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return f"{base}{n}", (int(n),)
    return None


def value_shape(type_name: str) -> tuple[str, tuple[int, ...]] | None:
    """(pydiff dtype, trailing NumPy dims) of a float scalar/vector/matrix type, else None.

    >>> value_shape("float3"), value_shape("matrix<float, 2, 3>"), value_shape("int")
    (('float3', (3,)), ('float2x3', (2, 3)), None)
    """
    if type_name in _SCALAR:
        return type_name, ()
    m = _VECTOR.match(type_name)
    if m:
        base, n = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return f"{base}{n}", (int(n),)
    m = _MATRIX.match(type_name)
    if m:
        base, r, c = (m.group(1), m.group(2), m.group(3)) if m.group(1) else m.group(4, 5, 6)
        return f"{base}{r}x{c}", (int(r), int(c))
    return None


@dataclass(frozen=True)
class Leaf:
    """One generated value: ``key`` (``p`` or ``p.field``), the field path inside its
    parameter, its dtype and trailing dims, and whether a gradient flows to it."""

    key: str
    path: tuple[str, ...]
    dtype: str
    elem: tuple[int, ...]
    is_int: bool
    differentiable: bool


class Layout:
    """The leaves of every parameter of one function (see the module docstring)."""

    def __init__(self, fn: ShaderFunction, leaves: dict[str, list[Leaf]]):
        self.fn = fn
        self.leaves = leaves  # parameter name -> its leaves
        self.points = 0  # sample points of the last random_values

    @classmethod
    def of(cls, fn: ShaderFunction) -> "Layout | str":
        """The layout, or a sentence saying which parameter cannot be generated."""
        found: dict[str, list[Leaf]] = {}
        for p in fn.params:
            diff = p.differentiable and not p.no_diff
            got = _leaves(fn, p.type_name, p.name, (), diff, depth=0)
            if isinstance(got, str):
                return f"parameter '{p.name}' ({p.type_name}): {got}"
            # no_diff fields of an IDifferentiable struct get no derivative: held fixed
            got = [
                replace(leaf, differentiable=False) if _under(leaf.path, p.no_grad_fields) else leaf
                for leaf in got
            ]
            if p.io != "in" and any(leaf.path or leaf.is_int for leaf in got):
                return (
                    f"{p.io} parameter '{p.name}' has type {p.type_name}: only float scalars, "
                    "vectors and matrices are generated as outputs"
                )
            found[p.name] = got
        ret = fn.signature.return_type
        if ret != "void" and value_shape(ret) is None:
            return f"result type {ret} is not a float scalar, vector or matrix"
        return cls(fn, found)

    def inputs(self) -> list[Leaf]:
        """Leaves the call reads (in and inout parameters)."""
        return [leaf for p in self.fn.params if p.io != "out" for leaf in self.leaves[p.name]]

    def checked(self) -> list[Leaf]:
        """Leaves whose gradient is checked: differentiable floats the call reads."""
        return [leaf for leaf in self.inputs() if leaf.differentiable and not leaf.is_int]

    def no_gradients(self) -> str | None:
        """Why .bwds cannot be checked: a checked leaf, an output or the result is a double
        (no gradient buffer for it), or None."""
        leaves = {leaf.key: leaf.dtype for leaf in self.checked() + self.outputs()}
        doubles = [key for key, dtype in leaves.items() if "double" in dtype]
        doubles += ["the result"] * ("double" in self.fn.signature.return_type)
        return (
            f"{', '.join(doubles)}: double values cannot get gradients (pydiff's gradients are "
            "float or half: Slang has no double atomics), so .bwds cannot be checked; checked "
            "in forward mode"
            if doubles
            else None
        )

    def random_values(self, points: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        self.points = points
        values = {}
        for leaf in self.inputs():
            shape = (points,) + leaf.elem
            if leaf.is_int:
                values[leaf.key] = rng.integers(1, 4, shape).astype(np.float64)
                continue
            magnitude = rng.uniform(0.2, 1.5, shape)
            sign = np.where(
                np.arange(points).reshape((points,) + (1,) * len(leaf.elem)) % 2 == 0, 1.0, -1.0
            )
            values[leaf.key] = magnitude * sign
            if self.half_precision():  # multiples of 2^-10: x and x + h u exact in half
                values[leaf.key] = np.round(values[leaf.key] * 1024) / 1024
        return values

    def direction(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """A random direction u per checked leaf, shaped (points, ...) like the values
        (``random_values`` gives the points); in quarters when the function has half
        values, so that a step ``x + h u`` with a power-of-two h stays exact in half."""
        out = {}
        for leaf in self.checked():
            u = rng.uniform(-1.0, 1.0, (self.points,) + leaf.elem)
            out[leaf.key] = np.round(u * 4) / 4 if self.half_precision() else u
        return out

    def half_precision(self) -> bool:
        """Whether a parameter (or field) or the result is half: then every float leaf is
        sampled on half's grid (a float converted to half inside must not round) and the
        check's steps and tolerances follow half's resolution (``fd.for_precision``)."""
        ret = value_shape(self.fn.signature.return_type)
        types = [leaf.dtype for leaves in self.leaves.values() for leaf in leaves]
        return any(d.startswith("half") for d in types + ([ret[0]] if ret else []))

    def half_leaf(self, leaf: Leaf) -> bool:
        """Whether ``leaf``'s gradient is checked at half's tolerances: it is half, or an
        output (the result, an out value) is. A float leaf beside a half parameter keeps the
        float tolerances (before 2026-11-29 its gradient 2% off passed)."""
        ret = value_shape(self.fn.signature.return_type)
        outs = [o.dtype for o in self.outputs()] + ([ret[0]] if ret else [])
        return any(d.startswith("half") for d in [leaf.dtype, *outs])

    def arguments(
        self, values: dict[str, np.ndarray], points: int, device: Any, grads: bool = False
    ) -> tuple[list[Any], dict[str, Any]]:
        """The call's arguments built from ``values`` (fresh tensors), and the tensor of
        every leaf by key (with gradient buffers on checked leaves when ``grads``)."""
        checked = {leaf.key for leaf in self.checked()} if grads else set()
        made: dict[str, Any] = {}
        args = []
        for p in self.fn.params:
            fields: dict[str, Any] = {}
            for leaf in self.leaves[p.name]:
                if leaf.is_int:
                    data = values[leaf.key].astype(np.int32)
                    t = make_tensor(data, dtype=leaf.dtype, device=device)
                else:
                    data = np.zeros((points,) + leaf.elem) if p.io == "out" else values[leaf.key]
                    t = make_tensor(data.astype(np.float32), dtype=leaf.dtype, device=device)
                if leaf.key in checked:
                    t.requires_grad_(True)
                made[leaf.key] = t
                if not leaf.path:
                    args.append(t)
                    break
                _put(fields, leaf.path, t)
            else:
                args.append(fields)
        return args, made

    def outputs(self) -> list[Leaf]:
        """What a call gives, besides its result: out and inout parameters, in order."""
        return [self.leaves[p.name][0] for p in self.fn.params if p.io != "in"]


def _under(path: tuple[str, ...], fields: tuple[str, ...]) -> bool:
    """Whether a field path lies in (or is) one of the dotted ``fields``."""
    dotted = ".".join(path)
    return bool(path) and any(dotted == f or dotted.startswith(f + ".") for f in fields)


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def _leaves(
    fn: ShaderFunction, type_name: str, key: str, path: tuple, diff: bool, depth: int
) -> list[Leaf] | str:
    shape = value_shape(type_name)
    if shape is not None:
        return [Leaf(key, path, shape[0], shape[1], False, diff)]
    ints = int_shape(type_name)
    if ints is not None:  # int, uint and their vectors (int2 is a vector, not a struct)
        return [Leaf(key, path, ints[0], ints[1], True, False)]
    reflected = None
    if depth < 4:
        try:
            reflected = fn.module.native.layout.find_type_by_name(type_name)
        except Exception:  # not a type this module's reflection can name
            reflected = None
    fields = getattr(reflected, "fields", None) if reflected is not None else None
    if not fields:
        return (
            "only float scalars, vectors and matrices, ints and structs of them are generated "
            "(arrays, resources and other types have no general valid range)"
        )
    differentiable = diff and bool(getattr(reflected, "differentiable", False))
    out: list[Leaf] = []
    for name, var in fields.items():
        got = _leaves(
            fn, var.type.full_name, f"{key}.{name}", path + (name,), differentiable, depth + 1
        )
        if isinstance(got, str):
            return f"field '{name}' ({var.type.full_name}): {got}"
        out += got
    return out
