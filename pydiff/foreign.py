"""Arguments from other frameworks (torch tensors) in calls of shader functions and ops:
the call layer asks here, and the interop module above it registers how to run them.

    foreign.register(torch_tensor_classes, call_with_torch, "torch", advice)  # torch_interop
    handler = foreign.handler(args, kwargs)                   # None: only pydiff's values
    if handler: return handler(fn, args, kwargs)
    foreign.framework(value)                                  # "torch", or None
    foreign.data(t, "gradcheck: input 1")                     # torch data -> pydiff
    foreign.map_nested([t], "input 0", f)     # f(t, "input 0[0]", "torch") in its place
    with foreign.data_calls(): y = f(x)      # calls with torch data give pydiff results
    args, kwargs = foreign.as_data(fn, args, kwargs, "m.f.bwds")  # torch data -> pydiff
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np


class _Registration(NamedTuple):
    classes: Callable[[], tuple]
    call: Callable[[Any, tuple, dict], Any]
    name: str
    advice: str
    data: Callable[..., Any] | None  # (value, where, device=None)
    needs_grad: Callable[[Any], bool]


_handlers: list[_Registration] = []


def register(
    classes: Callable[[], tuple],
    call: Callable[[Any, tuple, dict], Any],
    name: str = "foreign",
    advice: str = "",
    data: Callable[..., Any] | None = None,
    needs_grad: Callable[[Any], bool] = lambda value: False,
) -> None:
    """Run calls with an argument of one of ``classes()`` (the classes loaded now: () while
    their framework is not imported) through ``call(fn, args, kwargs)`` instead. ``name``
    (the framework, "torch") and ``advice`` (how to convert its values) go into the messages
    of the places that cannot take them. ``data(value, where)``: the value as a pydiff tensor
    of its values, for calls outside the framework's autograd (``as_data``), which refuse a
    value that ``needs_grad`` (its gradient would be lost)."""
    _handlers.append(_Registration(classes, call, name, advice, data, needs_grad))


def _registration(value: Any) -> _Registration | None:
    for reg in _handlers:
        kinds = reg.classes()
        if kinds and isinstance(value, kinds):
            return reg
    return None


def handler(args: tuple, kwargs: dict) -> Callable[[Any, tuple, dict], Any] | None:
    """The ``call`` of the first registration with an argument of its classes, or None."""
    for classes, call, *_ in _handlers:
        kinds = classes()
        if kinds:
            for a in args:
                if isinstance(a, kinds):
                    return call
            for v in kwargs.values():
                if isinstance(v, kinds):
                    return call
    return None


def framework(value: Any) -> str | None:
    """The name of the framework ``value`` is a tensor of ("torch"), or None."""
    reg = _registration(value)
    return reg.name if reg is not None else None


def advice(value: Any) -> str:
    """How to convert ``value``, a foreign tensor, for pydiff ("" when not one)."""
    reg = _registration(value)
    return reg.advice if reg is not None else ""


_DATA_CALLS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pydiff_data_calls", default=False
)


@contextlib.contextmanager
def data_calls() -> Iterator[None]:
    """A block whose calls given foreign data (torch tensors without gradients) run as pydiff
    calls of their values, as on a pydiff tape, not through the framework's autograd (whose
    results would be its tensors): a transform's own evaluations of a function, e.g.
    gradcheck's finite differences, jacrev's first call, fixed_point's iterations."""
    token = _DATA_CALLS.set(True)
    try:
        yield
    finally:
        _DATA_CALLS.reset(token)


def taking_data() -> bool:
    """Whether a ``data_calls`` block is open (the interop module asks before its autograd)."""
    return _DATA_CALLS.get()


def data(value: Any, where: str) -> Any:
    """``value``, a foreign tensor, as a pydiff tensor of its values (a constant: the caller
    refuses one that requires grad first); any other value as it is."""
    reg = _registration(value)
    return value if reg is None or reg.data is None else reg.data(value, where)


