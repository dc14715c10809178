"""Matrix products: matmul and linear (fused bias and relu), whose backward passes are the
same product kernels (no atomics), adding into the gradient buffers in place where the
kernels fit.

    c = ops_linear.matmul(a, b)
    y = ops_linear.linear(x, W, b, activation="relu")
"""

from __future__ import annotations

from typing import Any

from .function import Function
from .ops_args import need_2d, need_float, need_vector, same_device
from .ops_elementwise import add_tangents, mul, relu_mask
from .ops_reduce import CE_PRODUCER_FUSIONS, sum_mid
from .products import (
    blocking,
    fast_product,
    linear_backward_narrow,
    narrow_fits,
    product,
    relu_masked,
)
from .tensor import Tensor, float4_ready

ACTIVATIONS = (None, "relu")


class _MatMul(Function):
    flush_before_backward = False  # kernels only

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return product("mm_nn", a, b, (a.shape[0], b.shape[1]))

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors  # dA B + A dB
        ab = None if ta is None else _MatMul.apply(ta, b)
        return add_tangents(ab, None if tb is None else _MatMul.apply(a, tb), ctx.outputs[0])

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        da = product("mm_nt", g, b, a.shape) if a.requires_grad else None  # g B^T
        db = product("mm_tn", a, g, b.shape) if b.requires_grad else None  # A^T g
        return da, db


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product of 2-D tensors (M, K) @ (K, N).

    >>> c = pydiff.ops.matmul(a, b)
    """
    need_2d("matmul", a=a, b=b)
    same_device("matmul", a=a, b=b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: inner dimensions differ: a is {a.shape}, b is {b.shape}")
    return _MatMul.apply(a, b)


# The bias gradient is summed inside the dW product (one sum per column, in dW's own order:
# sequential, or split over K on a GPU) up to this many rows; above, by the pairwise
# column-sum kernel.
_FUSED_DB_MAX_ROWS = 4096


def _in_place_fits(ctx: Any, g: Tensor, x: Tensor, w: Tensor, has_bias: bool, *more) -> bool:
    """The in-place kernels take this layer: the products' shapes, float4 layouts of g, x, w
    (and ``more``) and of the gradient buffers of the inputs that want one."""
    batch, n_out = g.shape
    n_in = x.shape[1]
    if not (
        blocking("mm_nn", batch, n_in, n_out)
        and blocking("mm_tn", n_out, n_in, batch)
        and float4_ready(g, x, w, *more)
    ):
        return False
    inputs = [x, w] + ([ctx.inputs[2]] if has_bias else [])
    for t in inputs:  # (a loop, as all() of a generator: grad_out read in order, up to a miss)
        if t.requires_grad and not float4_ready(t.grad_out):
            return False
    return True


def _linear_backward_in_place(
    ctx: Any, g: Tensor, x: Tensor, w: Tensor, has_bias: bool, mask: Tensor | None = None
) -> bool:
    """Add dx = g' W, dW = g'^T x and db = column sums of g' straight into the gradient
    buffers with the specialised kernels (no temporaries, no separate accumulation), where
    g' = g * [mask > 0] (the relu of a fused linear + relu) or g. False, with nothing done,
    when they do not fit."""
    batch, n_out = g.shape
    if not _in_place_fits(ctx, g, x, w, has_bias, *([mask] if mask is not None else [])):
        return False
    wants_db = has_bias and ctx.inputs[2].requires_grad
    fuse_db = wants_db and w.requires_grad and batch <= _FUSED_DB_MAX_ROWS
    if mask is not None and wants_db and not fuse_db:
        return False  # the column-sum kernel reads g unmasked: the caller masks g first
    dx, dw = ctx.grad_target(0), ctx.grad_target(1)
    db = ctx.grad_target(2) if has_bias else None
    if (
        dw is not None
        and (db is None or fuse_db)
        and linear_backward_narrow(g, x, w, dx, dw, db, mask=mask)
    ):
        return True
    if dx is not None:
        fast_product("mm_nn", g, w, dx, 1.0, mask=mask)
    if dw is not None:
        fast_product("mm_tn", g, x, dw, 1.0, mask=mask, db=db if fuse_db else None)
    if db is not None and not fuse_db:
        kernel = g.device.kernels.get("ops/reduce.slang", "column_sums_acc")
        g.device.kernels.dispatch(kernel, n_out, g=g.buffer, dst=db.buffer, M=batch, N=n_out)
    return True


def _linear_backward(g: Tensor, x: Tensor, w: Tensor, has_bias: bool) -> tuple:
    """dx = g W, dW = g^T x (and db = column sums of g) as new tensors."""
    dx = product("mm_nn", g, w, x.shape) if x.requires_grad else None
    dw = product("mm_tn", g, x, w.shape) if w.requires_grad else None
    if not has_bias:
        return dx, dw
    db = sum_mid(g.detach().reshape((1,) + g.shape), 1.0).reshape((g.shape[1],))
    return dx, dw, db


class _Linear(Function):
    flush_before_backward = False  # kernels only

    @staticmethod
    def forward(ctx, x, w, b, activation=None):
        relu = activation == "relu"
        y = product("mm_nt", x, w, (x.shape[0], w.shape[0]), bias=b, relu=relu)  # x W^T + b
        ctx.save_for_backward(x, w, y if relu else None)
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def jvp(ctx, *tangents):
        """dx W^T + x dW^T + db, times relu's mask (y > 0) for activation="relu"."""
        x, w, act, y = ctx.args[0], ctx.args[1], ctx.args[-1], ctx.outputs[0]
        tx, tw, tb = tangents[0], tangents[1], tangents[2] if len(tangents) == 4 else None
        t = add_tangents(
            None if tx is None else linear(tx, w), None if tw is None else linear(x, tw), y
        )
        t = add_tangents(t, tb, y)
        return t if act is None or t is None else mul(t, relu_mask(y))

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        nones = (None,) * (3 if ctx.has_bias else 2)
        if _linear_backward_in_place(ctx, g, x, w, ctx.has_bias, mask=y):
            return nones
        if y is not None:
            g = relu_masked(g, y)
            if _linear_backward_in_place(ctx, g, x, w, ctx.has_bias):
                return nones
        return _linear_backward(g, x, w, ctx.has_bias)


