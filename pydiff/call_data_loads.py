"""The loads of struct (dict) arguments in SlangPy's generated kernels, marked
``[NoDiffThis]`` so that Slang does not warn about SlangPy's own code on the user's console.

For a struct argument given as a dict, SlangPy 0.43 generates a call-data struct whose
``[Differentiable] __slangpy_load`` fills the user's struct field by field; a field given as
a plain number is copied from a member of that call-data struct (``value.b = b;``). The
call-data struct is not differentiable, so Slang 2026 prints, at every backward kernel of
such a call built afresh, "warning[E31159]: no derivative for member on non-differentiable
struct ... consider using [NoDiffThis] on the function '__slangpy_load'". No derivative is
meant there: a number in a dict is a constant (tensor fields bring their own gradient
buffers, loaded through their own methods). ``[NoDiffThis]`` says so, which is all the warning
asks; the kernel is the same. Only these generated loads are marked: Slang still warns about
the user's own methods.

``install()``, run before a device opens, wraps SlangPy's code generation; once.

    >>> call_data_loads.mark_struct_loads(["[Differentiable] void __slangpy_load(ContextND<1> c"])
    ['[Differentiable] [NoDiffThis] void __slangpy_load(ContextND<1> c']
"""

from __future__ import annotations

from typing import Any

# The line SlangPy 0.43's generator emits for a differentiable struct argument's load,
# whole (a load written by a marshal of its own, DiffPair's, is split over lines).
_STRUCT_LOAD = "[Differentiable] void __slangpy_load(ContextND<"
_MARKED = "[Differentiable] [NoDiffThis] void __slangpy_load(ContextND<"


def mark_struct_loads(code: list[str]) -> list[str]:
    """The pieces of a generated call-data block, each struct argument's load marked."""
    return [_MARKED + c[len(_STRUCT_LOAD) :] if c.startswith(_STRUCT_LOAD) else c for c in code]


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

    generate_code.pydiff_marks_struct_loads = True  # type: ignore[attr-defined]
    calldata.generate_code = generate_code
