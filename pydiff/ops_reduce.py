"""Reductions and losses: sum, mean (any axis), mse_loss and cross_entropy, summed pairwise in
a fixed order on the device (no atomics), with their backward passes.

    total = ops_reduce.sum(x, axis=0)
    loss = ops_reduce.cross_entropy(logits, labels)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import slangpy as spy

from . import capturing
from .creation import empty, tensor
from .function import Function
from .head_fusion import with_cross_entropy
from .module import library
from .ops_args import need_2d, need_float, same_device
from .ops_elementwise import div, exp, mul, neg, sub
from .tensor import Tensor, float4_ready


# A reduction over n elements runs as ceil(n / chunk) threads per output, then once more over
# the partial sums: enough threads to keep the device busy, each adding at least _MIN_CHUNK.
_MIN_CHUNK, _TARGET_THREADS = 256, 1024


def sum_mid(x3: Tensor, scale: float) -> Tensor:
    """out[o, 0, j] = scale * sum_k x3[o, k, j], pairwise and in a fixed order, on the device."""
    lib = library(x3.device)
    outer, n, inner = x3.shape
    while True:
        chunks = max(1, min(-(-n // _MIN_CHUNK), -(-_TARGET_THREADS // (outer * inner))))
        chunk = -(-n // chunks)
        chunks = -(-n // chunk)
        out = empty((outer, chunks, inner), device=x3.device)
        lib.reduce_mid(spy.grid(out.shape), x3, chunk, float(scale), out)
        if chunks == 1:
            return out
        x3, n, scale = out, chunks, 1.0  # scaled once, first: a mean's partial sums stay in range


def _axis_view(name: str, x: Tensor, axis: int | None) -> tuple[Tensor, tuple[int, ...], int]:
    """(x as an (outer, n, inner) view, the result shape with the axis kept as 1, n)."""
    need_float(name, x=x)
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a float pydiff.Tensor, got {type(x).__name__}")
    shape = x.shape if x.shape else (1,)
    if axis is None:
        return x.detach().reshape((1, x.numel, 1)), (1,), x.numel
    if not isinstance(axis, (int, np.integer)) or not -len(shape) <= axis < len(shape):
        raise ValueError(f"{name}: axis={axis!r} is out of range for a tensor of shape {x.shape}")
    axis = int(axis) % len(shape)
    outer, n = math.prod(shape[:axis]), shape[axis]
    kept = shape[:axis] + (1,) + shape[axis + 1 :]
    return x.detach().reshape((outer, n, x.numel // max(outer * n, 1))), kept, n


class _Sum(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdims, mean):
        x3, kept, n = _axis_view("mean" if mean else "sum", x, axis)
        if n == 0:
            raise ValueError(f"{'mean' if mean else 'sum'}: axis {axis} of {x.shape} is empty")
        ctx.x3_shape, ctx.x_shape, ctx.scale = x3.shape, x.shape, (1.0 / n if mean else 1.0)
        total = sum_mid(x3, ctx.scale)
        if axis is None:
            # all elements: 0-d, or NumPy's all-ones shape with keepdims
            return total.reshape((1,) * len(x.shape) if keepdims else ())
        shape = (
            kept if keepdims else tuple(d for k, d in enumerate(kept) if k != int(axis) % len(kept))
        )
        return total.reshape(shape if x.shape else ())  # axis 0 of a 0-d tensor: 0-d, as torch

    @staticmethod
    def jvp(ctx, t, *_):
        return _Sum.apply(t, *ctx.args[1:])

    @staticmethod
    def backward(ctx, g):
        outer, n, inner = ctx.x3_shape
        dx = empty(ctx.x_shape, device=g.device)
        library(g.device).broadcast_mid(
            spy.grid(ctx.x3_shape),
            g.detach().reshape((outer, 1, inner)),
            float(ctx.scale),
            dx.reshape(ctx.x3_shape),
        )
        return dx


def sum(x: Tensor, axis: int | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over all elements (a 0-d tensor) or over ``axis``, pairwise in a fixed order.
    NumPy's axis/keepdims rules (axis 0 or -1 of a 0-d tensor is allowed, as in torch).

    >>> total = pydiff.ops.sum(x)             # shape ()
    >>> col = pydiff.ops.sum(x, axis=0)       # NumPy's axis/keepdims rules; a tuple too
    """
    return _over_axes("sum", x, axis, keepdims, False)


def mean(x: Tensor, axis: int | None = None, keepdims: bool = False) -> Tensor:
    """Mean over all elements (a 0-d tensor) or over ``axis``.

    >>> m = pydiff.ops.mean(x, axis=-1, keepdims=True)
    """
    return _over_axes("mean", x, axis, keepdims, True)


