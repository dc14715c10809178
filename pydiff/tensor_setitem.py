"""``x[key] = value``: the elements ``x[key]`` selects written in place, with the bookkeeping
of pydiff's other in-place writes (``fill``, ``copy_from_numpy``, ``copy_``).

Keys are those of ``x[key]`` (ints, negative too, slices with steps, ``...``, tuples of them);
the value is a number, a NumPy array or a pydiff tensor of ``x``'s dtype, broadcast to the
selection as NumPy does (a vector tensor's element axis trailing: ``v[1] = [1, 2, 3]`` for
float3). This first version goes through the host: ``x``'s values are read back, the selected
elements replaced, and all of them written back by ``copy_from_numpy``'s route (a host wait
and two transfers of the whole tensor; a device kernel would do only the selected elements).

The write counts as any other: ``x``'s version moves on (a tape's backward or a ``.bwds`` that
read ``x`` before refuses it as overwritten), a capture refuses it (a host write), a key that
selects every element is ``copy_from_numpy`` exactly (the tape's gradient stops at ``x``: its
values are constants). Refused, because the tape cannot follow a write of *part* of the values
(it would give the kept elements no gradient, or the overwritten ones a wrong one): ``x`` made
by a call a tape recorded, a value with a gradient path on a tape (no tape records the write:
its gradient would be lost), and under ``pydiff.jvp`` ``x`` or the value with a tangent. Write
those with recorded ops instead: ``x = x * keep + v * (1 - keep)`` (``keep`` a 0/1 array).

    x[1:3] = 0.0
    x[:, 2] = np.arange(4.0)
    x[..., -1] = y          # y: a pydiff tensor broadcast to x[..., -1]'s shape
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from . import forward_trace, tensor_methods
from .storage import COPY_FROM_GRAPH, host_cast
from .tape import active_tape
from .tape_reads import Forgotten
from .temporary_copies import key_text
from .tensor import Tensor
from .unrecorded import copied_from


def _check_key(x: Tensor, key: Any) -> str:
    """The key as written (``x[1:3]``), or a TypeError naming an index setitem does not take."""
    text = f"x[{key_text(key)}]"
    for item in key if isinstance(key, tuple) else (key,):
        if item is Ellipsis or isinstance(item, slice):
            continue
        if isinstance(item, (numbers.Integral, np.integer)) and not isinstance(item, bool):
            continue
        if isinstance(item, (bool, np.bool_)) or getattr(item, "dtype", None) in (bool, "bool"):
            kind = "a boolean mask"
        elif item is None:
            kind = "None (np.newaxis)"
        else:
            kind = f"an index of type {type(item).__name__}"
        raise TypeError(
            f"x[key] = value: {kind} in the key is not supported (tensor of shape {x.shape}); "
            "keys are ints (negative too), slices (with steps), ... and tuples of them, as for "
            "x[key]. For a mask or a list of indices, write the values from the host: "
            "a = x.numpy(); a[mask] = v; x.copy_from_numpy(a)"
        )
    return text


def _graph(v: Tensor) -> bool:
    """Whether ``v``'s values have a gradient path (``copy_``'s test)."""
    if v.requires_grad or v.storage.last_writer == COPY_FROM_GRAPH:
        return True
    return copied_from(v) is not None


def setitem(x: Tensor, key: Any, value: Any) -> None:
    """``x[key] = value`` (see the module's text)."""
    text = _check_key(x, key)
    try:
        where = np.asarray(np.arange(x.numel).reshape(x.shape)[key])  # NumPy's rules
    except IndexError as exc:
        raise IndexError(f"{text} = value: {exc} (tensor of shape {x.shape})") from None
    elem = x.expected_numpy_shape()[len(x.shape) :]
    graph = False
    if isinstance(value, Tensor):
        if value.dtype != x.dtype:
            raise TypeError(
                f"{text} = value: the value is a tensor of dtype {value.dtype}, x has dtype "
                f"{x.dtype}; convert it first (value.astype({x.dtype!r}))"
            )
        if value.device != x.device:
            raise ValueError(f"{text} = value: the value is on {value.device!r}, x on {x.device!r}")
        graph = _graph(value)
        values = value.numpy()
    elif isinstance(value, (numbers.Number, np.ndarray, np.generic, list, tuple)):
        values = np.asarray(value)
    else:
        raise TypeError(
            f"{text} = value: the value is a {type(value).__name__}; give a number, a NumPy "
            "array or a pydiff tensor"
        )
    try:
        values = np.broadcast_to(values, where.shape + elem)
    except ValueError:
        raise ValueError(
            f"{text} = value: a value of shape {np.shape(values)} does not broadcast to the "
            f"selection's shape {where.shape + elem} (tensor of shape {x.shape}, dtype {x.dtype})"
        ) from None
    _refuse_untracked(x, value, text, graph, where.size == x.numel)
    if where.size == 0:
        return  # (NumPy: a write of no elements)
    current = x.numpy()
    values = host_cast(values, current.dtype, f"{text} = value", x.scalar_type == "bool")
    flat = current.reshape((x.numel,) + elem)
    flat[where.reshape(-1)] = values.reshape((-1,) + elem)
    everything = where.size == x.numel  # (basic indexing never repeats an element)
    x.copy_from_numpy(current, caller=f"{text} = value", count=everything)
    if not everything:  # (a write of part: earlier values survive, and its mark, STRICT's)
        writer = f"{text} = value (Tensor.__setitem__)" if not graph else COPY_FROM_GRAPH
        x.storage.wrote(writer, everything=False)
    elif graph:
        x.storage.wrote(COPY_FROM_GRAPH, True)  # (as copy_ marks values with a gradient path)


def _refuse_untracked(x: Tensor, value: Any, text: str, graph: bool, everything: bool) -> None:
    """Refuse the writes the tape or a ``pydiff.jvp`` trace could not follow (module text)."""
    fix = (
        "build the new values with recorded ops instead, e.g. x2 = x * keep + v * (1 - keep) "
        "with keep a 0/1 NumPy array of x's shape"
    )
    producer = x.producer
    if not everything and producer is not None and not isinstance(producer, Forgotten):
        raise RuntimeError(
            f"{text} = value: x was made by a call recorded on a pydiff.Tape, and the tape "
            "cannot follow a write of part of its values (the elements kept would get no "
            f"gradient, or the overwritten ones a wrong one); {fix}"
        )
    if graph and active_tape() is not None:
        raise RuntimeError(
            f"{text} = value: the value has a gradient path and no tape records this write, "
            f"so its gradient would be lost; {fix}"
        )
    traced = forward_trace.tangents_of([x, value] if isinstance(value, Tensor) else [x])
    if any(t is not None for t in traced):
        raise RuntimeError(
            f"{text} = value under pydiff.jvp: the tangent cannot follow a write in place of "
            f"x's elements; {fix}"
        )


tensor_methods.provide("setitem", setitem)
