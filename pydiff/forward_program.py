"""Forward mode through Python functions of pydiff calls (``pydiff.jvp`` of a callable) and
reverse over forward (``pydiff.hvp`` of one): the tangents every op and shader call gives.

    y, dy = program_jvp(f, (x,), (u,))       # each op's jvp rule, shader calls by fwd_diff
    (hv,) = program_hvp(f, (x,), (v,))       # f's tangent recorded on a tape, then backward

Shader calls inside get their tangent from ``shader_tangents`` (``fn.fwds``, or under a tape
recording for ``hvp`` the recorded ``ShaderTangent``), registered here with ``forward_trace``.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

import numpy as np

from . import foreign, forward_trace
from .backward_scope import separate_backward
from .creation import ZERO_SIZE, tensor as make_tensor, zeros
from .forward_mode import as_scalar
from .host_values import differentiated_values, to_float32
from .integer_primals import holds_integers
from .lost_derivative import refuse_lost_copy
from .seeds import seed_values
from .shader_tangents import shader_call
from .tape import Tape, active_tape
from .tensor import Tensor
from .unrecorded import refuse_copied

forward_trace.provide_shader_call(shader_call)


# --- pydiff.jvp / pydiff.hvp of a Python function ------------------------------------------


def float_primal(value: Any, what: str, k: int) -> Tensor:
    """A primal given a direction, as a float tensor (host numbers and arrays uploaded, host
    integers as floats: integer_primals)."""
    if isinstance(value, Tensor):
        if value.scalar_type not in ("float", "half"):
            raise TypeError(f"{what}: primal {k} has dtype {value.dtype!r}; it needs a float dtype")
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.ndarray, list, tuple)):
        kind = type(value)
        name = foreign.framework(value)  # ("torch tensor", as vjp and hessian say it)
        name = f"{name} tensor" if name else f"{kind.__module__}.{kind.__name__}"
        raise TypeError(
            f"{what}: primal {k} is a {name}; give directions for "
            "pydiff tensors (pydiff.from_torch for torch's), NumPy arrays, lists or numbers "
            "(None for the other arguments)"
        )
    wide = differentiated_values(value, f"{what}: primal {k}")  # (bools were 0/1, complex real)
    arr = to_float32(wide, f"{what}: primal {k}")  # overflow refused, not made inf
    if arr.size == 0:  # (named here: pydiff.tensor's refusal named neither)
        raise ValueError(f"{what}: primal {k} has shape {arr.shape}, with no elements; {ZERO_SIZE}")
    return make_tensor(arr.reshape(np.shape(value)))  # a number: 0-d, as pydiff.tensor(3.0)


def as_data(value: Any, what: str = "data") -> Any:
    """A NumPy array passed as data (not differentiated): a tensor, as the ops need (floats as
    float32, integers in int32 range as int32: held fixed, as by grad, jacfwd, jvp, hvp);
    ValueError naming ``what`` where float values overflow float32."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub" and value.size:
        if value.dtype.kind == "f":
            return make_tensor(to_float32(value, what))
        if value.dtype.kind in "iu" and value.min() >= -(2**31) and value.max() < 2**31:
            return make_tensor(value.astype(np.int32))
    return value


def held_primal(value: Any, what: str, k: int) -> Any:
    """A primal without a direction: a torch tensor as a pydiff tensor of its values, held
    fixed, as a call on a tape takes torch data (before, the shader calls inside returned
    torch tensors, refused as "call it with _result='tensor'" or by an internal Function's
    name); one that requires grad is refused, its gradient would be lost."""
    name = foreign.framework(value)
    if name is None:
        return value
    if getattr(value, "requires_grad", False) is True:
        raise TypeError(
            f"{what}: primal {k} is a {name} tensor that requires grad; {what} runs outside "
            f"{name} autograd, so its gradient would be lost: pass t.detach() to hold it "
            "fixed, or pydiff.from_torch(t) to give it a direction"
        )
    return foreign.data(value, f"{what}: primal {k}")


def _direction(x: Tensor, u: Any, what: str, name: str, k: int) -> Tensor:
    """The direction for primal k as a tensor of x's shape and dtype, or a ValueError."""
    want = x.expected_numpy_shape()
    if isinstance(u, Tensor) and u.requires_grad and active_tape() is not None:
        if (u.shape, u.dtype) == (x.shape, x.dtype) and what == "jvp":
            return u  # recorded tangent ops reach it: its gradient flows (as torch.func.jvp)
        refuse_lost_copy(u, f"{what}: {name}[{k}]")  # (a copy would drop its gradient)
    arr = seed_values(
        u.numpy() if isinstance(u, Tensor) else u, f"{what}: {name}[{k}]", x.scalar_type
    )
    if arr.shape != want and not (arr.size == 1 and int(np.prod(want)) == 1):
        raise ValueError(f"{what}: {name}[{k}] has shape {arr.shape}; primal {k} has shape {want}")
    return make_tensor(arr.reshape(want).astype(np.float32), dtype=x.dtype, device=x.device)