class _LinearNoBias(_Linear):
    @staticmethod
    def forward(ctx, x, w, activation=None):
        return _Linear.forward(ctx, x, w, None, activation)


def _fuse_cross_entropy(claim: Any, logits: Tensor, labels: Tensor, lse: Tensor, gl, dz) -> bool:
    """The backward of a linear layer (no activation) whose output only a cross-entropy read,
    and that cross-entropy's, in one dispatch: the narrow kernel makes the logits' gradient
    itself (the same bits as the two kernels). False, with nothing done, where the layer's
    own backward would not take that kernel."""
    ctx = claim.ctx
    x, w, y = ctx.saved_tensors
    batch, n_out = logits.shape
    has_bias = ctx.has_bias
    if (
        y is not None
        or not w.requires_grad
        or not narrow_fits(batch, x.shape[1], n_out, logits.device)
        or not _in_place_fits(ctx, logits, x, w, has_bias)
    ):
        return False
    dx, dw = ctx.grad_target(0), ctx.grad_target(1)
    db = ctx.grad_target(2) if has_bias else None
    buffers = {"z": logits.buffer, "labels": labels.buffer, "lse": lse.buffer}
    buffers |= {"gl": gl.buffer, "dz": dz.buffer}
    return linear_backward_narrow(logits, x, w, dx, dw, db, cross_entropy=buffers)


CE_PRODUCER_FUSIONS[_Linear] = CE_PRODUCER_FUSIONS[_LinearNoBias] = _fuse_cross_entropy


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None
) -> Tensor:
    """``x @ weight.T + bias`` with weight of shape (out, in), as in PyTorch; with
    ``activation="relu"``, ``relu`` of that, fused into the same kernels (forward and backward).
    x may be 1-D (in,) or N-D (..., in), as in PyTorch: the result is (out,) or (..., out).

    >>> y = pydiff.ops.linear(x, W, b)       # x (B, in), W (out, in), b (out,)
    >>> h = pydiff.ops.linear(x, W, b, activation="relu")   # = relu(linear(x, W, b))
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation={activation!r}; expected one of {ACTIVATIONS}")
    if isinstance(x, Tensor) and len(x.shape) != 2 and len(x.shape) >= 1:
        return _linear_rows(x, weight, bias, activation)
    if not isinstance(x, Tensor) or not x.shape:  # ("must be a 2-D float tensor" misled)
        need_float("linear", x=x)
        got = x.shape if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"linear: x must be a float tensor of shape (in,) or (..., in), got {got}")
    need_2d("linear", x=x, weight=weight)
    need_float("linear", bias=bias)
    same_device("linear", x=x, weight=weight, bias=bias)
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear: x has {x.shape[1]} features but weight {weight.shape} expects "
            f"{weight.shape[1]}"
        )
    if bias is None:
        return _LinearNoBias.apply(x, weight, activation)
    need_vector("linear", "bias", bias, weight.shape[0])
    return _Linear.apply(x, weight, bias, activation)


def _linear_rows(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """``linear`` of a 1-D or N-D x as PyTorch does it: the rows (all but the last axis) made
    one batch axis, the result shaped back; views of the same storage, so gradients flow
    through them (a non-contiguous x is cloned first, also differentiably)."""
    need_float("linear", x=x)
    if not isinstance(weight, Tensor) or len(weight.shape) != 2:
        got = weight.shape if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"linear: weight must be a 2-D float tensor, got {got}")
    features = x.shape[-1]
    if features != weight.shape[1]:
        raise ValueError(
            f"linear: x of shape {x.shape} has {features} features but weight {weight.shape} "
            f"expects {weight.shape[1]}"
        )
    lead = x.shape[:-1]
    if 0 in lead:
        raise ValueError(f"linear: x of shape {x.shape} has no rows")
    rows = x if x.dense else x.clone()
    out = linear(rows.reshape(-1, features), weight, bias, activation)
    return out.reshape(*lead, weight.shape[0])
