"""Softmax and log_softmax over any axis (log-sum-exp stable), and over the last dimension
SiLU-and-multiply, RMSNorm and LayerNorm, each with a hand-written backward that reuses the
statistics of its forward.

    p = ops_norm.softmax(logits)
    y = ops_norm.layer_norm(x, w, b)
"""

from __future__ import annotations

import math

import numpy as np
import slangpy as spy

from .creation import empty, tensor, zeros
from .device import Device
from .function import Function
from .module import library
from .ops_args import check_axis, finite_number, need_2d, need_float, need_vector, rows_view
from .ops_args import same_device
from .ops_elementwise import add, add_tangents, div, dsilu, exp, mul, silu, sqrt, sub
from .ops_reduce import mean, sum
from .tensor import Tensor


def softmax_rows(z2: Tensor, scale: float, log_space: bool) -> Tensor:
    lib = library(z2.device)
    stats = empty((z2.shape[0], 2), device=z2.device)  # the row max and log-sum, apart
    lib.softmax_stats(spy.grid((z2.shape[0],)), z2, float(scale), stats)
    out = empty(z2.shape, device=z2.device)
    lib.softmax_apply(spy.grid(z2.shape), z2, float(scale), stats, int(log_space), out)
    return out


def softmax_rows_bwd(out2: Tensor, g2: Tensor, scale: float, log_space: bool) -> Tensor:
    lib = library(out2.device)
    dots = empty((out2.shape[0],), device=out2.device)
    lib.softmax_row_dot(spy.grid((out2.shape[0],)), g2, out2, int(log_space), dots)
    dz = empty(out2.shape, device=out2.device)
    lib.softmax_bwd(spy.grid(out2.shape), out2, g2, dots, float(scale), int(log_space), dz)
    return dz


