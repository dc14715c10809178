"""Training ops on pydiff tensors, run by pydiff's Slang library and recorded on the tape.

    with pydiff.Tape() as tape:
        h = ops.relu(ops.linear(x, W1, b1))
        loss = ops.cross_entropy(ops.linear(h, W2, b2), labels)
    tape.backward(loss)

Elementwise ops are differentiable Slang functions (Slang autodiff gives the backward);
matmul, linear, attention, reductions, cross_entropy, softmax, the norms and dropout are
pydiff.Functions whose backward runs the same product/reduction kernels (no atomics). See
shaders/ops/*.slang for the math. The ops live in ``ops_elementwise``, ``ops_linear``,
``ops_attention``, ``ops_reduce``, ``ops_norm`` and ``ops_random``, over the kernels of
``products``; this module is their public face.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from . import foreign
from .module import library
from .ops_elementwise import (
    add,
    cos,
    div,
    exp,
    gelu,
    log,
    mul,
    neg,
    relu,
    sigmoid,
    silu,
    sin,
    sqrt,
    sub,
    swiglu,
    tanh,
)
from .ops_attention import attention
from .ops_linear import ACTIVATIONS, linear, matmul
from .ops_norm import layer_norm, log_softmax, rms_norm, silu_and_mul, softmax
from .ops_random import dropout
from .ops_reduce import cross_entropy, mean, mse_loss, sum


def _accepting_torch(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op``, also callable with torch tensors (torch tensors out, torch autograd)."""

    @functools.wraps(op)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "torch" in sys.modules and (call := foreign.handler(args, kwargs)) is not None:
            return call(op, args, kwargs)
        return op(*args, **kwargs)

    return run


for _name in (
    "add attention cos cross_entropy div dropout exp gelu layer_norm linear log log_softmax matmul "
    "mean mse_loss mul neg relu rms_norm sigmoid silu silu_and_mul sin softmax sqrt sub sum "
    "swiglu tanh"
).split():
    globals()[_name] = _accepting_torch(globals()[_name])
del _name

__all__ = [
    "ACTIVATIONS",
    "add",
    "attention",
    "cos",
    "cross_entropy",
    "div",
    "dropout",
    "exp",
    "gelu",
    "layer_norm",
    "library",
    "linear",
    "log",
    "log_softmax",
    "matmul",
    "mean",
    "mse_loss",
    "mul",
    "neg",
    "relu",
    "rms_norm",
    "sigmoid",
    "silu",
    "silu_and_mul",
    "sin",
    "softmax",
    "sqrt",
    "sub",
    "sum",
    "swiglu",
    "tanh",
]