def _over_axes(name: str, x: Tensor, axis: Any, keepdims: bool, mean: bool) -> Tensor:
    """One axis, all of them, or a tuple of axes (reduced one after another, the last first)."""
    many = isinstance(axis, (tuple, list))
    for a in axis if many else (() if axis is None else (axis,)):
        if not isinstance(a, (int, np.integer)) or isinstance(a, (bool, np.bool_)):
            raise TypeError(
                f"{name}: axis={axis!r} has a {type(a).__name__}; an axis is an int (a tuple of "
                "ints for several, None for all)"
            )
    if not many:
        return _Sum.apply(x, axis, keepdims, mean)
    n = len(x.shape) if isinstance(x, Tensor) else 0
    axes = {int(a) % n for a in axis if -n <= a < n}
    if len(axes) != len(axis):
        raise ValueError(
            f"{name}: axis={tuple(axis)} for a tensor of shape {getattr(x, 'shape', None)}: "
            "each axis an int in range, none twice"
        )
    if len(axes) == n:
        out = _Sum.apply(x, None, False, mean)
        return out.reshape((1,) * n) if keepdims else out
    for a in sorted(axes, reverse=True):
        x = _Sum.apply(x, a, keepdims, mean)
    return x


def mse_loss(prediction: Tensor, target: Tensor) -> Tensor:
    """Mean squared error, a 0-d tensor.

    >>> loss = pydiff.ops.mse_loss(y, target)
    """
    need_float("mse_loss", prediction=prediction, target=target)
    same_device("mse_loss", prediction=prediction, target=target)
    shapes = [v.shape if isinstance(v, Tensor) else np.shape(v) for v in (prediction, target)]
    if shapes[0] != shapes[1]:
        raise ValueError(f"mse_loss: prediction {shapes[0]} and target {shapes[1]} differ")
    return _MseLoss.apply(prediction, target)


class _MseLoss(Function):
    """mean((p - t)^2); its backward one elementwise pass (shaders/ops/elementwise.slang's
    op_mse_grad), exact where p - t overflows but the gradient does not."""

    @staticmethod
    def forward(ctx, prediction, target):
        ctx.save_for_backward(prediction, target)
        d = sub(prediction, target)
        return mean(mul(d, d))

    @staticmethod
    def jvp(ctx, tp, tt):
        p, t = ctx.saved_tensors
        dt = tp if tt is None else neg(tt) if tp is None else sub(tp, tt)
        return mean(mul(mul(sub(p, t), dt), 2.0))  # mean(2 (p - t) (dp - dt))

    @staticmethod
    def backward(ctx, g):
        p, t = ctx.saved_tensors
        lib = library(p.device)
        dp = lib.op_mse_grad(
            p.detach(), t.detach(), g.detach().reshape(()), 2.0 / p.numel, _result="tensor"
        )
        dp = Tensor(dp.native_view(), p.device) if isinstance(dp, Tensor) else dp
        return dp, (neg(dp) if ctx.needs_input_grad[1] else None)


def _ce_fast(logits: Tensor, labels: Tensor) -> bool:
    """The two-kernel cross-entropy applies: Vulkan, contiguous float logits and int labels."""
    return float4_ready(logits) and labels.dtype == "int" and labels.dense


def _ce_forward_threads(batch: int) -> int:
    """Threads of the one group that sums the mean loss (a power of two): 8, one SIMD batch
    on lavapipe (no batches to suspend and resume at the barrier: 15 -> 12 us for 256 rows),
    up to 256 for large batches (GPUs)."""
    return 8 if batch <= 2048 else 256


#: Functions whose backward can take the cross-entropy's in (one kernel instead of two), by
#: class: ``fuse(claim, logits, labels, lse, g, dz) -> bool`` (True: done, dz included) for
#: the call that made the logits (``FunctionCtx.producer``). pydiff.ops_linear adds linear.
CE_PRODUCER_FUSIONS: dict[type, Callable[..., bool]] = {}


