"""``pydiff.grad`` and ``pydiff.value_and_grad``: JAX-style gradients of Python functions
of pydiff tensors, run on a tape of their own.

    df = pydiff.grad(lambda x: pydiff.ops.sum(pydiff.ops.mul(x, x)))
    df(np.array([1.0, 2.0]))                      # array([2., 4.])
    loss, (gw, gb) = pydiff.value_and_grad(loss_fn, argnums=(0, 1))(w, b, x)
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
import numbers
from typing import Any, Callable, Sequence

import numpy as np

from . import foreign, forward_trace
from .backward_scope import active_scope, separate_backward
from .creation import tensor as make_tensor
from .forward_program import as_data, lent_grads, refuse_inside_tape
from .unrecorded import refuse_copied
from .host_values import differentiated_values, to_float32
from .tape import Tape
from .tensor import Tensor


def on_tape(out: Tensor, tape: Tape, inputs: Sequence[Any], closed: bool = False) -> Tensor:
    """``out``, or a recorded copy of it where it is an input or a view of one (nothing on
    ``tape`` produced it, so a backward from it would not reach the input); with ``closed``,
    also where it is any other tensor that requires grad (one the function closes over:
    ``torch_function(lambda t: w)``, whose gradient torch's backward hands to it)."""
    if out.producer is tape or not out.requires_grad:
        return out
    if closed or any(isinstance(i, Tensor) and i.storage is out.storage for i in inputs):
        with tape:
            return out.clone()  # recorded (requires grad, a tape records): identity backward
    return out


def argnum_tuple(argnums: int | Sequence[int], count: int, what: str) -> tuple[int, ...]:
    """``argnums`` (an int or a tuple of them) checked against ``count`` arguments, as
    non-negative ints."""
    single = isinstance(argnums, numbers.Integral) and not isinstance(argnums, bool)
    if not single and not isinstance(argnums, (tuple, list)):
        raise TypeError(f"{what}: argnums must be an int or a tuple of ints, got {argnums!r}")
    items = (argnums,) if single else tuple(argnums)
    out = []
    for a in items:
        if not isinstance(a, numbers.Integral) or isinstance(a, bool):
            raise TypeError(f"{what}: argnums must be ints, got {a!r}")
        if not -count <= a < count:
            raise ValueError(
                f"{what}: argnums={a} is out of range for {count} positional arguments"
            )
        out.append(int(a) % count)
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: argnums {items} name one argument twice")
    if not out:
        raise ValueError(f"{what}: argnums is empty")
    return tuple(out)


def _leaf(value: Any, index: int, what: str) -> Tensor:
    """A fresh tensor with gradients holding ``value``: the caller's tensor keeps its own
    gradient buffers untouched (the values are shared, not copied)."""
    if isinstance(value, Tensor):
        if value.scalar_type not in ("float", "half"):
            raise TypeError(
                f"{what}: argument {index} has dtype {value.dtype!r}; gradients need a float dtype"
            )
        leaf = value.detach().requires_grad_(True)
        return forward_trace.derived(value, leaf, lambda t: t)  # inside jvp: refused at backward
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.ndarray, list, tuple)):
        name = foreign.framework(value)  # ("a Tensor" said nothing of torch)
        kind = f"{name} tensor" if name else type(value).__name__
        fix = f" (pydiff.from_torch(t) for a {name} tensor)" if name else ""
        raise TypeError(
            f"{what}: argument {index} is a {kind}; differentiate with respect "
            f"to pydiff tensors{fix}, NumPy arrays, lists or numbers"
        )
    # bools, complex, None refused (an array of bools was 0/1, a complex one lost .imag)
    wide = differentiated_values(value, f"{what}: argument {index}")
    return make_tensor(to_float32(wide, f"{what}: argument {index}"), requires_grad=True)


def _as_given(grad: Tensor, given: Any) -> Any:
    """The gradient in the form the argument was given: number, array or tensor."""
    if isinstance(given, Tensor):
        return grad
    values = grad.numpy()
    if isinstance(given, numbers.Real):
        return float(values.reshape(-1)[0])
    return values.reshape(np.shape(given))


def value_and_grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, *, _name: str = "value_and_grad"
) -> Callable[..., tuple[Any, Any]]:
    """A function returning ``(fn(*args), gradient)``: the gradient of fn's one-element
    result with respect to the positional arguments ``argnums`` (an int: one gradient; a
    tuple: a tuple of them), each in the form it was given (tensor, NumPy array, number).

    >>> vg = pydiff.value_and_grad(lambda w, x: ops.mean(ops.mul(w, x)), argnums=0)
    >>> loss, gw = vg(w, x)                # loss: a one-element tensor; gw: like w
    """
    if not callable(fn):
        raise TypeError(f"{_name}: fn must be callable, not {type(fn).__name__}")

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        what = f"{_name}({getattr(fn, '__name__', 'fn')})"
        refuse_inside_tape(_name)
        nums = argnum_tuple(argnums, len(args), what)
        leaves = {i: _leaf(args[i], i, what) for i in nums}
        call_args = [
            leaves[i] if i in leaves else as_data(a, f"{what}: argument {i}")
            for i, a in enumerate(args)
        ]
        with Tape(reads_other_tapes=True) as tape:
            out = fn(*call_args, **kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"{what}: fn returned a {type(out).__name__}; it must return a one-element "
                "pydiff tensor (e.g. ops.sum(...) or ops.mean(...))"
            )
        if out.numel != 1:
            raise ValueError(
                f"{what}: fn returned a tensor of shape {out.shape}; grad needs a one-element "
                "result (reduce it with ops.sum or ops.mean)"
            )
        if out.dtype not in ("float", "half"):  # (zeros before: torch refuses it too)
            raise TypeError(
                f"{what}: fn returned a tensor of dtype {out.dtype}, which has no derivative; "
                "return a float result (the loss before any rounding or conversion to int)"
            )
        out = on_tape(out, tape, list(leaves.values()))
        refuse_copied(out, what)
        if out.requires_grad and out.producer is tape:
            # Closed-over tensors get gradients too, but not inside another backward (a
            # Function's): there they lend their buffers (their sums and upstream gradients
            # are that backward's), and this backward is one of its own.
            own = list(leaves.values())
            lend = lent_grads(tape, own) if active_scope() is not None else nullcontext()
            with lend, separate_backward():
                # Once only: forgotten at once, its tensors are freed without the cycle
                # collector.
                tape.backward(out, retain_graph=False)
        grads = tuple(_as_given(leaves[i].grad, args[i]) for i in nums)
        single = isinstance(argnums, numbers.Integral)
        return out, grads[0] if single else grads

    return run


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0) -> Callable[..., Any]:
    """The gradient function of ``fn`` (see ``value_and_grad``): returns only the gradient.

    >>> dsq = pydiff.grad(lambda x: ops.sum(ops.mul(x, x)))
    >>> dsq(np.array([1.0, -3.0]))         # array([ 2., -6.], dtype=float32)
    """
    both = value_and_grad(fn, argnums, _name="grad")

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return both(*args, **kwargs)[1]

    return run
