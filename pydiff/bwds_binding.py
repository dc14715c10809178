"""Binding every argument of a ``.bwds`` on the general path (``backward_call``), all or nothing.

The zeroing policy acts on each gradient buffer as its parameter is bound
(``scope.before_accumulate``): under RESET a buffer is zeroed before a later argument may
be refused (a tensor on another device, a gradient of the wrong shape, a raw SlangPy tensor,
a ``_result`` of the wrong kind). The buffers it zeroed are kept first (``GradSnapshot``,
made by the binding object ``b`` when RESET acts: ``grad_restore.resets``), and a refusal
puts them back before it raises: a refused call leaves every gradient as it was.

    bind_all(b, bound, native_kwargs, use_wrapper, options, result)
"""

from __future__ import annotations

from typing import Any

import slangpy as spy

from .arguments import MISSING, PLAIN
from .call_shape import result_type
from .struct_grads import bind_struct
from .tensor import Tensor


def bind_all(
    b: Any, bound: list, native_kwargs: dict, use_wrapper: bool, options: dict, result: Any
) -> None:
    """The native arguments of every parameter and of ``_result`` (into ``native_kwargs``
    and ``options``), the policy acting on each gradient buffer as it is bound; a refusal
    puts back every buffer it zeroed (RESET: ``b.kept``) before it raises."""
    try:
        _bind_each(b, bound, native_kwargs, use_wrapper)
        native_result = b.result_arg(result, result_type(b.fn, bound))  # generic T: its type
    except BaseException:
        if b.kept is not None:
            b.kept.restore()
        raise
    if native_result is not MISSING:
        options["_result"] = native_result


def _bind_each(b: Any, bound: list, native_kwargs: dict, use_wrapper: bool) -> None:
    for p, value in bound:
        if use_wrapper and p.io == "inout":
            native_kwargs.update(b.inout_args(p, value))
        elif p.tensor_kind == "fwd" and isinstance(value, Tensor):
            native_kwargs[p.name] = b.fwd_arg(p, value)
        elif isinstance(value, Tensor):
            native_kwargs[p.name] = b.tensor_arg(p, value)
        elif type(value) in PLAIN:
            native_kwargs[p.name] = value
        elif isinstance(value, spy.Tensor):
            raise TypeError(
                f"{b.label}.bwds: parameter '{p.name}' is a raw slangpy.Tensor; pass a "
                "pydiff.Tensor (pydiff.tensor(...)) so pydiff can bind its gradient buffers"
            )
        else:
            native_kwargs[p.name] = bind_struct(b, p, value)
