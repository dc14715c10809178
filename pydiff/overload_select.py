"""Which overload of a name a call goes to (``module.OverloadedFunction``): the one of as
many parameters as the call has arguments (those named among its later parameters), and,
among several of one arity, the one whose parameters take the tensors given as they are.
SlangPy converts no tensor (a ``float`` tensor never goes to a ``half`` parameter), so that
is the overload it runs; pydiff's own bookkeeping (which arguments the call writes, which
gradient buffers it binds, what a tape records) follows the overload selected here.

Before break48 the first overload of the arity was taken whatever the types: beside
``half k(half a, half x)``, a call of ``void k(float a, inout float x)`` with float tensors
wrote ``x`` in place while pydiff read the other signature (``x`` only read), so ``x``'s
version never moved, and a tape's backward through an earlier call reading ``x`` gave the
gradient at the overwritten values, silently.

    fn = select(overloads, args, kwargs)      # None: no overload of that arity
"""

from __future__ import annotations

import re
from typing import Any

from .signature import ParamInfo
from .tensor import Tensor

_INTEGERS = {"int", "uint", "int64_t", "uint64_t", "int16_t", "uint16_t", "int8_t", "uint8_t"}


def select(overloads: list, args: tuple, kwargs: dict) -> Any:
    """The overload the call goes to, or None where none has its arity; a ``TypeError``
    where overloads take these arguments alike but differ in what the call writes."""
    names = {k for k in kwargs if not k.startswith("_")}
    count = len(args) + len(names)
    fits = [
        fn
        for fn in overloads
        if len(fn.params) == count and names <= {p.name for p in fn.params[len(args) :]}
    ]
    if len(fits) <= 1:
        return fits[0] if fits else None
    scored = [(s, fn) for fn in fits if (s := _fit(fn.params, args, kwargs)) is not None]
    best = max((s for s, _ in scored), default=None)
    top = [fn for s, fn in scored if s == best] or fits
    if len(top) > 1:
        _refuse_unclear_writes(top)
    return top[0]


def _fit(params: list[ParamInfo], args: tuple, kwargs: dict) -> int | None:
    """How exactly ``params`` take the tensors given (2 each of their own element type, 1 a
    float tensor spelling out a vector's components); None: a tensor of another element
    type (SlangPy would not convert it), or a float at an integer parameter."""
    score = 0
    for j, p in enumerate(params):
        v = args[j] if j < len(args) else kwargs.get(p.name)
        if type(v) is float and p.type_name in _INTEGERS:
            return None
        if type(v) is not Tensor or p.generic:
            continue
        dtype = v.dtype
        if p.tensor_kind is not None:  # (IDiffTensor<half, 1>: its element type)
            element = re.search(r"<\s*([\w:]+)", p.type_name)
            if element is None or element.group(1) != dtype:
                return None
            score += 2
        elif p.type_name == dtype:
            score += 2
        elif dtype == "float" and re.fullmatch(r"(float[234])|(vector<float,\s*\d>)", p.type_name):
            score += 1  # a float (n, 3) tensor at a float3: as SlangPy takes it too
        else:
            return None
    return score


def _refuse_unclear_writes(candidates: list) -> None:
    """Overloads the arguments fit alike are picked by SlangPy's own rules (numbers, host
    arrays): where they differ in what the call writes, pydiff's checks would follow a
    signature SlangPy may not run."""
    first = candidates[0]
    for j, p in enumerate(first.params):
        kinds = {(fn.params[j].io, fn.params[j].access) for fn in candidates}
        if len(kinds) > 1:
            listing = "; ".join(str(fn.signature) for fn in candidates)
            raise TypeError(
                f"{first.label}: overloads of one arity take these arguments alike ({listing}) "
                f"but differ in whether the call writes parameter {j} ('{p.name}'): SlangPy "
                "picks between them by rules pydiff does not repeat, and pydiff's checks "
                "(versions, tapes, gradients) must follow the one that runs. Pass tensors of "
                "the element type of the overload you mean, or give the overloads names of "
                "their own"
            )
