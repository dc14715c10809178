"""The (primal, tangent) of each argument of ``fn.fwds``: tensors carry their own tangent,
``(value, tangent)`` pairs give one (as a whole argument, or as a struct field's value),
struct (dict) arguments get a dict of their fields' tangents, and a tangent given where no
derivative flows is said (a ``GradientFlowWarning``).

    primal, tangent = primal_and_tangent(fn, p, {"a": (2.0, 1.0), "b": t.with_tangent(u)})
    # primal {"a": 2.0, "b": t}, tangent {"a": 1.0, "b": t.tangent}
"""

from __future__ import annotations

from typing import Any

import numpy as np
import slangpy as spy

from .arguments import check_device, nested_tensors, scratch
from .creation import zeros as new_zeros
from .errors import warn_once
from .signature import FunctionTarget, ParamInfo
from .tape import active_tape
from .tensor import Tensor


def is_pair(value: Any) -> bool:
    """A ``(value, tangent)`` pair: a 2-tuple (vector values are ``spy.float3`` or arrays).

    >>> is_pair((2.0, 1.0)), is_pair(spy.float2(2.0, 1.0))
    (True, False)
    """
    return isinstance(value, tuple) and len(value) == 2


def zero_like(value: Any) -> Any:
    """The zero tangent of a value held fixed (a number, array or SlangPy vector).

    >>> zero_like(2.0), zero_like(np.ones(3))
    (0.0, array([0., 0., 0.], dtype=float32))
    """
    if isinstance(value, (float, int)) and not isinstance(value, bool):
        return 0.0
    if isinstance(value, (np.ndarray, list, tuple)):
        return np.zeros(np.shape(value), dtype=np.float32)
    return value * 0.0  # slangpy vector/matrix values


def tangent_tensor(t: Tensor) -> Tensor:
    """``t``'s tangent, zeros given to it first where it has none (out/inout arguments).

    >>> tangent_tensor(y)     # y.tangent, now zeros if y had none
    """
    if t.tangent is None:
        zero = spy.Tensor.zeros(t.device.native, t.native.shape, t.native.dtype)
        zero = Tensor(zero if t.shape else zero.view(()), t.device)
        t.with_tangent(zero)
    return t.tangent


def gives_tangent(value: Any) -> bool:
    """Whether ``value`` gives a tangent anywhere inside: a struct field's (value, tangent)
    pair, or a tensor carrying one (a whole argument's pair is the caller's to see).

    >>> gives_tangent({"a": (2.0, 1.0), "b": 3.0})
    True
    """
    if isinstance(value, dict):
        return any(is_pair(v) or gives_tangent(v) for v in value.values())
    return any(t.tangent is not None for t in nested_tensors(value))


def primals_only(value: Any) -> Any:
    """``value`` with each (value, tangent) pair in its fields as its value (the tangents of
    a struct without derivatives, dropped once said).

    >>> primals_only({"a": (2.0, 1.0), "b": 3.0})
    {'a': 2.0, 'b': 3.0}
    """
    if isinstance(value, dict):
        return {k: v[0] if is_pair(v) else primals_only(v) for k, v in value.items()}
    return value


#: The tangent slot of a differentiable input given no tangent at all (``input_pair``): the
#: wrapper takes no tangent for it and passes Slang a literal zero (``diffPair(x,
#: T.dzero())``). Slang still emits ``0 * x`` for it (SPIR-V ``OpFMul %float_0``); the
#: driver's compiler folds that (lavapipe's NIR does, where a zero passed in at run time
#: gave ``0 * inf = NaN`` at x = inf; PyTorch: inf). See docs/forward-mode.md.
NO_TANGENT: Any = type("NoTangent", (), {"__repr__": lambda self: "NO_TANGENT"})()