def prepare(
    what: str, primals: Sequence[Any], directions: Sequence[Any], name: str, data: bool = False
) -> tuple[list, list]:
    """Primals (those with a direction as float tensors) and their directions as tensors;
    with ``data``, NumPy arrays held fixed as tensors (``as_data``, as grad and jacfwd)."""
    primals, directions = tuple(primals), tuple(directions)
    if any(t is not None for t in forward_trace.tangents_of(primals)):
        raise NotImplementedError(
            f"{what} inside a function given to pydiff.jvp/jacfwd, on values with tangents "
            "(nested forward mode): the outer tangent would be lost; pydiff has no third order"
        )
    if len(directions) != len(primals):
        raise ValueError(
            f"{what}: {len(primals)} primals but {len(directions)} {name} (one per primal, "
            "None for arguments held fixed)"
        )
    xs, us = [], []
    for k, (x, u) in enumerate(zip(primals, directions)):
        if u is None:
            x = held_primal(x, what, k)
            xs.append(as_data(x, f"{what}: argument {k}") if data else x)
            us.append(None)
            continue
        x = float_primal(x, what, k)
        xs.append(alias(x))
        us.append(_direction(x, u, what, name, k))
    return xs, us


def alias(x: Tensor) -> Tensor:
    """``x``'s values and gradients as a tensor of its own identity, which alone carries the
    tangent: the same tensor given twice gets two, and a closure reading ``x`` none (as
    torch.func: a closure's tensor is a constant)."""
    base = x.base if x.base is not None else x
    return Tensor(x.native_view(), x.device, storage=x.storage, base=base)


def refuse_inside_tape(what: str) -> None:
    """A RuntimeError for a transform that records on a tape of its own, called while one
    records on this thread: tapes do not nest, and what the transform returns would be a
    constant to the recording tape's backward (its gradient through it silently 0)."""
    if active_tape() is not None:
        raise RuntimeError(
            f"pydiff.{what} cannot run while a pydiff.Tape is recording on this thread: it "
            "records on a tape of its own, and tapes do not nest. Call it outside the "
            "'with pydiff.Tape()' block (before it, or after tape.backward); a function given "
            "to vjp, jacrev, grad, hvp or hessian runs on their tape, so it cannot call it"
        )


class lent_grads:
    """A block in which the tensors ``tape`` read that are not ``leaves`` (nor views of
    them), e.g. a model's parameters a function closes over, hold fresh gradient buffers: a
    transform's backward leaves their ``.grad`` as it was (torch.func never touches it)."""

    def __init__(self, tape: Tape, leaves: Sequence[Any]) -> None:
        self._tape, self._leaves = tape, leaves

    def __enter__(self) -> None:
        self._back, seen = [], set()
        for t in self._tape.inputs():
            b = t.base if t.base is not None else t
            if id(b) in seen or any(b is x for x in self._leaves) or not b.requires_grad:
                continue
            seen.add(id(b))
            self._back.append((b, b.lend_grads()))

    def __exit__(self, *exc: Any) -> None:
        if self._back:
            self._back[0][0].device.flush()  # the backward's kernels ran on the lent buffers
        for _, give_back in reversed(self._back):
            give_back()


def traced(fn: Callable[..., Any], xs: Sequence[Any], us: Sequence[Any], what: str) -> tuple:
    """``(fn(*xs), its tangents)`` under a trace where xs have tangents us; an output without
    one gets zeros (it does not depend on them)."""
    if not callable(fn):
        raise TypeError(f"{what}: fn must be a module function or a callable, not {type(fn)}")
    trace = forward_trace.Trace()
    for x, u in zip(xs, us):
        trace.set(x, u)
    with forward_trace.tracing(trace):
        out = fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    tangents = []
    for k, o in enumerate(outs):
        if not isinstance(o, Tensor):
            raise TypeError(
                f"{what}: fn returned a {type(o).__name__} (output {k}); it must return pydiff "
                "Tensors (a tuple for several)"
            )
        t = trace.tangent(o)
        tangents.append(t if t is not None else zeros(o.shape, dtype=o.dtype, device=o.device))
    return out, (tuple(tangents) if isinstance(out, tuple) else tangents[0])


def program_jvp(fn: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any]) -> tuple:
    """``(fn(*primals), J tangents)`` for a Python function of pydiff calls (see pydiff.jvp)."""
    xs, us = prepare("jvp", primals, tangents, "tangents", data=True)
    return traced(fn, xs, us, "jvp")


