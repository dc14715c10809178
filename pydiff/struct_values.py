"""Struct (dict) arguments: each field checked against the struct's reflected fields and its
value converted as an argument of the field's type is (``host_values``), so that a struct
field takes what a parameter of its type takes.

SlangPy binds a dict's fields as they are: a float64 NumPy array for a ``float`` field fails
in Slang's compiler ("argument must be l-value"), a bool or 1e39 for one passes as 1.0 or
inf, a float for an ``int`` field is a C++ ``bad_cast``, a misspelt field is SlangPy's
report, and a field left out is silently zero (not the struct's Slang default). Here they
are converted, or refused naming the function, the parameter and the field:

    m.f({"a": np.array([0.5, 1.0]), "b": [0.0, 1.0, 0.0]}, x)  # 'a' (float): float64 -> float32
    m.f({"a": 1.0, "bb": [0.0, 1.0, 0.0]}, x)   # TypeError: parameter 'p' (P) has no field 'bb'
    m.f({"a": 1.0}, x)                          # TypeError: ... is missing field 'b'
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from types import SimpleNamespace
from typing import Any

import numpy as np

from .call_shape import check_tensor_type
from .host_values import convert
from .signature import FieldInfo, ParamInfo
from .tensor import Tensor


def convert_value(label: str, p: ParamInfo, value: Any, device: Any) -> Any:
    """``value`` for parameter ``p`` of the function ``label``: a dict for a struct parameter
    checked and converted field by field (the same dict when nothing changes), any other
    value as ``host_values.convert`` converts it.

    >>> convert_value("m.f", p, {"a": np.float64(2.0), "b": [0.0, 1.0, 0.0]}, dev)
    {'a': 2.0, 'b': [0.0, 1.0, 0.0]}
    """
    if type(value) is dict and p.struct_fields is not None:
        return _fields(label, p, p.struct_fields, value, device, "")
    if p.struct_fields is not None and (value is None or isinstance(value, _NUMBERS)):
        raise TypeError(
            f"{label}: parameter '{p.name}' ({p.type_name}) is a struct, but got "
            f"{value!r}; {_give_dict(p.struct_fields)}"
        )
    return convert(label, p, value, device)


_NUMBERS = (bool, int, float, complex, np.generic)


def _give_dict(fields: tuple[FieldInfo, ...]) -> str:
    names = sorted(f.name for f in fields)
    return f"give a dict of its fields, {{{', '.join(f'{n!r}: ...' for n in names)}}}"


def _struct_name(p: ParamInfo, path: str, type_name: str) -> str:
    if not path:
        return f"parameter '{p.name}' ({p.type_name})"
    return f"parameter '{p.name}', field '{path}' ({type_name})"


def _fields(
    label: str, p: ParamInfo, fields: tuple[FieldInfo, ...], value: dict, device: Any, path: str
) -> dict:
    by_name = {f.name: f for f in fields}
    type_name = p.type_name if not path else _field_type(p, path)
    where = f"{label}: {_struct_name(p, path, type_name)}"
    for key in value:
        if isinstance(key, str) and key.startswith("_"):
            continue  # SlangPy's own keys ('_type')
        if key not in by_name:
            close = difflib.get_close_matches(str(key), list(by_name), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise TypeError(
                f"{where} has no field {key!r}{hint} (its fields: "
                f"{', '.join(sorted(by_name)) or 'none'})"
            )
    missing = sorted(name for name in by_name if name not in value)
    if missing:
        raise TypeError(
            f"{where} is missing field(s) {', '.join(repr(m) for m in missing)}: give every "
            "field (SlangPy would fill a missing one with zeros, not with its Slang default)"
        )
    out = None
    for key, v in value.items():
        field = by_name.get(key)
        if field is None:
            continue
        new = _field(label, p, field, v, device, f"{path}.{key}" if path else key)
        if new is not v:
            out = dict(value) if out is None else out
            out[key] = new
    return value if out is None else out


def _field(label: str, p: ParamInfo, field: FieldInfo, v: Any, device: Any, path: str) -> Any:
    where = f"{label}: parameter '{p.name}', field '{path}' ({field.type_name})"
    if v is None:
        raise TypeError(f"{where} got None; give it a value of its type")
    if field.tensor:
        return _tensor_field(where, field, v)
    if field.fields is not None:
        if type(v) is dict:
            return _fields(label, p, field.fields, v, device, path)
        if type(v) is Tensor and _same_type(v.element_type.full_name, field.type_name):
            return v  # a tensor of these structs, vectorised over
        if type(v) is tuple and len(v) == 2:
            return v  # .fwds's (value, tangent) pair of a struct: forward_args splits it
        got = f"a {v.dtype} tensor" if type(v) is Tensor else f"a {type(v).__name__}"
        raise TypeError(f"{where} is a struct, but got {got}; {_give_dict(field.fields)}")
    as_param = dataclasses.replace(
        p, name=f"{p.name}.{path}", type_name=field.type_name, struct_fields=None
    )
    if type(v) is Tensor:
        check_tensor_type(SimpleNamespace(label=label), as_param, v)
        return v  # (a tensor of the field's type: bound as given)
    if type(v) is tuple and len(v) == 2:  # .fwds's (value, tangent) pair: both converted
        pair = tuple(u if type(u) is Tensor else convert(label, as_param, u, device) for u in v)
        return v if all(a is b for a, b in zip(pair, v)) else pair
    return convert(label, as_param, v, device)


_TENSOR_TYPE = re.compile(r"Tensor<\s*([\w:]+)\s*,\s*(\d+)\s*>$")


def _same_type(a: str, b: str) -> bool:
    return a.replace(" ", "") == b.replace(" ", "")


def _tensor_field(where: str, field: FieldInfo, v: Any) -> Any:
    """A tensor field (``DiffTensor<float, 1>``...) takes a pydiff tensor of its element
    type and number of dimensions; Slang's compiler would report anything else (E30047)."""
    found = _TENSOR_TYPE.search(field.type_name)
    if type(v) is not Tensor:
        if type(v).__name__ == "Tensor" or found is None:
            return v  # (a raw SlangPy tensor: .bwds names it; a type pydiff cannot read)
        raise TypeError(
            f"{where} is a tensor field, but got a {type(v).__name__}; give a pydiff tensor "
            f"of {found.group(1)} with {found.group(2)} dimension(s) (pydiff.tensor(...))"
        )
    if found is None:
        return v
    element, dims = found.group(1), int(found.group(2))
    if not _same_type(v.element_type.full_name, element) or len(v.shape) != dims:
        raise TypeError(
            f"{where} takes a tensor of {element} with {dims} dimension(s), but got dtype "
            f"{v.dtype} and shape {v.shape}; convert it first (pydiff.tensor(x.numpy()"
            f".astype(...)) or .astype({element!r})) or reshape it"
        )
    return v