def map_nested(value: Any, label: str, f: Callable[[Any, str, str], Any]) -> Any:
    """``value`` with each foreign tensor in it (itself, or inside dicts, lists and tuples) as
    ``f(t, where, name)``: ``where`` extends ``label`` to it (``input 0['w'][1]``), ``name``
    is its framework ("torch"). Dicts, lists and tuples are rebuilt; other values kept."""
    if isinstance(value, dict):
        return {k: map_nested(v, f"{label}[{k!r}]", f) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(map_nested(v, f"{label}[{i}]", f) for i, v in enumerate(value))
    name = framework(value)
    return f(value, label, name) if name else value


def as_data(fn: Any, args: tuple, kwargs: dict, use: str) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call of the shader function ``fn`` that no framework's
    autograd sees (``fn.fwds``, ``fn.bwds``), with foreign tensors converted to pydiff
    tensors of their values (constants: no gradient reaches them). Refused, naming the
    parameter: one that requires grad (``needs_grad``), and one at a parameter the
    call writes or at an option (``_result``), whose values would not come back."""
    kinds = _loaded_classes()
    if not kinds or not _holds_foreign((*args, *kwargs.values()), kinds):
        return args, kwargs  # (every .bwds/.fwds call: one lookup while torch is not loaded)
    names = [p.name for p in fn.params]
    device = getattr(getattr(fn, "module", None), "device", None)
    written = {p.name for p in fn.params if p.writes_value}

    def convert(value: Any, name: str) -> Any:
        if type(value) in (tuple, list):  # fwds's (value, tangent) pairs, lists of values
            return type(value)(convert(v, name) for v in value)
        reg = _registration(value)
        if reg is None:
            return value
        where = name if name.startswith("_") else f"parameter {name!r}"
        if name in written:
            raise TypeError(
                f"{use}: {where} is a {reg.name} tensor, which the call writes: the values "
                f"would not reach it. Pass a pydiff tensor and convert it after the call "
                f"({reg.advice})"
            )
        if name.startswith("_") or reg.data is None:
            raise TypeError(
                f"{use}: {where} is a {reg.name} tensor; pass a pydiff one ({reg.advice})"
            )
        if reg.needs_grad(value):
            raise TypeError(
                f"{use}: {where} is a {reg.name} tensor that requires grad; {use} runs outside "
                f"{reg.name} autograd, so no gradient would reach it. Pass t.detach() for its "
                f"values, or call the function itself on {reg.name} tensors ({reg.name} "
                "autograd)"
            )
        return reg.data(value, f"{use}: {where}", device)  # (on fn's module's device)

    new_args = tuple(
        convert(a, names[k] if k < len(names) else f"argument {k}") for k, a in enumerate(args)
    )
    return new_args, {k: convert(v, k) for k, v in kwargs.items()}


def as_array(value: Any, where: str) -> Any:
    """``np.asarray(value)``, where pydiff copies values; a foreign tensor in it that requires
    grad, alone or in a list or tuple, is refused (``TypeError``, as in ``as_data``): no
    gradient would reach it, and the framework's own error from its NumPy conversion said
    nothing of where or why. (Checked only when the conversion fails: lists stay as fast.)

        arr = as_array(data, "pydiff.tensor: data")
    """
    try:
        return np.asarray(value)
    except RuntimeError:
        _refuse_lost_grad(value, where)
        if framework(value) is not None and hasattr(value, "resolve_neg"):  # torch's lazy
            return np.asarray(value.resolve_conj().resolve_neg())  # negation (t._neg_view())
        raise
    except ValueError as e:  # NumPy's says nothing of which call or argument
        ragged = "inhomogeneous" in str(e)
        fix = "nested lists must be rectangular (every row of one length); " if ragged else ""
        raise ValueError(f"{where}: cannot be made an array: {fix}NumPy says: {e}") from None


def _refuse_lost_grad(value: Any, where: str) -> None:
    kinds = _loaded_classes()
    if not kinds or not _holds_foreign((value,), kinds):
        return
    listed = type(value) in (tuple, list)
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) in (tuple, list):
            stack.extend(item)
            continue
        reg = _registration(item)
        if reg is not None and reg.needs_grad(item):
            held = f"a list holding a {reg.name} tensor" if listed else f"a {reg.name} tensor"
            raise TypeError(
                f"{where}: {held} that requires grad; its values are copied, so no gradient "
                f"would reach it. Call the function on {reg.name} tensors ({reg.name} autograd "
                f"sees the call; {reg.name}.stack a list), or t.detach() for the values"
            )


def _loaded_classes() -> tuple:
    kinds: tuple = ()
    for reg in _handlers:
        kinds += reg.classes()
    return kinds


def _holds_foreign(values: tuple, kinds: tuple) -> bool:
    for v in values:
        if type(v) in (tuple, list):
            if _holds_foreign(tuple(v), kinds):
                return True
        elif isinstance(v, kinds):
            return True
    return False


def refuse_result(fn: Any, kwargs: dict, through_autograd: bool) -> None:
    """A call given foreign tensors: a foreign tensor as ``_result`` (never written: the call
    returns a new tensor, and the one given stayed as it was without a word) and, through
    the framework's autograd (whose results are its tensors), ``_result="numpy"`` (refused
    there as "returned ndarray (output 0)") raise TypeError naming the function."""
    res = kwargs.get("_result")
    name = framework(res)
    if name is None and not (through_autograd and isinstance(res, str) and res != "tensor"):
        return
    label = getattr(fn, "label", None) or getattr(fn, "__name__", None) or type(fn).__name__
    given = f"a {name} tensor" if name else repr(res)
    raise TypeError(
        f"{label}: _result={given} in a call with {name or 'torch'} tensors: the call returns "
        "a new tensor of the framework's (pydiff writes into none of its tensors); leave "
        "_result out and copy the result where you want it (buf.copy_(y))"
    )
