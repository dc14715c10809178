"""Training ops on pydiff tensors, run by pydiff's Slang library and recorded on the tape.

    with pydiff.Tape() as tape:
        h = ops.relu(ops.linear(x, W1, b1))
        loss = ops.cross_entropy(ops.linear(h, W2, b2), labels)
    tape.backward(loss)

Elementwise ops are differentiable Slang functions (Slang autodiff gives the backward);
matmul, linear, reductions and cross_entropy are pydiff.Functions whose backward runs the
same product/reduction kernels (no atomics). See shaders/ops/*.slang for the math.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import slangpy as spy

from .device import Device
from .function import Function
from .module import Module, load_module
from .tensor import Tensor, empty, zeros

_libraries: dict[int, Module] = {}


def library(device: Device) -> Module:
    """pydiff's own shader library (shaders/pydiff.slang) on ``device``."""
    key = id(device.native)
    if key not in _libraries:
        _libraries[key] = load_module("pydiff.slang", device=device)
    return _libraries[key]


def _device_of(*values: Any) -> Device:
    for v in values:
        if isinstance(v, Tensor):
            return v.device
    raise TypeError("expected at least one pydiff.Tensor argument")


def _check_broadcast(name: str, *values: Any) -> None:
    shapes = [v.shape for v in values if isinstance(v, Tensor)]
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        raise ValueError(f"{name}: shapes {' and '.join(map(str, shapes))} do not broadcast") from None


def _elementwise(slang_name: str, name: str):
    def op(*args: Any) -> Tensor:
        _check_broadcast(name, *args)
        lib = library(_device_of(*args))
        return getattr(lib, slang_name)(*args, _result="tensor")

    op.__name__ = name
    op.__doc__ = f"Elementwise {name} (Slang: {slang_name} in shaders/ops/elementwise.slang).\n\n    >>> y = pydiff.ops.{name}(x)\n"
    return op


add = _elementwise("op_add", "add")
sub = _elementwise("op_sub", "sub")
mul = _elementwise("op_mul", "mul")
div = _elementwise("op_div", "div")
neg = _elementwise("op_neg", "neg")
exp = _elementwise("op_exp", "exp")
log = _elementwise("op_log", "log")
sqrt = _elementwise("op_sqrt", "sqrt")
sin = _elementwise("op_sin", "sin")
cos = _elementwise("op_cos", "cos")
tanh = _elementwise("op_tanh", "tanh")
sigmoid = _elementwise("op_sigmoid", "sigmoid")
relu = _elementwise("op_relu", "relu")
gelu = _elementwise("op_gelu", "gelu")
silu = _elementwise("op_silu", "silu")
swiglu = _elementwise("op_swiglu", "swiglu")


def _need_2d(name: str, **tensors: Tensor) -> None:
    for arg, t in tensors.items():
        if not isinstance(t, Tensor) or len(t.shape) != 2 or t.dtype != "float":
            got = t.shape if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: {arg} must be a 2-D float tensor, got {got}")


def _product(kind: str, a: Tensor, b: Tensor, shape: tuple[int, int]) -> Tensor:
    out = empty(shape, device=a.device)
    getattr(library(a.device), kind)(spy.grid(shape), a.detach(), b.detach(), out)
    return out


class _MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _product("mm_nn", a, b, (a.shape[0], b.shape[1]))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        da = _product("mm_nt", g, b, a.shape) if a.requires_grad else None  # g B^T
        db = _product("mm_tn", a, g, b.shape) if b.requires_grad else None  # A^T g
        return da, db


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product of 2-D tensors (M, K) @ (K, N).

    >>> c = pydiff.ops.matmul(a, b)
    """
    _need_2d("matmul", a=a, b=b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: inner dimensions differ: a is {a.shape}, b is {b.shape}")
    return _MatMul.apply(a, b)


class _Linear(Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        y = _product("mm_nt", x, w, (x.shape[0], w.shape[0]))  # x W^T
        if b is not None:
            library(x.device).add_bias(spy.grid(y.shape), y, b.detach())
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = _product("mm_nn", g, w, x.shape) if x.requires_grad else None  # g W
        dw = _product("mm_tn", g, x, w.shape) if w.requires_grad else None  # g^T x
        db = empty((g.shape[1],), device=g.device)
        library(g.device).sum_rows(spy.grid((g.shape[1],)), g.detach(), db)
        return dx, dw, db


class _LinearNoBias(_Linear):
    @staticmethod
    def forward(ctx, x, w):
        return _Linear.forward(ctx, x, w, None)

    @staticmethod
    def backward(ctx, g):
        return _Linear.backward(ctx, g)[:2]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` with weight of shape (out, in), as in PyTorch.

    >>> y = pydiff.ops.linear(x, W, b)       # x (B, in), W (out, in), b (out,)
    """
    _need_2d("linear", x=x, weight=weight)
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear: x has {x.shape[1]} features but weight {weight.shape} expects {weight.shape[1]}"
        )
    if bias is None:
        return _LinearNoBias.apply(x, weight)
    if bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias has shape {bias.shape}, expected ({weight.shape[0]},)")
    return _Linear.apply(x, weight, bias)