class _CrossEntropy(Function):
    flush_before_backward = False  # kernels only

    @staticmethod
    def forward(ctx, logits, labels):
        batch = logits.shape[0]
        if _ce_fast(logits, labels):
            # lse: each row's (max, log-sum) kept apart (shaders/ops/cross_entropy.slang)
            lse, loss = empty((batch, 2), device=logits.device), empty((), device=logits.device)
            ctx.save_for_backward(logits, labels, lse)
            if with_cross_entropy(logits, labels, lse, loss):  # the head's product's kernel
                return loss
            threads = _ce_forward_threads(batch)
            kernel = logits.device.kernels.get(
                "ops/cross_entropy.slang", "ce_forward", C=logits.shape[1], TG=threads
            )
            logits.device.kernels.dispatch(
                kernel,
                threads,
                z=logits.buffer,
                labels=labels.buffer,
                lse=lse.buffer,
                loss=loss.buffer,
                B=batch,
            )
            return loss
        lib = library(logits.device)
        lse, rows = empty((batch, 2), device=logits.device), empty((batch,), device=logits.device)
        lib.cross_entropy_rows(spy.grid((batch,)), logits.detach(), labels, lse, rows)
        ctx.save_for_backward(logits, labels, lse)
        return sum_mid(rows.reshape((1, batch, 1)), 1.0 / batch).reshape(())

    @staticmethod
    def jvp(ctx, tz, _):
        """mean over rows of sum((softmax(z) - onehot(label)) dz), softmax by the ops (hvp
        differentiates it again); the row maxima subtracted first are constants."""
        z, labels = ctx.args
        (b, c), device = z.shape, z.device
        e = exp(sub(z, tensor(z.numpy().max(axis=1, keepdims=True), device=device)))
        onehot = tensor(np.eye(c, dtype=np.float32)[labels.numpy()], device=device)
        return mul(sum(mul(sub(div(e, sum(e, axis=1, keepdims=True)), onehot), tz)), 1.0 / b)

    @staticmethod
    def backward(ctx, g):
        logits, labels, lse = ctx.saved_tensors
        if (
            _ce_fast(logits, labels)
            and float4_ready(g)
            and logits.requires_grad
            and float4_ready(logits.grad_out)
        ):
            target = ctx.grad_target(0)
            claim = ctx.producer(0) if CE_PRODUCER_FUSIONS else None
            fuse = CE_PRODUCER_FUSIONS.get(claim.function) if claim is not None else None
            if fuse is not None and fuse(claim, logits, labels, lse, g, target):
                claim.take_over()
                return None, None
            kernel = logits.device.kernels.get(
                "ops/cross_entropy.slang", "ce_backward_acc", C=logits.shape[1]
            )
            logits.device.kernels.dispatch(
                kernel,
                logits.shape[0],  # a thread per row
                z=logits.buffer,
                labels=labels.buffer,
                lse=lse.buffer,
                g=g.buffer,
                dz=target.buffer,
                B=logits.shape[0],
            )
            return None, None
        dz = empty(logits.shape, device=logits.device)
        library(logits.device).cross_entropy_rows_bwd(
            spy.grid(logits.shape),
            logits.detach(),
            labels,
            lse,
            g.detach().reshape((1,)),
            1.0 / logits.shape[0],
            dz,
        )
        return dz, None


def cross_entropy(logits: Tensor, labels: Any) -> Tensor:
    """Mean softmax cross-entropy of (B, C) logits against B integer labels; log-sum-exp stable;
    a 0-d tensor.

    >>> loss = pydiff.ops.cross_entropy(logits, labels)     # labels: ints in [0, C)
    """
    need_2d("cross_entropy", logits=logits)
    same_device("cross_entropy", logits=logits, labels=labels)
    if isinstance(labels, Tensor) and labels.dtype == "int":
        _check_labels(labels, logits.shape)
        # A captured step re-checks labels copied in since (out-of-range ones would read
        # outside the logits' rows).
        capturing.on_replay(lambda: _check_labels(labels, logits.shape))
        return _CrossEntropy.apply(logits, labels)
    try:
        lab = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    except ValueError as e:  # (ragged lists)
        raise ValueError(f"cross_entropy: labels are not an array of class indices: {e}") from None
    _check_label_values(lab, logits.shape)
    # (uploaded to a new buffer, which a head product held for these logits neither reads nor
    # writes: it stays held, for the loss to finish it: pydiff.head_fusion)
    upload = lambda: tensor(lab.astype(np.int32), device=logits.device)  # noqa: E731
    return _CrossEntropy.apply(logits, logits.device.queue.keeping_held(upload, None))


def _check_labels(labels: Tensor, logits_shape: tuple) -> None:
    """Range-check an int label tensor on the host, once per version of its values."""
    stamp = (labels.storage.version, "labels", logits_shape)
    if labels.storage.checked != stamp:
        # (a head's product held back for this loss stays held: pydiff.head_fusion)
        values = labels.device.queue.keeping_held(labels.numpy, labels.storage)
        _check_label_values(values, logits_shape)
        labels.storage.checked = stamp


def _check_label_values(lab: np.ndarray, logits_shape: tuple) -> None:
    if lab.dtype.kind not in "biuf":  # (strings, objects, complex: numpy's isfinite raised)
        raise TypeError(
            f"cross_entropy: labels must be integer class indices, got {lab.dtype} values"
        )
    if lab.size and not np.issubdtype(lab.dtype, np.integer):
        if not np.all(np.isfinite(lab)) or np.any(lab != np.round(lab)):
            raise ValueError(
                f"cross_entropy: labels must be integer class indices, got {lab.dtype} values"
            )
    if lab.shape != (logits_shape[0],):
        raise ValueError(
            f"cross_entropy: labels have shape {lab.shape}, expected ({logits_shape[0]},)"
        )
    if lab.size and (lab.min() < 0 or lab.max() >= logits_shape[1]):
        raise ValueError(
            f"cross_entropy: labels must lie in [0, {logits_shape[1]}), got "
            f"{lab.min()}..{lab.max()}"
        )
