"""The Slang helpers pydiff's generated elementwise kernels call (float4 loads and stores, a
float4 ``select``, the add that is not fused), in modules of their own that import nothing
of the user's.

A generated kernel imports the user's module to call its function, and with it every
overload that module declares: a ``float4 asfloat(uint4)`` or ``select(bool4, float4,
float4)`` of the user's is a better match than the core module's generic one, and a kernel
calling them itself ran the user's (``m.f(2.0, x)`` gave 14 everywhere, not 2x: forward,
``.bwds`` and ``.fwds``, while SlangPy's path was right). Compiled in these modules, the
helpers' calls see only the core module; the kernels call them by ``pydiff_`` names.

    source = prepare(dev, make())   # the helper modules its imports name, loaded first
    reason = left_to_slangpy(fn)    # "overloaded", ...: None where a kernel may call fn
"""

from __future__ import annotations

import re
from typing import Any

from . import kernel_sources, lint
from .lint_nodiff import own_name
from .signature import FunctionTarget, overloaded

#: Loads (the typed form reads words: see generated_source), a float4 select, and the add of
#: a partial through an integer op the compiler cannot fold (``zero`` is 0), so that it is
#: not fused with the partial's last product (an fma rounds once where SlangPy's path,
#: adding into memory, rounds twice).
_COMMON = (
    "float4 pydiff_select4(bool4 c, float4 a, float4 b) { return select(c, a, b); }\n"
    "float4 pydiff_apart(float4 d, uint zero) { return asfloat(asuint(d) ^ zero); }\n"
    "float pydiff_apart(float d, uint zero) { return asfloat(asuint(d) ^ zero); }\n"
)
_TYPED = "float4 pydiff_load4(Buffer<uint4> b, uint i) { return asfloat(b[i]); }\n"
_STRUCTURED = "float4 pydiff_load4(StructuredBuffer<float4> b, uint i) { return b[i]; }\n"
# Two 64-bit words per float4, as the paired form stores them: the backward kernels' loads on
# lavapipe (generated_source), an overload beside the form's own.
_WORDS = (
    "float4 pydiff_load4(StructuredBuffer<uint64_t2> b, uint i)\n{\n    uint64_t2 a = b[i];\n"
    "    return asfloat(uint4(uint(a.x), uint(a.x >> 32), uint(a.y), uint(a.y >> 32)));\n}\n"
)
_STORE = "void pydiff_store4(RWStructuredBuffer<float4> b, uint i, float4 v) { b[i] = v; }\n"
# Two 64-bit words per float4 (kernels.float4_out_source's paired form): bit for bit.
_PAIRED = (
    "void pydiff_store4(RWStructuredBuffer<uint64_t2> b, uint i, float4 v)\n{\n"
    "    uint4 u = asuint(v);\n"
    "    b[i] = uint64_t2(uint64_t(u.x) | (uint64_t(u.y) << 32), "
    "uint64_t(u.z) | (uint64_t(u.w) << 32));\n}\n"
)
#: Each helper module by name: a kernel imports the common one, and for float4 loads and
#: stores the one of its device's forms (typed loads: t1; paired stores: p1).
SOURCES = {
    "pydiff_gen_helpers": _COMMON,
    "pydiff_gen_helpers_t0p0": _STRUCTURED + _STORE,
    "pydiff_gen_helpers_t1p0": _TYPED + _STORE,
    "pydiff_gen_helpers_t0p1": _STRUCTURED + _PAIRED,
    "pydiff_gen_helpers_t1p1": _TYPED + _PAIRED,
    "pydiff_gen_helpers_w64": _WORDS,
}
_IMPORT = re.compile(r"^import (pydiff_gen_helpers\w*);$", re.M)


def imports(typed: bool | None = None, paired: bool = False, words: bool = False) -> str:
    """The import lines of a generated kernel's source: the common helpers, and with
    ``typed`` given the float4 loads and stores of that form; ``words``: loads of two 64-bit
    words per float4 too."""
    lines = "import pydiff_gen_helpers;\n"
    if typed is not None:
        lines += f"import pydiff_gen_helpers_t{int(typed)}p{int(paired)};\n"
    return lines + ("import pydiff_gen_helpers_w64;\n" if words else "")


def prepare(dev: Any, source: str) -> str:
    """``source``, after loading on ``dev`` (once) each helper module it imports."""
    for name in _IMPORT.findall(source):
        dev.cached(("pydiff.generated helpers", name), lambda: _load(dev, name))
    return source


def _load(dev: Any, name: str) -> Any:
    return kernel_sources.load_source_module(dev.native, name, SOURCES[name])


def left_to_slangpy(fn: FunctionTarget, elementwise: bool = False) -> str | None:
    """Why no generated kernel (elementwise, vector or grid) may call ``fn``, whatever the
    call: trap findings, overloads (SlangPy picks one by the values), or thread state in its
    module (mutable statics, which a kernel running several elements per thread would carry
    from one element to the next; SlangPy's call id: lint_statics); with ``elementwise``
    (the kernels running eight elements per thread, and ``fn`` on the last float4's spare
    lanes) also cross-lane code and side effects (wave intrinsics, groupshared, atomics,
    printf: lint_lanes; the vector and grid kernels map elements to lanes as SlangPy's do).
    None: it may."""
    if lint.refusing(fn.module.traps.get(fn.name)):  # (forward mode's alone: refused there)
        return "trap findings"
    state = getattr(fn.module, "thread_state", None)  # (modules pydiff scanned)
    if state:
        return f"thread state in the module: '{state[0]}'"
    effects = getattr(fn.module, "lane_effects", None)
    if elementwise and effects and (found := effects.get(own_name(fn.name))) is not None:
        return f"{found[0]}: {found[1]}"
    return "overloaded" if overloaded(fn) else None