def _reduce_all(x: Tensor, scale: float) -> Tensor:
    """scale * sum(x) as a (1,) tensor, added in a fixed blocked order on the device."""
    out = empty((1,), device=x.device)
    library(x.device).sum_rows(spy.grid((1,)), x.detach().reshape((x.numel, 1)), out)
    if scale != 1.0:
        out.copy_from_numpy(out.numpy() * scale)
    return out


class _Sum(Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.shape, ctx.scale = x.shape, scale
        return _reduce_all(x, scale)

    @staticmethod
    def backward(ctx, g):
        return np.full(ctx.shape, float(g.numpy().reshape(-1)[0]) * ctx.scale)


def sum(x: Tensor) -> Tensor:  # noqa: A001 - the name users expect
    """Sum of all elements as a (1,) tensor, added in a fixed blocked order.

    >>> total = pydiff.ops.sum(x)
    """
    return _Sum.apply(x, 1.0)


def mean(x: Tensor) -> Tensor:
    """Mean of all elements as a (1,) tensor.

    >>> m = pydiff.ops.mean(x)
    """
    return _Sum.apply(x, 1.0 / x.numel)


def mse_loss(prediction: Tensor, target: Tensor) -> Tensor:
    """Mean squared error, a (1,) tensor.

    >>> loss = pydiff.ops.mse_loss(y, target)
    """
    if prediction.shape != target.shape:
        raise ValueError(f"mse_loss: prediction {prediction.shape} and target {target.shape} differ")
    d = sub(prediction, target)
    return mean(mul(d, d))


class _CrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, labels):
        ctx.save_for_backward(logits, labels)
        lib = library(logits.device)
        rows = lib.cross_entropy_rows(
            spy.grid((logits.shape[0],)), logits.detach(), labels, _result="tensor"
        )
        return _reduce_all(rows, 1.0 / logits.shape[0])

    @staticmethod
    def backward(ctx, g):
        logits, labels = ctx.saved_tensors
        batch = logits.shape[0]
        per_row = zeros((batch,), device=logits.device).fill(float(g.numpy().reshape(-1)[0]) / batch)
        dz = empty(logits.shape, device=logits.device)
        library(logits.device).cross_entropy_rows_bwd(
            spy.grid(logits.shape), logits.detach(), labels, per_row, dz
        )
        return dz, None


def cross_entropy(logits: Tensor, labels: Any) -> Tensor:
    """Mean softmax cross-entropy of (B, C) logits against B integer labels; log-sum-exp stable.

    >>> loss = pydiff.ops.cross_entropy(logits, labels)     # labels: ints in [0, C)
    """
    _need_2d("cross_entropy", logits=logits)
    lab = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    if lab.shape != (logits.shape[0],):
        raise ValueError(f"cross_entropy: labels have shape {lab.shape}, expected ({logits.shape[0]},)")
    if lab.size and (lab.min() < 0 or lab.max() >= logits.shape[1]):
        raise ValueError(f"cross_entropy: labels must lie in [0, {logits.shape[1]}), got {lab.min()}..{lab.max()}")
    if not isinstance(labels, Tensor) or labels.dtype != "int":
        from .tensor import tensor

        labels = tensor(lab.astype(np.int32), device=logits.device)
    return _CrossEntropy.apply(logits, labels)


def log_softmax(logits: Tensor) -> Tensor:
    """Row-wise log-softmax of a (B, C) tensor (forward only for now; no gradient).

    >>> logp = pydiff.ops.log_softmax(logits)
    """
    _need_2d("log_softmax", logits=logits)
    out = empty(logits.shape, device=logits.device)
    library(logits.device).log_softmax_rows(spy.grid(logits.shape), logits.detach(), out)
    return out


def softmax(logits: Tensor) -> Tensor:
    """Row-wise softmax of a (B, C) tensor (forward only for now; no gradient).

    >>> p = pydiff.ops.softmax(logits)
    """
    return exp(log_softmax(logits))


class _RMSNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        lib = library(x.device)
        batch = x.shape[0]
        inv_rms = empty((batch,), device=x.device)
        lib.rms_norm_inv(spy.grid((batch,)), x.detach(), float(eps), inv_rms)
        y = empty(x.shape, device=x.device)
        lib.rms_norm_apply(spy.grid(x.shape), x.detach(), inv_rms, weight.detach(), y)
        ctx.save_for_backward(x, weight, inv_rms)  # inv_rms saved: no recomputation
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, inv_rms = ctx.saved_tensors
        lib = library(x.device)
        dx = empty(x.shape, device=x.device)
        lib.rms_norm_dx(spy.grid(x.shape), x.detach(), inv_rms, weight.detach(), g.detach(), dx)
        dw = empty(weight.shape, device=x.device)
        lib.rms_norm_dw(spy.grid(weight.shape), x.detach(), inv_rms, g.detach(), dw)
        return dx, dw


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dimension of a (B, N) tensor, scaled by ``weight`` (N,).

    >>> y = pydiff.ops.rms_norm(x, w, eps=1e-6)
    """
    _need_2d("rms_norm", x=x)
    if not isinstance(weight, Tensor) or weight.shape != (x.shape[1],):
        got = weight.shape if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[1]},), got {got}")
    if eps <= 0:
        raise ValueError(f"rms_norm: eps={eps} must be positive")
    return _RMSNorm.apply(x, weight, eps)