def _axis_view(x: Tensor, axis: int) -> Tensor:
    """``x`` as a contiguous (outer, n, inner) view without gradients, n along ``axis``."""
    outer = math.prod(x.shape[:axis])
    return x.detach().reshape((outer, x.shape[axis], x.numel // (outer * x.shape[axis])))


def softmax_axis(z3: Tensor, log_space: bool) -> Tensor:
    """Softmax (or log-softmax) of a (O, C, I) tensor over its middle axis, as a new tensor."""
    lib = library(z3.device)
    stats = empty((z3.shape[0], z3.shape[2], 2), device=z3.device)
    lib.softmax_axis_stats(spy.grid((z3.shape[0], z3.shape[2])), z3, stats)
    out = empty(z3.shape, device=z3.device)
    lib.softmax_axis_apply(spy.grid(z3.shape), z3, stats, int(log_space), out)
    return out


def softmax_axis_bwd(out3: Tensor, g3: Tensor, log_space: bool) -> Tensor:
    lib = library(out3.device)
    dots = empty((out3.shape[0], out3.shape[2]), device=out3.device)
    lib.softmax_axis_dot(spy.grid(dots.shape), g3, out3, int(log_space), dots)
    dz = empty(out3.shape, device=out3.device)
    lib.softmax_axis_bwd(spy.grid(out3.shape), out3, g3, dots, int(log_space), dz)
    return dz


class _Softmax(Function):
    @staticmethod
    def forward(ctx, z, log_space, axis):
        ctx.log_space, ctx.axis = log_space, axis
        if axis == len(z.shape) - 1:  # the rows kernels: one row per thread, contiguous reads
            out = softmax_rows(rows_view("softmax", z), 1.0, log_space).reshape(z.shape)
        else:
            out = softmax_axis(_axis_view(z, axis), log_space).reshape(z.shape)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def jvp(ctx, tz, *_):
        y, axis = ctx.outputs[0], ctx.axis
        if ctx.log_space:  # dz - sum(softmax(z) dz)
            return sub(tz, sum(mul(exp(y), tz), axis, True))
        return mul(y, sub(tz, sum(mul(y, tz), axis, True)))  # y (dz - sum(y dz))

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        if ctx.axis == len(out.shape) - 1:
            rows = out.detach().reshape((out.numel // out.shape[-1], out.shape[-1]))
            dz = softmax_rows_bwd(rows, g.detach().reshape(rows.shape), 1.0, ctx.log_space)
        else:
            out3 = _axis_view(out, ctx.axis)
            dz = softmax_axis_bwd(out3, g.detach().reshape(out3.shape), ctx.log_space)
        return dz.reshape(out.shape)


def log_softmax(logits: Tensor, axis: int = -1) -> Tensor:
    """Log-softmax over ``axis`` (the last by default), log-sum-exp stable: the maximum and
    the log-sum are kept apart (finite and exact for logits of 1e30).

    >>> logp = pydiff.ops.log_softmax(logits)            # or axis=0, 1, ...
    """
    rows_view("log_softmax", logits, "logits")
    return _Softmax.apply(logits, True, check_axis("log_softmax", axis, logits))


def softmax(logits: Tensor, axis: int = -1) -> Tensor:
    """Softmax over ``axis`` (the last by default), max-subtracted so large logits (1e30)
    neither overflow nor lose the log-sum.

    >>> p = pydiff.ops.softmax(logits)                   # or axis=0, 1, ...
    """
    rows_view("softmax", logits, "logits")
    return _Softmax.apply(logits, False, check_axis("softmax", axis, logits))


class _SiluAndMul(Function):
    @staticmethod
    def forward(ctx, x):
        x2 = rows_view("silu_and_mul", x)
        out = empty(x.shape[:-1] + (x.shape[-1] // 2,), device=x.device)
        out2 = out.reshape((x2.shape[0], x2.shape[1] // 2))
        library(x.device).silu_and_mul_fwd(spy.grid(out2.shape), x2, out2)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def jvp(ctx, t):
        x = ctx.args[0]
        h = x.shape[-1] // 2
        gate, up = x[..., :h], x[..., h:]
        return add(mul(t[..., :h], mul(dsilu(gate), up)), mul(t[..., h:], silu(gate)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x2 = rows_view("silu_and_mul", x)
        dx = empty(x.shape, device=x.device)
        g2 = g.detach().reshape((x2.shape[0], x2.shape[1] // 2))
        library(x.device).silu_and_mul_bwd(spy.grid(g2.shape), x2, g2, dx.reshape(x2.shape))
        return dx


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(gate) * up where x = [gate | up] splits the last dimension (2H -> H).

    >>> y = pydiff.ops.silu_and_mul(x)        # x (B, 2H) -> y (B, H)
    """
    rows_view("silu_and_mul", x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dimension of {x.shape} must be even (gate | up)")
    return _SiluAndMul.apply(x)


class _RMSNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        lib = library(x.device)
        stats = empty((x.shape[0], 2), device=x.device)  # row scale and scaled RMS
        lib.rms_norm_stats(spy.grid((x.shape[0],)), x.detach(), float(eps), stats)
        y = empty(x.shape, device=x.device)
        lib.rms_norm_apply(spy.grid(x.shape), x.detach(), stats, weight.detach(), y)
        ctx.save_for_backward(x, weight, stats)  # statistics saved: no recomputation
        return y

    @staticmethod
    def jvp(ctx, tx, tw, _):
        x, w, eps = ctx.args
        a, eps_a = _row_scale(ctx.saved_tensors[2], x, eps)  # x / a: no overflow of x^2
        xs, ts = div(x, a), None if tx is None else div(tx, a)
        r = div(1.0, sqrt(add(mean(mul(xs, xs), -1, True), eps_a)))  # a / rms per row
        xr = mul(xs, r)
        dxr = None if ts is None else mul(r, sub(ts, mul(xr, mean(mul(xr, ts), -1, True))))
        return add_tangents(
            None if dxr is None else mul(dxr, w), None if tw is None else mul(xr, tw), x
        )

    @staticmethod
    def backward(ctx, g):
        x, weight, stats = ctx.saved_tensors
        lib = library(x.device)
        xd, wd, gd = x.detach(), weight.detach(), g.detach()
        c = empty((x.shape[0],), device=x.device)
        lib.rms_norm_bwd_rows(spy.grid((x.shape[0],)), xd, stats, wd, gd, c)
        dx = empty(x.shape, device=x.device)
        lib.rms_norm_dx(spy.grid(x.shape), xd, stats, wd, gd, c, dx)
        dw = empty(weight.shape, device=x.device)
        lib.rms_norm_dw(spy.grid(weight.shape), xd, stats, gd, dw)
        return dx, dw


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dimension of a (B, N) tensor, scaled by ``weight`` (N,).

    >>> y = pydiff.ops.rms_norm(x, w, eps=1e-6)
    """
    need_2d("rms_norm", x=x)
    need_float("rms_norm", weight=weight)
    same_device("rms_norm", x=x, weight=weight)
    need_vector("rms_norm", "weight", weight, x.shape[1])
    eps = finite_number("rms_norm", "eps", eps, positive=True)
    return _RMSNorm.apply(x, weight, eps)


class _LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        lib = library(x.device)
        x2 = rows_view("layer_norm", x)
        rows, n = x2.shape
        stats = empty((rows, 4), device=x.device)  # row scale, scaled mean (hi), sd, mean (lo)
        lib.layer_norm_stats(spy.grid((rows,)), x2, float(eps), stats)
        w = weight.detach() if weight is not None else _constant(x.device, n, 1.0)
        b = bias.detach() if bias is not None else _constant(x.device, n, 0.0)
        y = empty(x.shape, device=x.device)
        lib.layer_norm_apply(spy.grid(x2.shape), x2, stats, w, b, y.reshape(x2.shape))
        ctx.affine = (weight is not None, bias is not None)
        ctx.save_for_backward(x, w, stats)  # row statistics saved: no recomputation
        return y

    @staticmethod
    def jvp(ctx, tx, tw, tb, _):
        x, w, b, eps = ctx.args
        a, eps_a = _row_scale(ctx.saved_tensors[2], x, eps)  # x / a: no overflow of c^2
        xs = div(x, a)
        c = sub(xs, mean(xs, -1, True))
        r = div(1.0, sqrt(add(mean(mul(c, c), -1, True), eps_a)))
        xh = mul(c, r)  # (x - mean) / sqrt(var + eps), in units of a
        dy = None
        if tx is not None:
            ts = div(tx, a)
            dc = sub(ts, mean(ts, -1, True))
            dy = mul(r, sub(dc, mul(xh, mean(mul(xh, dc), -1, True))))
            dy = dy if w is None else mul(dy, w)
        dy = add_tangents(dy, None if tw is None else mul(xh, tw), x)
        return add_tangents(dy, tb, x)

    @staticmethod
    def backward(ctx, g):
        x, w, stats = ctx.saved_tensors
        lib = library(x.device)
        x2 = rows_view("layer_norm", x)
        g2 = g.detach().reshape(x2.shape)
        c = empty((x2.shape[0], 2), device=x.device)
        lib.layer_norm_bwd_rows(spy.grid((x2.shape[0],)), x2, stats, w, g2, c)
        dx = empty(x.shape, device=x.device)
        lib.layer_norm_dx(spy.grid(x2.shape), x2, stats, w, g2, c, dx.reshape(x2.shape))
        dw, db = empty((x2.shape[1],), device=x.device), empty((x2.shape[1],), device=x.device)
        lib.layer_norm_dwb(spy.grid((x2.shape[1],)), x2, stats, g2, dw, db)
        has_w, has_b = ctx.affine  # one gradient per tensor input: None inputs are not counted
        return (dx,) + ((dw,) if has_w else ()) + ((db,) if has_b else ())


def _row_scale(stats: Tensor, x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The forward's power-of-two row scale a (stats[:, 0], at least 1, 1 where not finite)
    as a (..., 1) tensor, and eps / a^2: the forward-mode rules work on x / a and t / a as
    the kernels do (exact: a is a power of two; a constant, as it is piecewise), so that
    x^2 of a row of 1e19 neither overflows nor turns the tangent into 0."""
    a = np.asarray(stats.numpy(), np.float64)[:, :1]
    a = np.where(np.isfinite(a) & (a > 1.0), a, 1.0)
    shape = x.shape[:-1] + (1,)
    made = [tensor(v.reshape(shape).astype(np.float32), device=x.device) for v in (a, eps / a**2)]
    return made[0], made[1]


def _constant(device: Device, n: int, value: float) -> Tensor:
    """A (n,) tensor of ``value``, made once per device (LayerNorm without weight or bias)."""
    make = lambda: zeros((n,), device=device).fill(value)  # noqa: E731
    return device.cached(("ops.constant", n, value), make)


def layer_norm(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) * weight + bias.

    >>> y = pydiff.ops.layer_norm(x, w, b)        # x (..., N); w, b (N,) or None
    """
    x2 = rows_view("layer_norm", x)
    need_float("layer_norm", weight=weight, bias=bias)
    same_device("layer_norm", x=x, weight=weight, bias=bias)
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            need_vector("layer_norm", arg, t, x2.shape[1])
    eps = finite_number("layer_norm", "eps", eps, positive=True)
    return _LayerNorm.apply(x, weight, bias, eps)
