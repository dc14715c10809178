"""Elementwise ops: differentiable Slang functions of shaders/ops/elementwise.slang, vectorised
by SlangPy with NumPy broadcasting and recorded on the tape; relu on float4 kernels.

    y = ops_elementwise.add(a, b)
    h = ops_elementwise.relu(x)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import forward_trace
from .creation import empty, tensor, zeros
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
        fn = getattr(lib, slang_name)
        if forward_trace.active() is None:
            return fn(*args, _result="tensor")
        rule = lambda ts, y: _JVP[name](*args, *ts, y)  # noqa: E731
        return forward_trace.with_rule(lambda: fn(*args, _result="tensor"), rule, args)

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
    def jvp(ctx, t):
        return mul(t, relu_mask(ctx.saved_tensors[0]))

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


# --- forward mode: the tangent of each op from its arguments' (None: zero), written with the
# ops themselves so that under a tape it records and hvp differentiates it again.


def add_tangents(a: Any, b: Any, y: Tensor) -> Any:
    """a + b, either None (zero), broadcast to the result ``y``'s shape (forward-mode rules)."""
    t = b if a is None else a if b is None else add(a, b)
    if t is None or t.shape == y.shape:
        return t
    return add(t, zeros(y.shape, device=y.device))


def relu_mask(x: Tensor) -> Tensor:
    """1 where x > 0, else 0: relu's derivative as a constant tensor (forward-mode rules)."""
    return tensor((x.numpy() > 0).astype(np.float32), device=x.device)


def dsilu(x: Any) -> Tensor:
    """silu'(x) by the ops."""
    s = sigmoid(x)
    return mul(s, add(1.0, mul(x, sub(1.0, s))))  # s (1 + x (1 - s))


def dgelu(x: Any) -> Tensor:
    """gelu'(x) (tanh form) by the ops."""
    k = 2.0 * 0.7978845608028654  # gelu = x sigmoid(2u), 2u = k (x + 0.044715 x^3)
    x2 = mul(x, x)
    s = sigmoid(mul(mul(x, add(1.0, mul(x2, 0.044715))), k))
    du = mul(add(1.0, mul(x2, 3 * 0.044715)), k)
    return add(s, mul(mul(x, du), mul(s, sub(1.0, s))))


def _times(t: Any, d: Any) -> Any:
    return None if t is None else mul(t, d)


_JVP = {
    "add": lambda a, b, ta, tb, y: add_tangents(ta, tb, y),
    "sub": lambda a, b, ta, tb, y: add_tangents(ta, None if tb is None else neg(tb), y),
    "mul": lambda a, b, ta, tb, y: add_tangents(_times(ta, b), _times(tb, a), y),
    "div": lambda a, b, ta, tb, y: add_tangents(
        None if ta is None else div(ta, b), None if tb is None else neg(div(mul(tb, y), b)), y
    ),
    "neg": lambda x, t, y: neg(t),
    "exp": lambda x, t, y: mul(t, y),
    "log": lambda x, t, y: div(t, x),
    "sqrt": lambda x, t, y: div(mul(t, 0.5), y),
    "sin": lambda x, t, y: mul(t, cos(x)),
    "cos": lambda x, t, y: neg(mul(t, sin(x))),
    "tanh": lambda x, t, y: mul(t, sub(1.0, mul(y, y))),
    "sigmoid": lambda x, t, y: mul(t, mul(y, sub(1.0, y))),
    "relu": lambda x, t, y: mul(t, relu_mask(x)),
    "gelu": lambda x, t, y: mul(t, dgelu(x)),
    "silu": lambda x, t, y: mul(t, dsilu(x)),
    "swiglu": lambda g, u, tg, tu, y: add_tangents(
        _times(tg, mul(dsilu(g), u)), _times(tu, silu(g)), y
    ),
}
