"""NumPy's functions given pydiff tensors (``Tensor.__array_function__``, NumPy's NEP 18).

NumPy answers a few functions with the tensor's own method, as it does for any object that
has one: ``np.sum``, ``np.mean``, ``np.transpose`` and ``np.reshape`` run ``x.sum()``,
``x.mean()``, ``x.transpose()`` and ``x.reshape()`` (pydiff ops, recorded on the tape);
``np.shape``, ``np.ndim`` and ``np.size`` read the shape. Every other function (``np.dot``,
``np.linalg.norm``, ``np.concatenate``, ...) computes on a NumPy copy of the values, and is
refused where that would lose a derivative silently: a tensor that requires a gradient while
a tape records, or one with a tangent while ``pydiff.jvp`` traces. NumPy's conversion of such
a tensor to an array (``Tensor.__array__``: ``np.asarray(x)``, and the tensors inside a list
or tuple, as ``np.sum([x, y])`` and ``np.array([x])`` convert them) is refused alike.

    np.linalg.norm(w)                   # off a tape: a NumPy float of the values
    with pydiff.Tape():
        np.dot(x, x)                    # TypeError: use x @ x, or np.dot(x.numpy(), ...)
        np.sum([x, x])                  # TypeError: use x + x, or x.numpy() for the values
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator

import numpy as np

from .lost_derivative import losing_derivative
from .tensor import Tensor


def _sum(x: Tensor, axis: Any = None, dtype: Any = None, out: Any = None, **kw: Any) -> Any:
    return x.sum(axis=axis, dtype=dtype, out=out, **kw)


def _mean(x: Tensor, axis: Any = None, dtype: Any = None, out: Any = None, **kw: Any) -> Any:
    return x.mean(axis=axis, dtype=dtype, out=out, **kw)


def _transpose(x: Tensor, axes: Any = None) -> Any:
    return x.transpose() if axes is None else x.transpose(*axes)


def _reshape(x: Tensor, shape: Any = None, order: str = "C", **kw: Any) -> Any:
    shape = kw.pop("newshape", None) if shape is None else shape
    if order != "C" or kw.get("copy") is not None or shape is None:
        return None  # not a view of the C-ordered values: the general path decides
    return x.reshape(shape)


def _size(x: Tensor, axis: Any = None) -> int:
    return x.numel if axis is None else x.shape[axis]


# NumPy's functions that pydiff answers itself: by the tensor's method (recorded, as NumPy
# calls an object's own method) or from the shape (nothing is computed, nothing is lost).
_OWN: dict[Callable[..., Any], Callable[..., Any]] = {
    np.sum: _sum,
    np.mean: _mean,
    np.transpose: _transpose,
    np.reshape: _reshape,
    np.shape: lambda x: x.shape,
    np.ndim: lambda x: len(x.shape),
    np.size: _size,
}


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in ``value``, also inside lists, tuples and dicts (``np.concatenate``)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _values(value: Any) -> Any:
    """``value`` with every tensor replaced by a NumPy copy of its values."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_values(v) for v in value)
    if isinstance(value, dict):
        return {k: _values(v) for k, v in value.items()}
    return value


def _name(func: Callable[..., Any]) -> str:
    module = getattr(func, "__module__", None) or "numpy"
    prefix = "np" + module[len("numpy") :] if module.startswith("numpy") else module
    return f"{prefix}.{getattr(func, '__name__', repr(func))}"


# NumPy's functions that write into their first argument: on a copy the write would be lost.
_WRITERS = {
    np.copyto,
    np.put,
    np.place,
    np.putmask,
    np.fill_diagonal,
    np.put_along_axis,
}


def _written_tensor(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The tensor ``func`` would write into (its first argument, or ``out`` however passed),
    or None."""
    if func in _WRITERS and args and isinstance(args[0], Tensor):
        return args[0]
    out = kwargs.get("out")
    if out is None and len(args) > 1:
        try:  # a positional out (np.dot(a, b, out))
            out = inspect.signature(func).bind(*args, **kwargs).arguments.get("out")
        except (TypeError, ValueError):
            out = None
    return next(_tensors(out), None)


def array_function(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """What ``func(*args, **kwargs)`` gives when an argument is a pydiff tensor.

    >>> array_function(np.dot, (x, x), {})    # off a tape: np.dot(x.numpy(), x.numpy())
    """
    own = _OWN.get(func)
    if own is not None and args and isinstance(args[0], Tensor):
        try:
            bound = inspect.signature(func).bind(*args, **kwargs)
        except (TypeError, ValueError):  # a wrong call, or no signature: NumPy's own error
            bound = None
        if bound is not None:
            named = dict(bound.arguments)
            named.update(named.pop("kwargs", {}))
            x = named.pop(next(iter(named)))
            result = own(x, **named)
            if result is not None:
                return result
    written = _written_tensor(func, args, kwargs)
    if written is not None:
        raise TypeError(
            f"{_name(func)}: it would write into a pydiff.Tensor of shape {written.shape}, but "
            "NumPy works on a copy of a tensor's values, so the write would be lost. Compute "
            "the values in NumPy and store them with t.copy_from_numpy(values) (or use pydiff "
            "ops, t.copy_(src), t.fill(v))"
        )
    for t in _tensors((args, kwargs)):
        why = losing_derivative(t)
        if why is not None:
            raise TypeError(
                f"{_name(func)}: an argument is a pydiff.Tensor of shape {t.shape} that {why}; "
                "NumPy computes on a copy of the values, so no derivative would flow through "
                "the result. Use pydiff ops (x @ y, x.sum(), pydiff.ops...) for a gradient, or "
                "pass the values, t.detach().numpy() or t.numpy(), to compute without one"
            )
    return func(*_values(args), **_values(kwargs))


def refuse_lost_conversion(t: Tensor) -> None:
    """Refuse NumPy's conversion of ``t`` to an array (``Tensor.__array__``) where the copy
    would lose a derivative silently (``losing_derivative``). NumPy converts the tensors in a
    list or tuple the same way, so ``np.sum([x, y])`` and ``np.array([x])`` come here too:
    NumPy's dispatch (``__array_function__``) does not look inside lists for most functions.

    >>> refuse_lost_conversion(x)   # on a tape, x requiring grad: TypeError naming x.numpy()
    """
    why = losing_derivative(t)
    if why is None:
        return
    raise TypeError(
        f"NumPy converted a pydiff.Tensor of shape {t.shape} that {why} to a NumPy array "
        "(np.asarray(x) or np.array(x), or a list or tuple holding tensors given to NumPy: "
        "np.array([x, y]), np.sum([x, y]), np.mean([x, 2 * x]), ...): the copy carries no "
        "derivative, so the gradient through it would be lost. For a gradient, combine the "
        "tensors with pydiff ops (x + y, (x * 2).mean(), x.sum(), pydiff.ops...); to read "
        "the values on purpose, use x.numpy(), float(x), x.item() or np.asarray(x.detach())"
    )
