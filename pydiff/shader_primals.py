"""The arguments of the transforms of one module function (``pydiff.jvp(m.f, ...)``, ``vjp``,
``hvp``, ``hessian``) that need the function's parameters to be read right: torch primals
(taken as Python functions' are), one host array for an array parameter, double parameters
(no gradient buffers), the tensors a void function writes (its outputs).

    primals = torch_primals("hvp", f, primals, v)     # torch data held fixed, or refused
    x = one_array(p, [1.0, 2.0, 3.0])                 # (1, 3) for a float[3] parameter
    takes_grads(p)                                    # False for a double parameter
    call = void_outputs(f, primals)                   # None unless f returns void
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import foreign
from .call_shape import value_elements
from .forward_program import held_primal
from .module import ShaderFunction
from .tensor import Tensor


def takes_grads(p: Any) -> bool:
    """A differentiable parameter a gradient buffer can serve: not a double one (SlangPy
    has no double gradient buffers, "cannot have gradient buffers": held fixed, as an int)."""
    found = value_elements(p.type_name)
    return p.differentiable and not (found is not None and found[0] == "double")


def one_array(p: Any, x: Any) -> Any:
    """A host value given for one array parameter (``float a[3]`` and ``[1, 2, 3]``) with the
    call axis SlangPy's tensor binding needs, ``(1, 3)``, as ``.fwds`` and ``jvp`` take it
    (the gradient comes back in the shape given); any other value as it is."""
    found = value_elements(p.type_name) if p is not None else None
    if found is None or not found[2] or isinstance(x, Tensor) or foreign.framework(x):
        return x
    arr = np.asarray(x)
    return arr.reshape((1, *arr.shape)) if arr.shape == found[1] else x


def torch_primals(what: str, f: ShaderFunction, primals: tuple, dirs: Any) -> tuple:
    """Torch primals of a module function taken as a Python function's are (and as ``vjp``
    refuses them): one with a direction (any at a differentiable parameter of ``hessian``,
    which would otherwise differentiate it without a word) is refused by name; one without
    is a pydiff tensor of its values, held fixed (one that requires grad refused)."""
    out = list(primals)
    for k, x in enumerate(primals):
        name = foreign.framework(x)
        if name is None:
            continue
        p = f.params[k] if k < len(f.params) else None
        at = f" ('{p.name}' of {f.label})" if p is not None else ""
        given = dirs is not None and k < len(dirs) and dirs[k] is not None
        if given or (dirs is None and p is not None and p.differentiable):
            how = "give it a direction" if dirs is not None else "differentiate it"
            raise TypeError(
                f"{what}: primal {k}{at} is a {name} tensor; {what} differentiates pydiff "
                f"tensors, NumPy arrays, lists and numbers: pass pydiff.from_torch(t) to {how}, "
                f"or {'None as its direction' if dirs is not None else 'close over it'} to "
                "hold it fixed"
            )
        out[k] = held_primal(x, what, k)
    return tuple(out)


def void_outputs(f: ShaderFunction, primals: tuple) -> Callable[..., Any] | None:
    """For a function returning void, the call whose outputs are the tensors it writes (its
    ``out`` parameters; one: that tensor), as ``jvp`` returns them; None for the others.
    Before, vjp said "fn returned a NoneType". An ``inout`` one is refused: write a Python
    function reading and returning fresh tensors."""
    if f.signature.return_type != "void":
        return None
    written = [k for k, p in enumerate(f.params) if p.writes_value]
    for k in written:
        p = f.params[k]
        if p.io != "out" or k >= len(primals) or not isinstance(primals[k], Tensor):
            raise TypeError(
                f"vjp: {f.label} returns void and writes '{p.name}' ({p.io}); vjp takes the "
                "tensors given to its out parameters as its outputs: give a pydiff tensor there, "
                "or differentiate a Python function returning what it writes"
            )
    if not written:
        raise TypeError(
            f"vjp: {f.label} returns void and writes no tensor: nothing to differentiate"
        )

    def call(*a: Any) -> Any:
        f(*a)
        outs = tuple(a[k] for k in written)
        return outs[0] if len(outs) == 1 else outs

    return call


def check_arity(what: str, f: ShaderFunction, primals: tuple) -> None:
    """One primal per parameter of ``f``: a TypeError naming them (before, ``hvp`` left extra
    primals out without a word and ``hessian`` named the generated wrapper's parameters)."""
    if len(primals) != len(f.params):
        names = ", ".join(p.name for p in f.params)
        raise TypeError(
            f"{what}: {f.label} takes {len(f.params)} argument(s) ({names}); got "
            f"{len(primals)} primal(s)"
        )
