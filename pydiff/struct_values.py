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
from typing import Any

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
    return convert(label, p, value, device)


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
    if field.tensor or type(v) is Tensor:
        return v  # (a tensor field, or a tensor of the field's type: bound as given)
    if field.fields is not None:
        if type(v) is dict:
            return _fields(label, p, field.fields, v, device, path)
        return v  # (a struct field given otherwise: SlangPy says what it takes)
    as_param = dataclasses.replace(
        p, name=f"{p.name}.{path}", type_name=field.type_name, struct_fields=None
    )
    if type(v) is tuple and len(v) == 2:  # .fwds's (value, tangent) pair: both converted
        pair = tuple(u if type(u) is Tensor else convert(label, as_param, u, device) for u in v)
        return v if all(a is b for a, b in zip(pair, v)) else pair
    return convert(label, as_param, v, device)


def _field_type(p: ParamInfo, path: str) -> str:
    """The Slang type of the field at ``path`` ('q.inner') of struct parameter ``p``."""
    fields, type_name = p.struct_fields, p.type_name
    for name in path.split("."):
        found = next(f for f in fields or () if f.name == name)
        fields, type_name = found.fields, found.type_name
    return type_name
