"""Dtype names: which Slang type a ``dtype=`` means (a Slang name, a NumPy type or name, a
Python type), the default of host data without one, and the NumPy type each scalar type is
uploaded and read as.

    dtype_name(np.int64)        # 'int64_t' (asked for: honoured; int64 data alone is 'int')
    dtype_name("uint8")         # 'uint8_t'
    dtype_name(np.complex64)    # TypeError naming dtype= and the dtypes pydiff stores
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

#: What a Slang type name is made of: 'float3', 'vector<int8_t, 3>', 'float[4]', 'M.Particle'.
_TYPE_NAME = re.compile(r"[A-Za-z_][\w<>,\[\]\s.:]*")

#: The Slang dtype of host data given without ``dtype=`` (by its NumPy dtype).
NUMPY_TO_SLANG = {
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "float",  # Slang has no double atomics: float is the useful default
    np.dtype(np.float16): "half",
    np.dtype(np.int32): "int",
    np.dtype(np.int64): "int",
    np.dtype(np.uint32): "uint",
    np.dtype(np.bool_): "bool",
}
#: The scalar types the call layer converts host values for, and their NumPy types.
SCALAR_NUMPY = {
    "float": np.float32,
    "half": np.float16,
    "double": np.float64,
    "int": np.int32,
    "uint": np.uint32,
    "bool": np.bool_,
    "int64_t": np.int64,
    "uint64_t": np.uint64,
}
#: 8- and 16-bit integer tensors (stored and read back by SlangPy; host values for such a
#: shader parameter are SlangPy's business, not converted by pydiff).
SMALL_INTS = {"int8_t": np.int8, "uint8_t": np.uint8, "int16_t": np.int16, "uint16_t": np.uint16}
#: Every scalar type a tensor holds, and its NumPy type.
SCALAR_TYPES = {**SCALAR_NUMPY, **SMALL_INTS}
# What host data is converted to before an upload: Slang's bool is 4 bytes, NumPy's 1 (SlangPy
# copies NumPy bools byte for byte, so bool tensors got their values packed into element 0).
UPLOAD_NUMPY = {**SCALAR_NUMPY, **SMALL_INTS, "bool": np.uint32}

#: An explicit ``dtype=`` given as a NumPy type: the Slang type of the same width (float64
#: is double and int64 is int64_t when asked for, unlike data's defaults above).
_EXPLICIT = {
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
    np.dtype(np.float16): "half",
    np.dtype(np.int8): "int8_t",
    np.dtype(np.uint8): "uint8_t",
    np.dtype(np.int16): "int16_t",
    np.dtype(np.uint16): "uint16_t",
    np.dtype(np.int32): "int",
    np.dtype(np.uint32): "uint",
    np.dtype(np.int64): "int64_t",
    np.dtype(np.uint64): "uint64_t",
    np.dtype(np.bool_): "bool",
}
#: NumPy's names for them (``dtype="int64"``), which are not Slang names.
_NUMPY_NAMES = {str(k): v for k, v in _EXPLICIT.items() if str(k) != v}
SUPPORTED = (
    "'float', 'half', 'double', 'int', 'uint', 'bool', 'int64_t', 'uint64_t', 'int8_t', "
    "'uint8_t', 'int16_t', 'uint16_t' (or NumPy's types and names of the same width: np.int64, "
    "'float32', ...) and Slang vector, matrix or struct types ('float3')"
)


def dtype_name(dtype: Any) -> str:
    """The Slang type name for a dtype given as a Python type, NumPy dtype or a name; a
    ``TypeError`` naming ``dtype=`` and the dtypes pydiff stores for any other NumPy type."""
    if dtype is float:
        return "float"
    if dtype is int:
        return "int"
    if dtype is bool:
        return "bool"
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        numpy_type = np.dtype(dtype)
        name = _EXPLICIT.get(numpy_type.newbyteorder("="))  # ('>f4': float32 values)
        if name is None:
            raise TypeError(
                f"dtype={numpy_type}: pydiff tensors have no dtype for NumPy's {numpy_type}; "
                f"supported: {SUPPORTED}"
            )
        return name
    if isinstance(dtype, str) and dtype.strip():
        name = dtype.strip()
        if name[0] in "<>=|":  # NumPy's byte-order spellings ('<i8'): SlangPy crashed on them
            try:
                numpy_type = np.dtype(name)
            except TypeError:
                raise TypeError(f"dtype={dtype!r}: not a NumPy or Slang type name") from None
            return dtype_name(numpy_type)
        if not _TYPE_NAME.fullmatch(name):  # ('int(' crashed SlangPy; 'float)' was float)
            raise TypeError(f"dtype={dtype!r}: expected a Slang type name such as 'float'")
        return _NUMPY_NAMES.get(name, name)
    raise TypeError(f"dtype={dtype!r}: expected a Slang type name such as 'float' or 'float3'")


def scalar_of(type_name: str) -> str | None:
    """The scalar type of a scalar, vector or matrix type name ('vector<int8_t,3>' ->
    'int8_t'); None for any other (structs, arrays, generics)."""
    name = type_name.replace(" ", "")
    for prefix in ("vector<", "matrix<"):
        if name.startswith(prefix):
            name = name[len(prefix) :].split(",")[0]
    return name if name in SCALAR_TYPES else None