def input_pair(fn: FunctionTarget, p: ParamInfo, value: Any) -> list:
    """``[primal, tangent]`` of differentiable input ``p`` (``primal_and_tangent``), or
    ``[value, NO_TANGENT]`` where ``value`` gives no tangent anywhere: a tensor without one,
    a number, an array, a SlangPy value (not a struct (dict), list or pair).

    >>> input_pair(fn, p, 2.0), input_pair(fn, p, (2.0, 1.0))
    ([2.0, NO_TANGENT], [2.0, 1.0])
    """
    if isinstance(value, Tensor):
        check_device(fn, value, f"parameter '{p.name}'")
        if value.tangent is None:
            return [value, NO_TANGENT]
    elif not isinstance(value, (dict, list, tuple)):
        return [value, NO_TANGENT]
    return list(primal_and_tangent(fn, p, value))


def described(value: Any) -> str:
    """``a numpy.ndarray of shape (3,)``: a value's type (and shape) for a message."""
    shape = getattr(value, "shape", None)
    return f"a {type(value).__module__}.{type(value).__name__}" + (
        f" of shape {tuple(shape)}" if shape is not None else ""
    )


def given(call_args: list) -> tuple:
    """``call_args`` without the NO_TANGENT slots (the wrapper takes no tangent there)."""
    return tuple(a for a in call_args if a is not NO_TANGENT)


def primal_and_tangent(fn: FunctionTarget, p: ParamInfo, value: Any) -> tuple[Any, Any]:
    """What ``fn.fwds`` passes for differentiable input ``p``: its primal and its tangent.

    >>> primal_and_tangent(fn, p, {"a": (2.0, 1.0), "b": 3.0})
    ({'a': 2.0, 'b': 3.0}, {'a': 1.0, 'b': 0.0})
    """
    if isinstance(value, (dict, list)) and (isinstance(value, dict) or nested_tensors(value)):
        return _struct_split(fn, p, value)
    if is_pair(value):
        return _split_pair(fn, p, value, "")
    if isinstance(value, Tensor):
        check_device(fn, value, f"parameter '{p.name}'")
        if value.tangent is not None:
            return value, value.tangent
        if str(value.dtype).startswith("double"):  # (no gradient dtype: a double tangent)
            return value, new_zeros(value.shape, dtype=value.dtype, device=value.device)
        zeros = scratch(fn.module.device, value, "zeros")  # (1,) for a 0-d value: viewed as ()
        return value, Tensor(zeros if value.shape else zeros.view(()), value.device)
    return value, zero_like(value)


def _split_pair(fn: FunctionTarget, p: ParamInfo, value: tuple, path: str) -> tuple[Any, Any]:
    """A (value, tangent) pair given for parameter ``p`` (``path``: a field of it)."""
    primal, tangent = value
    at = f"parameter '{p.name}'" + (f" ({p.type_name}) at field '{path}'" if path else "")
    if isinstance(primal, (dict, list, tuple)) and (path or isinstance(primal, dict)):
        what = "struct (dict)" if isinstance(primal, dict) else "list"
        raise TypeError(
            f"{fn.label}.fwds: {at} is given a (value, tangent) pair of a {what}: give each "
            "number field its own pair ({'a': (2.0, 1.0)}) and tensors their tangent with "
            "t.with_tangent(u) (an array as one tensor or NumPy array)"
        )
    if isinstance(primal, Tensor):
        view = primal.detach()
        try:
            view.with_tangent(tangent)
        except ValueError as exc:
            raise ValueError(f"{fn.label}.fwds: {at}: {exc}") from None
        return view, view.tangent
    # The direction's space is the value's: a number's tangent is one number, whatever the
    # call's shape (a (5,) tangent would be 5 directions, one per call element: the
    # derivative of another function, the value copied per element), a tensor's too.
    shape = tangent.shape if isinstance(tangent, Tensor) else np.shape(tangent)
    if np.shape(primal) != shape:
        raise ValueError(
            f"{fn.label}.fwds: {at}: tangent has shape {shape} but the value has shape "
            f"{np.shape(primal)}: a tangent is a direction of the value's own shape (pass a "
            "tensor as the value for one direction per element)"
        )
    return primal, tangent