def _field_type(p: ParamInfo, path: str) -> str:
    """The Slang type of the field at ``path`` ('q.inner') of struct parameter ``p``."""
    fields, type_name = p.struct_fields, p.type_name
    for name in path.split("."):
        found = next(f for f in fields or () if f.name == name)
        fields, type_name = found.fields, found.type_name
    return type_name


def field_tensors(p: ParamInfo, value: Any, path: str = "") -> list[tuple[str, Tensor]]:
    """The pydiff tensors in a struct argument (a dict, nested for nested structs) with the
    dotted path of the field each sits in ('a', 'inner.t'; a list's elements share its
    field's path), in the order ``arguments.nested_tensors`` finds them.

    >>> field_tensors(p, {"a": a, "inner": {"t": t}, "s": 2.0})
    [('a', a), ('inner.t', t)]
    """
    if type(value) is Tensor:
        return [(path, value)] if path else []
    if isinstance(value, dict):
        return [
            found
            for key, v in value.items()
            for found in field_tensors(p, v, f"{path}.{key}" if path else str(key))
        ]
    if isinstance(value, (list, tuple)) and path:
        return [found for v in value for found in field_tensors(p, v, path)]
    return []


def read_tensors(p: ParamInfo, value: Any, kept: Any) -> list[tuple[str, Tensor, Any]]:
    """The tensors an argument read gives: itself as ``(p.name, value, kept)``, or each one in
    a struct's fields as ``('p.inner.a', tensor, its copy in kept)``; ``kept`` is the copy
    the forward call took before it overwrote them (the argument's shape), or None.

    >>> read_tensors(p, {"a": a, "b": 0.0}, None)
    [('p.a', a, None)]
    """
    if type(value) is Tensor:
        return [(p.name, value, kept)]
    found = field_tensors(p, value)
    copies = [t for _, t in field_tensors(p, kept)] if kept is not None else []
    if len(copies) != len(found):
        copies = [None] * len(found)
    return [(f"{p.name}.{path}", t, c) for (path, t), c in zip(found, copies)]
