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

import math
from typing import Any

import numpy as np
import slangpy as spy

from . import capturing, kernels
from .device import Device
from .function import Function
from .module import Module, load_module
from .tensor import Tensor, empty, tensor, zeros

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
        for k, a in enumerate(args):
            if isinstance(a, Tensor) and a.dtype != "float":
                raise ValueError(f"{name}: argument {k} has dtype {a.dtype}; pydiff.ops work on float tensors")
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
_relu_slang = _elementwise("op_relu", "relu")


class _Relu(Function):
    @staticmethod
    def forward(ctx, x):
        y = empty(x.shape, device=x.device)
        _elementwise_kernel("relu4", x, x=x, y=y)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if not kernels.float4_ready(g):
            return np.where(x.numpy() > 0, g.numpy(), 0.0)
        target = ctx.grad_target(0) if kernels.float4_ready(x.grad_out) else None
        if target is not None:
            _elementwise_kernel("relu_bwd_acc4", x, x=x, g=g, dx=target, dx_in=target)
            return None
        dx = zeros(x.shape, device=x.device)
        _elementwise_kernel("relu_bwd_acc4", x, x=x, g=g, dx=dx, dx_in=dx)
        return dx


def relu(x: Tensor) -> Tensor:
    """Elementwise max(x, 0); its derivative at 0 is 0 (PyTorch's subgradient).

    >>> y = pydiff.ops.relu(x)
    """
    if isinstance(x, Tensor) and x.dtype == "float" and kernels.float4_ready(x):
        return _Relu.apply(x)
    return _relu_slang(x)
gelu = _elementwise("op_gelu", "gelu")
silu = _elementwise("op_silu", "silu")
swiglu = _elementwise("op_swiglu", "swiglu")


def _need_2d(name: str, **tensors: Tensor) -> None:
    for arg, t in tensors.items():
        if not isinstance(t, Tensor) or len(t.shape) != 2 or t.dtype != "float":
            got = t.shape if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: {arg} must be a 2-D float tensor, got {got}")


def _blocking(kind: str, m: int, n: int, k: int) -> tuple[int, int] | None:
    """Rows and columns of C per thread for the fast product kernels, or None when the
    shapes do not fit them (B is read as float4 rows: mm_nt needs K % 4 == 0, the others
    N % 4 == 0). Blocks of up to 128 accumulators: on lavapipe, 8 x 16 blocks beat 8 x 8
    by 10-35% on a training step's products (each load feeds more multiply-adds)."""
    if kind == "mm_nt":
        if k % 4:
            return None
        cols = n if n <= 16 else next(c for c in (16, 8, 4, 2, 1) if n % c == 0)
    else:
        if n % 4:
            return None
        cols = next(c for c in (16, 8, 4) if n % c == 0)
    budget = _BLOCK_ACCUMULATORS // cols
    rows = next((r for r in (16, 8, 4) if m % r == 0 and r <= budget), None)
    if rows is None:  # e.g. 10 rows: 5 per thread rather than 2
        rows = next(r for r in range(min(16, budget, m), 0, -1) if m % r == 0)
    return rows, cols


_BLOCK_ACCUMULATORS = 128


