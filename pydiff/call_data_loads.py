"""Two touches to SlangPy 0.43's generated kernels, so that Slang prints no warning about
SlangPy's own code on the user's console; each kernel computes what it computed before.

**Struct loads.** For a struct argument given as a dict, SlangPy generates a call-data struct
whose ``[Differentiable] __slangpy_load`` fills the user's struct field by field; a field
given as a plain number is copied from a member of that call-data struct (``value.b = b;``).
The call-data struct is not differentiable, so Slang 2026 prints, at every backward kernel of
such a call built afresh, "warning[E31159]: no derivative for member on non-differentiable
struct ... consider using [NoDiffThis] on the function '__slangpy_load'". No derivative is
meant there: a number in a dict is a constant (tensor fields bring their own gradient
buffers, loaded through their own methods). ``[NoDiffThis]`` says so, which is all the warning
asks; the kernel is the same. Only these generated loads are marked: Slang still warns about
the user's own methods.

**A narrower result.** A forward call of a ``float`` function off a tape may write into a
``half`` ``_result`` (a tensor or a float16 NumPy array), as torch's ``out=`` narrows. SlangPy
stores the float value into the half tensor by an implicit conversion, and Slang prints
"warning[E30081]: implicit conversion from 'float' to 'half' is not recommended" at the
store. The conversion is meant: the store is made an explicit one (``half(v)``, the same
rounding), and no warning prints. (Where the result gets gradients, ``.bwds`` and a tape
refuse a narrower ``_result`` before SlangPy sees it: ``bwds_checks.refuse_narrowed_result``.)

``install()``, run before a device opens, wraps SlangPy's code generation; once.

    >>> call_data_loads.mark_struct_loads(["[Differentiable] void __slangpy_load(ContextND<1> c"])
    ['[Differentiable] [NoDiffThis] void __slangpy_load(ContextND<1> c']
    >>> call_data_loads.store_type("vector<float,3>", "half")
    'vector<half,3>'
"""

from __future__ import annotations

import re
from typing import Any

# The line SlangPy 0.43's generator emits for a differentiable struct argument's load,
# whole (a load written by a marshal of its own, DiffPair's, is split over lines).
_STRUCT_LOAD = "[Differentiable] void __slangpy_load(ContextND<"
_MARKED = "[Differentiable] [NoDiffThis] void __slangpy_load(ContextND<"

# The result's store in the kernel body: `_result.__slangpy_store(<context>, __tmp__result)`
# (`call_data._result` where the call data is a struct).
_RESULT_STORE = re.compile(r"^(\s*(?:\w+\.)?_result\.__slangpy_store\(.*, )(__tmp__result)\)$")
_FLOATS = ("half", "float", "double")
_BASE = re.compile(r"^(?:(?:vector|matrix)<\s*)?(\w+)")


def mark_struct_loads(code: list[str]) -> list[str]:
    """The pieces of a generated call-data block, each struct argument's load marked."""
    return [_MARKED + c[len(_STRUCT_LOAD) :] if c.startswith(_STRUCT_LOAD) else c for c in code]


def store_type(value_type: str, element_type: str) -> str | None:
    """The type a result tensor (or array) of ``element_type`` stores a ``value_type`` as,
    where both are floating-point and differ in their scalar only (a ``float3`` value into
    ``half`` elements of a last axis of 3: ``vector<half,3>``); None otherwise."""
    value, element = _BASE.match(value_type), _BASE.match(element_type)
    if value is None or element is None:
        return None
    a, b = value.group(1), element.group(1)
    if a == b or a not in _FLOATS or b not in _FLOATS:
        return None
    return value_type[: value.start(1)] + b + value_type[value.end(1) :]


def cast_result_store(code: list[str], value_type: str, element_type: str) -> list[str]:
    """The pieces of a kernel body, the result's store made an explicit conversion where
    the result's elements are of another float type than the function's value."""
    target = store_type(value_type, element_type)
    if target is None:
        return code
    return [_RESULT_STORE.sub(rf"\g<1>{target}(\g<2>))", c) for c in code]


def install() -> None:
    """Wrap SlangPy's kernel code generation (see the module's docstring); once."""
    from slangpy.core import calldata

    slangpys = calldata.generate_code
    if getattr(slangpys, "pydiff_marks_struct_loads", False):
        return

    def generate_code(context: Any, build_info: Any, bindings: Any, codegen: Any) -> None:
        slangpys(context, build_info, bindings, codegen)
        block = codegen.call_data_structs
        block.code = mark_struct_loads(block.code)
        result = bindings.kwargs.get("_result")
        element = getattr(getattr(result, "python", None), "slang_element_type", None)
        if result is not None and result.vector_type is not None and element is not None:
            kernel = codegen.kernel
            kernel.code = cast_result_store(
                kernel.code, result.vector_type.full_name, element.full_name
            )

    generate_code.pydiff_marks_struct_loads = True  # type: ignore[attr-defined]
    calldata.generate_code = generate_code