def program_hvp(
    fn: Callable[..., Any], primals: Sequence[Any], v: Sequence[Any], what: str = "hvp"
) -> tuple:
    """One ``H v`` per primal given a direction (None for the others) of a Python function
    with a one-element result: the tangent <grad f, v> recorded on a tape, then its backward
    (``what``: the transform errors name, hvp or hessian)."""
    refuse_inside_tape(what)
    xs, us = prepare(what, primals, v, "directions", data=True)
    leaves = [x.detach().requires_grad_(True) if u is not None else x for x, u in zip(xs, us)]
    with Tape(reads_other_tapes=True) as tape:
        out, t = traced(fn, leaves, us, what)
    if not isinstance(out, Tensor) or out.numel != 1:
        got = out.shape if isinstance(out, Tensor) else f"a tuple of {len(out)}"
        raise ValueError(
            f"{what}: fn must return a one-element tensor (a scalar: reduce with ops.sum or "
            f"ops.mean), got {got}"
        )
    refuse_copied(t, what)  # a tangent from values copy_ took: its backward would give 0
    if t.producer is tape and t.requires_grad:
        with lent_grads(tape, leaves), separate_backward():  # (inside another one too)
            tape.backward(t)
    result = []
    for given, leaf, u in zip(primals, leaves, us):
        if u is None:
            result.append(None)
        elif isinstance(given, Tensor):
            result.append(leaf.grad)
        else:
            result.append(as_scalar(leaf.grad.numpy().reshape(np.shape(given))))
    return tuple(result)


def variables(primals: Sequence[Any]) -> list[tuple[int, tuple]]:
    """(index, shape) of the primals a Hessian differentiates: float tensors, float arrays
    and lists, floats (integers, int tensors and other values are held fixed: labels,
    indices; integer_primals)."""
    found = []
    for k, x in enumerate(primals):
        if isinstance(x, Tensor):
            if x.scalar_type in ("float", "half"):
                found.append((k, x.expected_numpy_shape()))
        elif isinstance(x, (float, np.floating)) or (
            isinstance(x, (np.ndarray, list, tuple)) and np.asarray(x).dtype.kind == "f"
        ):
            found.append((k, np.shape(x)))
    return found


def program_hessian(fn: Callable[..., Any], primals: Sequence[Any], max_inputs: int) -> np.ndarray:
    """The Hessian of a scalar Python function w.r.t. its float primals (shapes: see
    pydiff.hessian): one ``program_hvp`` per input element."""
    refuse_inside_tape("hessian")
    primals = tuple(primals)
    for k, x in enumerate(primals):  # (variables() would hold it fixed, silently)
        if (name := foreign.framework(x)) is not None:
            raise TypeError(
                f"hessian: primal {k} is a {name} tensor; pass "
                "pydiff.from_torch(t) to differentiate it (as float arrays are), or close "
                "over it to hold it fixed"
            )
    found = variables(primals)
    sizes = [int(np.prod(s)) for _, s in found]
    n = sum(sizes)
    if n == 0:
        ints = [k for k, x in enumerate(primals) if holds_integers(x)]
        held = f"; primals {ints} hold integers, held fixed: give floats" if ints else ""
        raise ValueError(
            f"hessian: no float primal to differentiate (pydiff tensors, float arrays, "
            f"floats){held}"
        )
    if n > max_inputs:
        raise ValueError(
            f"hessian: {n} inputs need {n} HVPs; above max_inputs={max_inputs}, use pydiff.hvp"
        )
    shapes: list[Any] = [None] * len(primals)
    for k, shape in found:
        shapes[k] = shape
    return hessian_by_columns(shapes, lambda dirs: program_hvp(fn, primals, dirs, "hessian"))


def hessian_by_columns(shapes: Sequence[Any], hvp_of: Callable[[list], Sequence[Any]]) -> Any:
    """The Hessian from n HVPs along the unit vectors: ``shapes`` holds each primal's shape
    (None: held fixed, direction None), ``hvp_of(directions)`` one H v per primal. One primal
    differentiated: of shape ``x.shape + x.shape`` (PyTorch's, JAX's: () for a 0-d x);
    several: (n, n), flattened and concatenated."""
    sizes = [0 if s is None else int(np.prod(s)) for s in shapes]
    n = sum(sizes)
    H = np.zeros((n, n))
    for col in range(n):
        e = np.zeros(n)
        e[col] = 1.0
        dirs, at = [], 0
        for shape, size in zip(shapes, sizes):
            dirs.append(None if shape is None else e[at : at + size].reshape(shape))
            at += size
        H[:, col] = np.concatenate(
            [
                np.asarray(h.numpy() if isinstance(h, Tensor) else h, np.float64).ravel()
                for h in hvp_of(dirs)
                if h is not None
            ]
        )
    live = [tuple(s) for s in shapes if s is not None]
    return H.reshape(live[0] * 2) if len(live) == 1 else H