def _fast_product(kind: str, a: Tensor, b: Tensor, out: Tensor, beta: float,
                  bias: Tensor | None = None, *, relu: bool = False, mask: Tensor | None = None,
                  db: Tensor | None = None) -> bool:
    """out = beta * out + a (x) b (+ bias, then relu) with the specialised kernels, A read
    through ``mask`` (A * [mask > 0]) and, for mm_tn, ``db`` = beta * db + column sums of
    (masked) A; False, with nothing done, if the kernels do not fit."""
    m, n = out.shape
    k = a.shape[0] if kind == "mm_tn" else a.shape[1]
    block = _blocking(kind, m, n, k)
    extra = [t for t in (bias, mask, db) if t is not None]
    if block is None or not kernels.float4_ready(a, b, out, *extra):
        return False
    rows, cols = block
    a_vec = kind == "mm_nt" or (k % 4 == 0 if kind == "mm_nn" else (m % 4 == 0 and rows % 4 == 0))
    c_vec = beta != 0 and n % 4 == 0 and cols % 4 == 0  # C read back as float4s to add to it
    kernel = kernels.get(a.device, "matmul.slang", kind, M=m, N=n, K=k, RB=rows, CB=cols, TG=32,
                         HAS_BIAS=int(bias is not None), A_VEC=int(a_vec), RELU=int(relu),
                         MASK=int(mask is not None), HAS_DB=int(db is not None), C_VEC=int(c_vec))
    bindings = {"a": a.native.storage, "b": b.native.storage, "c": out.native.storage, "beta": float(beta)}
    if c_vec:
        bindings["c_in"] = out.native.storage
    if kind == "mm_nt":
        bindings["bias"] = (bias if bias is not None else a).native.storage
    if mask is not None:
        bindings["mask"] = mask.native.storage
    if db is not None:
        bindings["db"] = db.native.storage
        db._state.wrote(kind)
    kernels.dispatch(kernel, (m // rows) * (n // cols), **bindings)
    out._state.wrote(kind)
    return True


def _product(kind: str, a: Tensor, b: Tensor, shape: tuple[int, int], bias: Tensor | None = None,
             relu: bool = False) -> Tensor:
    """C = a (x) b per ``kind`` (mm_nn, mm_nt, mm_tn), plus ``bias`` per column and then
    max(C, 0) with ``relu`` (mm_nt)."""
    out = empty(shape, device=a.device)
    if _fast_product(kind, a, b, out, 0.0, bias, relu=relu):
        return out
    getattr(library(a.device), kind)(spy.grid(shape), a.detach(), b.detach(), out)
    if bias is not None:
        library(a.device).add_bias(spy.grid(shape), out, bias.detach())
    return _relu_slang(out) if relu else out


def _elementwise_kernel(name: str, count_of: Tensor, **buffers: Tensor) -> None:
    count = -(-count_of.numel // 4)
    kernels.dispatch(kernels.get(count_of.device, "elementwise.slang", name), count,
                     count=count, **{k: t.native.storage for k, t in buffers.items()})


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


# The bias gradient is summed inside the dW product (one sequential sum per column, like
# dW's own) up to this many rows; above, by the pairwise column-sum kernel.
_FUSED_DB_MAX_ROWS = 4096


def _linear_backward_in_place(ctx: Any, g: Tensor, x: Tensor, w: Tensor, has_bias: bool,
                              mask: Tensor | None = None) -> bool:
    """Add dx = g' W, dW = g'^T x and db = column sums of g' straight into the gradient
    buffers with the specialised kernels (no temporaries, no separate accumulation), where
    g' = g * [mask > 0] (the relu of a fused linear + relu) or g. False, with nothing done,
    when they do not fit."""
    batch, n_out = g.shape
    n_in = x.shape[1]
    if not (_blocking("mm_nn", batch, n_in, n_out) and _blocking("mm_tn", n_out, n_in, batch)
            and kernels.float4_ready(g, x, w, *([mask] if mask is not None else []))):
        return False
    inputs = [x, w] + ([ctx._inputs[2]] if has_bias else [])
    if not all(kernels.float4_ready(t.grad_out) for t in inputs if t.requires_grad):
        return False
    wants_db = has_bias and ctx._inputs[2].requires_grad
    fuse_db = wants_db and w.requires_grad and batch <= _FUSED_DB_MAX_ROWS
    if mask is not None and wants_db and not fuse_db:
        return False  # the column-sum kernel reads g unmasked: the caller masks g first
    dx, dw = ctx.grad_target(0), ctx.grad_target(1)
    db = ctx.grad_target(2) if has_bias else None
    if dx is not None:
        _fast_product("mm_nn", g, w, dx, 1.0, mask=mask)
    if dw is not None:
        _fast_product("mm_tn", g, x, dw, 1.0, mask=mask, db=db if fuse_db else None)
    if db is not None and not fuse_db:
        kernel = kernels.get(g.device, "elementwise.slang", "column_sums_acc")
        kernels.dispatch(kernel, n_out, g=g.native.storage, dst=db.native.storage, M=batch, N=n_out)
    return True


def _linear_backward(g: Tensor, x: Tensor, w: Tensor, has_bias: bool) -> tuple:
    """dx = g W, dW = g^T x (and db = column sums of g) as new tensors."""
    dx = _product("mm_nn", g, w, x.shape) if x.requires_grad else None
    dw = _product("mm_tn", g, x, w.shape) if w.requires_grad else None
    if not has_bias:
        return dx, dw
    db = _sum_mid(g.detach().reshape((1,) + g.shape), 1.0).reshape((g.shape[1],))
    return dx, dw, db


def _relu_masked(g: Tensor, y: Tensor) -> Tensor:
    """g * [y > 0] as a new tensor (the relu backward, for the unfused paths)."""
    if kernels.float4_ready(g, y):
        gz = zeros(g.shape, device=g.device)
        _elementwise_kernel("relu_bwd_acc4", y, x=y, g=g, dx=gz, dx_in=gz)
        return gz
    return tensor(np.where(y.numpy() > 0, g.numpy(), 0.0).astype(np.float32), device=g.device)


class _Linear(Function):
    @staticmethod
    def forward(ctx, x, w, b, activation=None):
        relu = activation == "relu"
        y = _product("mm_nt", x, w, (x.shape[0], w.shape[0]), bias=b, relu=relu)  # x W^T + b
        ctx.save_for_backward(x, w, y if relu else None)
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        nones = (None,) * (3 if ctx.has_bias else 2)
        if _linear_backward_in_place(ctx, g, x, w, ctx.has_bias, mask=y):
            return nones
        if y is not None:
            g = _relu_masked(g, y)
            if _linear_backward_in_place(ctx, g, x, w, ctx.has_bias):
                return nones
        return _linear_backward(g, x, w, ctx.has_bias)


class _LinearNoBias(_Linear):
    @staticmethod
    def forward(ctx, x, w, activation=None):
        return _Linear.forward(ctx, x, w, None, activation)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """``x @ weight.T + bias`` with weight of shape (out, in), as in PyTorch; with
    ``activation="relu"``, ``relu`` of that, fused into the same kernels (forward and backward).

    >>> y = pydiff.ops.linear(x, W, b)       # x (B, in), W (out, in), b (out,)
    >>> h = pydiff.ops.linear(x, W, b, activation="relu")   # = relu(linear(x, W, b))
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"linear: activation={activation!r}; expected one of {_ACTIVATIONS}")
    _need_2d("linear", x=x, weight=weight)
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear: x has {x.shape[1]} features but weight {weight.shape} expects {weight.shape[1]}"
        )
    if bias is None:
        return _LinearNoBias.apply(x, weight, activation)
    if bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias has shape {bias.shape}, expected ({weight.shape[0]},)")
    return _Linear.apply(x, weight, bias, activation)


_ACTIVATIONS = (None, "relu")


def _rows(name: str, x: Tensor) -> Tensor:
    """``x`` as a 2-D (rows, last dim) view, for the ops that work along the last dimension."""
    if not isinstance(x, Tensor) or x.dtype != "float" or len(x.shape) < 1:
        got = x.shape if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a float tensor with at least 1 dimension, got {got}")
    if x.numel == 0:
        raise ValueError(f"{name}: the tensor {x.shape} is empty")
    return x.detach().reshape((x.numel // x.shape[-1], x.shape[-1]))


# A reduction over n elements runs as ceil(n / chunk) threads per output, then once more over
# the partial sums: enough threads to keep the device busy, each adding at least _MIN_CHUNK.
_MIN_CHUNK, _TARGET_THREADS = 256, 1024


def _sum_mid(x3: Tensor, scale: float) -> Tensor:
    """out[o, 0, j] = scale * sum_k x3[o, k, j], pairwise and in a fixed order, on the device."""
    lib = library(x3.device)
    outer, n, inner = x3.shape
    while True:
        chunks = max(1, min(-(-n // _MIN_CHUNK), -(-_TARGET_THREADS // (outer * inner))))
        chunk = -(-n // chunks)
        chunks = -(-n // chunk)
        out = empty((outer, chunks, inner), device=x3.device)
        lib.reduce_mid(spy.grid(out.shape), x3, chunk, float(scale if chunks == 1 else 1.0), out)
        if chunks == 1:
            return out
        x3, n = out, chunks


def _axis_view(name: str, x: Tensor, axis: int | None) -> tuple[Tensor, tuple[int, ...], int]:
    """(x as an (outer, n, inner) view, the result shape with the axis kept as 1, n)."""
    if not isinstance(x, Tensor) or x.dtype != "float":
        got = f"a tensor of dtype {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a float pydiff.Tensor, got {got}")
    shape = x.shape if x.shape else (1,)
    if axis is None:
        return x.detach().reshape((1, x.numel, 1)), (1,), x.numel
    if not isinstance(axis, (int, np.integer)) or not -len(shape) <= axis < len(shape):
        raise ValueError(f"{name}: axis={axis!r} is out of range for a tensor of shape {x.shape}")
    axis = int(axis) % len(shape)
    outer, n = math.prod(shape[:axis]), shape[axis]
    kept = shape[:axis] + (1,) + shape[axis + 1:]
    return x.detach().reshape((outer, n, x.numel // max(outer * n, 1))), kept, n


class _Sum(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdims, mean):
        x3, kept, n = _axis_view("mean" if mean else "sum", x, axis)
        if n == 0:
            raise ValueError(f"{'mean' if mean else 'sum'}: axis {axis} of {x.shape} is empty")
        ctx.x3_shape, ctx.x_shape, ctx.scale = x3.shape, x.shape, (1.0 / n if mean else 1.0)
        total = _sum_mid(x3, ctx.scale)
        if axis is None:
            # all elements: (1,), or NumPy's all-ones shape with keepdims
            return total.reshape((1,) * max(len(x.shape), 1) if keepdims else (1,))
        shape = kept if keepdims else tuple(d for k, d in enumerate(kept) if k != int(axis) % len(kept))
        return total.reshape(shape or (1,))  # pydiff has no 0-d results: a lone number is (1,)

    @staticmethod
    def backward(ctx, g):
        outer, n, inner = ctx.x3_shape
        dx = empty(ctx.x_shape, device=g.device)
        library(g.device).broadcast_mid(
            spy.grid(ctx.x3_shape), g.detach().reshape((outer, 1, inner)), float(ctx.scale),
            dx.reshape(ctx.x3_shape),
        )
        return dx


def sum(x: Tensor, axis: int | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over all elements (a (1,) tensor) or over ``axis``, pairwise in a fixed order.
    NumPy's axis/keepdims rules, except that a result NumPy gives as a 0-d scalar is (1,).

    >>> total = pydiff.ops.sum(x)             # shape (1,)
    >>> col = pydiff.ops.sum(x, axis=0)       # NumPy's axis/keepdims rules
    """
    return _Sum.apply(x, axis, keepdims, False)


def mean(x: Tensor, axis: int | None = None, keepdims: bool = False) -> Tensor:
    """Mean over all elements (a (1,) tensor) or over ``axis``.

    >>> m = pydiff.ops.mean(x, axis=-1, keepdims=True)
    """
    return _Sum.apply(x, axis, keepdims, True)


def mse_loss(prediction: Tensor, target: Tensor) -> Tensor:
    """Mean squared error, a (1,) tensor.

    >>> loss = pydiff.ops.mse_loss(y, target)
    """
    if prediction.shape != target.shape:
        raise ValueError(f"mse_loss: prediction {prediction.shape} and target {target.shape} differ")
    d = sub(prediction, target)
    return mean(mul(d, d))


def _ce_fast(logits: Tensor, labels: Tensor) -> bool:
    """The two-kernel cross-entropy applies: Vulkan, contiguous float logits and int labels."""
    n = labels.native
    return (kernels.float4_ready(logits) and labels.dtype == "int" and n.offset == 0
            and n.is_contiguous())


class _CrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, labels):
        batch = logits.shape[0]
        if _ce_fast(logits, labels):
            lse, loss = empty((batch,), device=logits.device), empty((1,), device=logits.device)
            kernel = kernels.get(logits.device, "cross_entropy.slang", "ce_forward")
            kernels.dispatch(kernel, 256, z=logits.native.storage, labels=labels.native.storage,
                             lse=lse.native.storage, loss=loss.native.storage, B=batch, C=logits.shape[1])
            ctx.save_for_backward(logits, labels, lse)
            return loss
        lib = library(logits.device)
        lse, rows = empty((batch,), device=logits.device), empty((batch,), device=logits.device)
        lib.cross_entropy_rows(spy.grid((batch,)), logits.detach(), labels, lse, rows)
        ctx.save_for_backward(logits, labels, lse)
        return _sum_mid(rows.reshape((1, batch, 1)), 1.0 / batch).reshape((1,))

    @staticmethod
    def backward(ctx, g):
        logits, labels, lse = ctx.saved_tensors
        if _ce_fast(logits, labels) and kernels.float4_ready(g) and logits.requires_grad and \
                kernels.float4_ready(logits.grad_out):
            target = ctx.grad_target(0)
            count = logits.numel
            kernel = kernels.get(logits.device, "cross_entropy.slang", "ce_backward_acc")
            kernels.dispatch(kernel, count, z=logits.native.storage, labels=labels.native.storage,
                             lse=lse.native.storage, g=g.native.storage, dz=target.native.storage,
                             B=logits.shape[0], C=logits.shape[1])
            return None, None
        dz = empty(logits.shape, device=logits.device)
        library(logits.device).cross_entropy_rows_bwd(
            spy.grid(logits.shape), logits.detach(), labels, lse, g.detach().reshape((1,)),
            1.0 / logits.shape[0], dz,
        )
        return dz, None


def cross_entropy(logits: Tensor, labels: Any) -> Tensor:
    """Mean softmax cross-entropy of (B, C) logits against B integer labels; log-sum-exp stable.

    >>> loss = pydiff.ops.cross_entropy(logits, labels)     # labels: ints in [0, C)
    """
    _need_2d("cross_entropy", logits=logits)
    if isinstance(labels, Tensor) and labels.dtype == "int":
        _check_labels(labels, logits.shape)
        # A captured step re-checks labels copied in since (out-of-range ones would read
        # outside the logits' rows).
        capturing.on_replay(lambda: _check_labels(labels, logits.shape))
        return _CrossEntropy.apply(logits, labels)
    lab = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    _check_label_values(lab, logits.shape)
    return _CrossEntropy.apply(logits, tensor(lab.astype(np.int32), device=logits.device))


def _check_labels(labels: Tensor, logits_shape: tuple) -> None:
    """Range-check an int label tensor on the host, once per version of its values."""
    stamp = (labels._state.version, "labels", logits_shape)
    if labels._state.checked != stamp:
        _check_label_values(labels.numpy(), logits_shape)
        labels._state.checked = stamp


def _check_label_values(lab: np.ndarray, logits_shape: tuple) -> None:
    if lab.size and not np.issubdtype(lab.dtype, np.integer):
        if not np.all(np.isfinite(lab)) or np.any(lab != np.round(lab)):
            raise ValueError(f"cross_entropy: labels must be integer class indices, got {lab.dtype} values")
    if lab.shape != (logits_shape[0],):
        raise ValueError(f"cross_entropy: labels have shape {lab.shape}, expected ({logits_shape[0]},)")
    if lab.size and (lab.min() < 0 or lab.max() >= logits_shape[1]):
        raise ValueError(f"cross_entropy: labels must lie in [0, {logits_shape[1]}), got {lab.min()}..{lab.max()}")


def _softmax_rows(z2: Tensor, scale: float, log_space: bool) -> Tensor:
    lib = library(z2.device)
    lse = empty((z2.shape[0],), device=z2.device)
    lib.softmax_lse(spy.grid((z2.shape[0],)), z2, float(scale), lse)
    out = empty(z2.shape, device=z2.device)
    lib.softmax_apply(spy.grid(z2.shape), z2, float(scale), lse, int(log_space), out)
    return out


def _softmax_rows_bwd(out2: Tensor, g2: Tensor, scale: float, log_space: bool) -> Tensor:
    lib = library(out2.device)
    dots = empty((out2.shape[0],), device=out2.device)
    lib.softmax_row_dot(spy.grid((out2.shape[0],)), g2, out2, int(log_space), dots)
    dz = empty(out2.shape, device=out2.device)
    lib.softmax_bwd(spy.grid(out2.shape), out2, g2, dots, float(scale), int(log_space), dz)
    return dz


class _Softmax(Function):
    @staticmethod
    def forward(ctx, z, log_space):
        ctx.log_space = log_space
        out = _softmax_rows(_rows("log_softmax" if log_space else "softmax", z), 1.0, log_space)
        out = out.reshape(z.shape)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        rows = out.detach().reshape((out.numel // out.shape[-1], out.shape[-1]))
        dz = _softmax_rows_bwd(rows, g.detach().reshape(rows.shape), 1.0, ctx.log_space)
        return dz.reshape(out.shape)


def _check_last_axis(name: str, axis: int, x: Tensor) -> None:
    if isinstance(x, Tensor) and axis not in (-1, len(x.shape) - 1):
        raise ValueError(f"{name}: only the last axis is supported (axis=-1), got axis={axis} for shape {x.shape}")


def log_softmax(logits: Tensor, axis: int = -1) -> Tensor:
    """Log-softmax over the last axis, log-sum-exp stable (finite for logits of +-1e4).

    >>> logp = pydiff.ops.log_softmax(logits)
    """
    _check_last_axis("log_softmax", axis, logits)
    _rows("log_softmax", logits)
    return _Softmax.apply(logits, True)


def softmax(logits: Tensor, axis: int = -1) -> Tensor:
    """Softmax over the last axis, max-subtracted so large logits do not overflow.

    >>> p = pydiff.ops.softmax(logits)
    """
    _check_last_axis("softmax", axis, logits)
    _rows("softmax", logits)
    return _Softmax.apply(logits, False)


class _Attention(Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        p = _softmax_rows(_product("mm_nt", q, k, (q.shape[0], k.shape[0])), scale, False)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, p)  # the probabilities: no recomputation in backward
        return _product("mm_nn", p, v, (q.shape[0], v.shape[1]))

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved_tensors
        dv = _product("mm_tn", p, g, v.shape) if v.requires_grad else None  # P^T dO
        dp = _product("mm_nt", g, v, p.shape)  # dO V^T
        ds = _softmax_rows_bwd(p, dp, ctx.scale, False)  # includes the scale
        dq = _product("mm_nn", ds, k, q.shape) if q.requires_grad else None  # dS K
        dk = _product("mm_tn", ds, q, k.shape) if k.requires_grad else None  # dS^T Q
        return dq, dk, dv


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Scaled dot-product attention softmax(scale * Q K^T) V for 2-D Q (n, d), K (m, d), V (m, e).

    ``scale`` defaults to 1/sqrt(d); ``scale=1.0`` is the unscaled form of the autodiff guide.
    >>> out = pydiff.ops.attention(Q, K, V)          # (n, e)
    """
    _need_2d("attention", q=q, k=k, v=v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"attention: q {q.shape} and k {k.shape} must have the same last dimension")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"attention: k {k.shape} and v {v.shape} must have the same number of rows")
    scale = 1.0 / float(np.sqrt(q.shape[1])) if scale is None else float(scale)
    return _Attention.apply(q, k, v, scale)


class _SiluAndMul(Function):
    @staticmethod
    def forward(ctx, x):
        x2 = _rows("silu_and_mul", x)
        out = empty(x.shape[:-1] + (x.shape[-1] // 2,), device=x.device)
        out2 = out.reshape((x2.shape[0], x2.shape[1] // 2))
        library(x.device).silu_and_mul_fwd(spy.grid(out2.shape), x2, out2)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x2 = _rows("silu_and_mul", x)
        dx = empty(x.shape, device=x.device)
        g2 = g.detach().reshape((x2.shape[0], x2.shape[1] // 2))
        library(x.device).silu_and_mul_bwd(spy.grid(g2.shape), x2, g2, dx.reshape(x2.shape))
        return dx


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(gate) * up where x = [gate | up] splits the last dimension (2H -> H).

    >>> y = pydiff.ops.silu_and_mul(x)        # x (B, 2H) -> y (B, H)
    """
    _rows("silu_and_mul", x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dimension of {x.shape} must be even (gate | up)")
    return _SiluAndMul.apply(x)


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
        c = empty((x.shape[0],), device=x.device)
        lib.rms_norm_bwd_rows(spy.grid((x.shape[0],)), x.detach(), weight.detach(), g.detach(), c)
        dx = empty(x.shape, device=x.device)
        lib.rms_norm_dx(spy.grid(x.shape), x.detach(), inv_rms, weight.detach(), g.detach(), c, dx)
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


class _LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        lib = library(x.device)
        x2 = _rows("layer_norm", x)
        rows, n = x2.shape
        mu, r = empty((rows,), device=x.device), empty((rows,), device=x.device)
        lib.layer_norm_stats(spy.grid((rows,)), x2, float(eps), mu, r)
        w = weight.detach() if weight is not None else _constant(x.device, n, 1.0)
        b = bias.detach() if bias is not None else _constant(x.device, n, 0.0)
        y = empty(x.shape, device=x.device)
        lib.layer_norm_apply(spy.grid(x2.shape), x2, mu, r, w, b, y.reshape(x2.shape))
        ctx.affine = (weight is not None, bias is not None)
        ctx.save_for_backward(x, w, mu, r)  # row statistics saved: no recomputation
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, mu, r = ctx.saved_tensors
        lib = library(x.device)
        x2 = _rows("layer_norm", x)
        g2 = g.detach().reshape(x2.shape)
        c = empty((x2.shape[0], 2), device=x.device)
        lib.layer_norm_bwd_rows(spy.grid((x2.shape[0],)), x2, mu, r, w, g2, c)
        dx = empty(x.shape, device=x.device)
        lib.layer_norm_dx(spy.grid(x2.shape), x2, mu, r, w, g2, c, dx.reshape(x2.shape))
        dw, db = empty((x2.shape[1],), device=x.device), empty((x2.shape[1],), device=x.device)
        lib.layer_norm_dwb(spy.grid((x2.shape[1],)), x2, mu, r, g2, dw, db)
        has_w, has_b = ctx.affine  # one gradient per tensor input: None inputs are not counted
        return (dx,) + ((dw,) if has_w else ()) + ((db,) if has_b else ())


_constants: dict[tuple[int, int, float], Tensor] = {}


def _constant(device: Device, n: int, value: float) -> Tensor:
    key = (id(device.native), n, value)
    if key not in _constants:
        _constants[key] = zeros((n,), device=device).fill(value)
    return _constants[key]


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) * weight + bias.

    >>> y = pydiff.ops.layer_norm(x, w, b)        # x (..., N); w, b (N,) or None
    """
    x2 = _rows("layer_norm", x)
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, Tensor) or t.shape != (x2.shape[1],)):
            got = t.shape if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"layer_norm: {arg} must have shape ({x2.shape[1]},), got {got}")
    if eps <= 0:
        raise ValueError(f"layer_norm: eps={eps} must be positive")
    return _LayerNorm.apply(x, weight, bias, eps)
