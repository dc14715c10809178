"""The (value, tangent) result of ``fn.fwds`` as two contiguous tensors.

The generated forward-mode wrapper module holds two entry points: ``f__pydiff_fwd`` returns
``R[2]`` (SlangPy allocates the pair, of the call's shape, whatever the arguments are), and
``f__pydiff_fwd_out`` writes the value and the tangent into two ``out R`` tensors. Where
pydiff can tell the call's shape before the call (``direct_shape``: inputs only, each a
number or a tensor of the parameter's type, all of one shape), ``direct_pair`` allocates
the two results and runs the ``_out`` entry point: one SlangPy call. Elsewhere the pair
comes back as ``R[2]`` and ``split_pair`` copies it into two tensors on the device.

    source += out_entry(name, ret, params, body)      # in the wrapper's source
    pair = direct_pair(wrapper, fn, bound, call_args, ret)   # None: the R[2] path
    with wrapper_calls(wrapper, fn): ...               # the wrapper's calls, named as fn.fwds
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

from .call_shape import ElementAxesError, argument_shape
from .forward_args import NO_TANGENT, given
from .forward_call import forward_call
from .generated_switch import uncounted
from .signature import FunctionTarget
from .storage import allocate
from .tape import suspend_recording
from .tensor import Tensor


def out_entry(name: str, ret: str, params: list[str], pre: list[str], call: str, post: list) -> str:
    """The Slang source of ``void <name>_out(params..., out R __pydiff_p, out R __pydiff_d)``
    (its value and tangent into two outputs) and ``void <name>_split(R __pydiff_o[2], out R
    __pydiff_p, out R __pydiff_d)``. (Named apart from parameters: ``__p`` clashed with a
    parameter ``__p``.)"""
    p, d, r, o = "__pydiff_p", "__pydiff_d", "__pydiff_r", "__pydiff_o"
    body = [*pre, f"let {r} = {call};", *post, f"{p} = {r}.p;", f"{d} = {r}.d;"]
    return (
        f"void {name}_out({', '.join([*params, f'out {ret} {p}', f'out {ret} {d}'])})\n{{\n    "
        + "\n    ".join(body)
        + "\n}\n"
        + f"void {name}_split({ret} {o}[2], out {ret} {p}, out {ret} {d})\n{{\n"
        f"    {p} = {o}[0];\n    {d} = {o}[1];\n}}\n"
    )


def direct_shape(bound: list, call_args: list, types: dict[str, str]) -> tuple | None:
    """The call's shape where pydiff can tell it before the call: every parameter an ``in``
    value (no tensor parameter types), every argument (tangents included) a Python number or
    a pydiff tensor of the parameter's type whose shape covers the call, the tensors all of
    one shape of one or more axes, none of them 0; None elsewhere."""
    shape: tuple | None = None
    it = iter(call_args)
    for p, _ in bound:
        if p.io != "in" or p.tensor_kind is not None:
            return None
        type_name = types.get(p.type_name, p.type_name)
        for value in [next(it, None)] + ([next(it, None)] if p.differentiable else []):
            if type(value) in (float, int) or value is NO_TANGENT:
                continue
            if type(value) is not Tensor:
                return None
            try:
                covered = argument_shape(type_name, value)
            except ElementAxesError:
                return None
            if covered is None or covered != tuple(value.shape) or not covered:
                return None
            if shape is not None and covered != shape:
                return None
            shape = covered
    if next(it, None) is not None or not shape or 0 in shape:
        return None
    return shape


def direct_pair(
    wrapper: FunctionTarget, bound: list, call_args: list, ret: str, types: dict[str, str]
) -> tuple[Tensor, Tensor] | None:
    """The value and tangent in one call of the wrapper's ``_out`` entry point, into two new
    contiguous tensors (``direct_shape``); None where the call's shape is not known here."""
    shape = direct_shape(bound, call_args, types)
    if shape is None:
        return None
    dev = next(v for v in call_args if type(v) is Tensor).device
    element = wrapper.module.native.layout.find_type_by_name(ret)
    primal = Tensor(allocate(dev, shape, element), dev)
    tangent = Tensor(allocate(dev, shape, element), dev)
    entry = getattr(wrapper.module, f"{wrapper.name}_out")
    with suspend_recording(), uncounted():  # (the .fwds is counted once, by call_fwds)
        forward_call(entry, (*given(call_args), primal, tangent), {})
    return primal, tangent


def split_pair(result: Tensor, type_name: str, wrapper: FunctionTarget) -> tuple[Tensor, Tensor]:
    """A tensor of R[2] elements split into two new contiguous tensors of R, primal and
    tangent, by the wrapper module's ``_split`` function (on the device, no host round trip).
    (Every other pydiff tensor is contiguous: the strided views of the pair returned before
    failed in ``ops.sum``, ``softmax``, ``matmul``, ``reshape``, ... with "not contiguous",
    where the generated kernels' results, from 4096 elements, worked.)"""
    element = wrapper.module.native.layout.find_type_by_name(type_name)
    dev = result.device
    primal = Tensor(allocate(dev, result.shape, element), dev)
    tangent = Tensor(allocate(dev, result.shape, element), dev)
    with suspend_recording(), uncounted():
        getattr(wrapper.module, f"{wrapper.name}_split")(result, primal, tangent)
    return primal, tangent


@contextmanager
def wrapper_calls(wrapper: FunctionTarget, fn: FunctionTarget) -> Iterator[None]:
    """Calls of ``fn``'s forward-mode ``wrapper`` (its entry points too): off the tape, not
    counted again in ``generated.stats()`` (the ``.fwds`` was), and a ``TypeError`` or
    ``ValueError`` they raise names ``fn.fwds`` and its parameters, not the wrapper: a refused
    NumPy (value, tangent) pair read ``pydiff_fwd_c10_f_684e9109cde0.f__pydiff_fwd_c10:
    parameter 'x__t' ...``, now ``m.f.fwds: parameter 'x' (tangent) ...``."""
    with suspend_recording(), uncounted():
        try:
            yield
        except (TypeError, ValueError) as exc:
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (_relabelled(exc.args[0], wrapper, fn), *exc.args[1:])
            raise


def _relabelled(text: str, wrapper: FunctionTarget, fn: FunctionTarget) -> str:
    text = re.sub(re.escape(wrapper.module.name) + r"\.\w+", f"{fn.label}.fwds", text)
    names, value = {p.name for p in fn.params}, None
    for p in wrapper.params:  # a tangent follows its value (fwd_wrapper): x, x__t
        if p.name in names:
            value = p.name
        elif value is not None:
            text = text.replace(f"'{p.name}'", f"'{value}' (tangent)")
    return text
