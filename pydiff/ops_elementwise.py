"""Elementwise ops: differentiable Slang functions of shaders/ops/elementwise.slang, vectorised
by SlangPy with NumPy broadcasting and recorded on the tape; relu on float4 kernels.

    y = ops_elementwise.add(a, b)
    h = ops_elementwise.relu(x)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .creation import empty, zeros
from .function import Function
from .module import library
from .ops_args import check_broadcast, need_float, same_device
from .products import elementwise_kernel
from .tensor import Tensor, float4_ready


def _elementwise(slang_name: str, name: str, params: tuple[str, ...] = ("x",)):
    def op(*args: Any) -> Tensor:
        need_float(name, **{p: a for p, a in zip(params, args)})
        check_broadcast(name, *args)
        lib = library(same_device(name, **{f"argument {k}": a for k, a in enumerate(args)}))
        return getattr(lib, slang_name)(*args, _result="tensor")

    op.__name__ = name
    op.__doc__ = (
        f"Elementwise {name} (Slang: {slang_name} in shaders/ops/elementwise.slang).\n\n"
        f"    >>> y = pydiff.ops.{name}(x)\n"
    )
    return op


add = _elementwise("op_add", "add", ("a", "b"))
sub = _elementwise("op_sub", "sub", ("a", "b"))
mul = _elementwise("op_mul", "mul", ("a", "b"))
div = _elementwise("op_div", "div", ("a", "b"))
neg = _elementwise("op_neg", "neg")
exp = _elementwise("op_exp", "exp")
log = _elementwise("op_log", "log")
sqrt = _elementwise("op_sqrt", "sqrt")
sin = _elementwise("op_sin", "sin")
cos = _elementwise("op_cos", "cos")
tanh = _elementwise("op_tanh", "tanh")
sigmoid = _elementwise("op_sigmoid", "sigmoid")
_relu_slang = _elementwise("op_relu", "relu")


class _Relu(Function):
    @staticmethod
    def forward(ctx, x):
        y = empty(x.shape, device=x.device)
        elementwise_kernel("relu4", x, x=x, y=y)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if not float4_ready(g):
            return np.where(x.numpy() > 0, g.numpy(), 0.0)
        target = ctx.grad_target(0) if float4_ready(x.grad_out) else None
        if target is not None:
            elementwise_kernel("relu_bwd_acc4", x, x=x, g=g, dx=target, dx_in=target)
            return None
        dx = zeros(x.shape, device=x.device)
        elementwise_kernel("relu_bwd_acc4", x, x=x, g=g, dx=dx, dx_in=dx)
        return dx


def relu(x: Tensor) -> Tensor:
    """Elementwise max(x, 0); its derivative at 0 is 0 (PyTorch's subgradient).

    >>> y = pydiff.ops.relu(x)
    """
    need_float("relu", x=x)
    if isinstance(x, Tensor) and float4_ready(x):
        return _Relu.apply(x)
    return _relu_slang(x)


gelu = _elementwise("op_gelu", "gelu")
silu = _elementwise("op_silu", "silu")
swiglu = _elementwise("op_swiglu", "swiglu", ("gate", "up"))