def _struct_split(fn: FunctionTarget, p: ParamInfo, value: Any, path: str = "") -> tuple[Any, Any]:
    """A struct (dict) or array (list) argument and its tangent, shaped as SlangPy binds the
    parameter's ``Differential``: each tensor's tangent (zeros where it has none), a field's
    (value, tangent) pair split in two, 0 for the other values, without the fields that
    have no derivative (a tangent there is said, and dropped)."""
    if isinstance(value, dict):
        primal, tangent = {}, {}
        for key, v in value.items():
            rel = f"{path}.{key}" if path else str(key)
            if rel in p.no_grad_fields:
                if is_pair(v) or gives_tangent(v):
                    warn_dropped(fn, p, "." + rel)
                primal[key] = v[0] if is_pair(v) else primals_only(v)
                continue
            primal[key], tangent[key] = _struct_split(fn, p, v, rel)
        return primal, tangent
    if path and is_pair(value):
        return _split_pair(fn, p, value, path)
    if isinstance(value, (list, tuple)) and nested_tensors(value):
        if any(is_pair(v) for v in value):
            raise TypeError(
                f"{fn.label}.fwds: parameter '{p.name}' ({p.type_name}) holds (value, tangent) "
                f"pairs in a list at '{path or p.name}': give the array as one tensor with its "
                "tangent (t.with_tangent(u)) or one pair of NumPy arrays"
            )
        return value, [_struct_split(fn, p, v, path)[1] for v in value]
    if isinstance(value, Tensor):
        return primal_and_tangent(fn, p, value)
    return value, zero_like(value)


def refuse_listed_tangents(fn: FunctionTarget, p: ParamInfo, value: Any, path: str) -> None:
    """Tensors with tangents in a list (an array argument, or a struct's array field): the
    call reads the list as one host array, so their tangents would be dropped: refused.

    >>> refuse_listed_tangents(fn, p, [t.with_tangent(u), 1.0], "a")   # TypeError
    """
    if isinstance(value, dict):
        for key, v in value.items():
            refuse_listed_tangents(fn, p, v, f"{path}.{key}")
    elif isinstance(value, list) and any(t.tangent is not None for t in nested_tensors(value)):
        raise TypeError(
            f"{fn.label}.fwds: parameter '{p.name}' ({p.type_name}) holds tensors with tangents "
            f"in a list at '{path}': the call reads such a list as one host array, so their "
            "tangents would be lost; pass the array as one tensor (with its tangent)"
        )


def warn_dropped(fn: FunctionTarget, p: ParamInfo, where: str = "", struct: bool = False) -> None:
    """A tangent given where no derivative flows: said, as reverse mode says it (bwds_checks).

    >>> warn_dropped(fn, p, ".c")     # GradientFlowWarning: field 'r.c' gets no derivative
    """
    why = "no_diff" if p.no_diff else f"a {p.type_name} (not differentiable)"
    if struct:
        why = f"a struct {p.type_name} that is not IDifferentiable (or no_diff)"
    at = f"'{p.name}{where}'" if where else f"'{p.name}'"
    what = f"field {at} gets no derivative" if where else f"parameter {at} is {why}"
    warn_once(
        f"{fn.label}: {what}, so forward mode drops the tangent given to it: the result's "
        "tangent leaves it out. Pass the value without a tangent to say none is wanted, or make "
        "it differentiable (drop no_diff; a float type; an IDifferentiable struct)"
    )


def refuse_on_tape(fn: FunctionTarget, bound: list) -> None:
    """``fn.fwds`` records nothing on a tape: while one records, an argument that requires a
    gradient (in a struct field or a (value, tangent) pair too) is refused, RuntimeError,
    where its gradient through the value and tangent would silently be 0."""
    if active_tape() is None:
        return
    for p, value in bound:
        if any(t.requires_grad for t in nested_tensors(value)):
            raise RuntimeError(
                f"{fn.label}.fwds: parameter '{p.name}' is given a tensor that requires a "
                "gradient while a pydiff.Tape records; .fwds records nothing, so the gradient "
                "through its result and tangents would be silently 0. Use pydiff.jvp(fn, "
                "primals, tangents), which records both on the tape, or pass t.detach() to "
                "take the JVP without a gradient through it"
            )
