"""Stateless random ops: dropout, whose mask is a pure function of (seed, element index),
Philox4x32-10 in shaders/ops/dropout.slang. The backward recomputes the mask from the seed
(nothing is stored), and a seed gives the same mask on every backend and every run.

    y = ops_random.dropout(x, 0.1, seed=step)
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from .creation import empty, zeros
from .function import Function
from .ops_args import need_float
from .tensor import Tensor, float4_ready

SEED_LIMIT = 2**64


def dropout_uniforms(p: float, seed: int) -> dict[str, Any]:
    """The kernels' uniforms for drop probability ``p`` and ``seed``: the Philox key (the
    seed's two 32-bit halves), the threshold floor(p 2^32) under which a word drops its
    element, the scale 1/(1 - p) and whether everything is dropped (p = 1)."""
    all_dropped = p >= 1.0
    return {
        "seed_lo": seed & 0xFFFFFFFF,
        "seed_hi": seed >> 32,
        "threshold": 0 if all_dropped else math.floor(p * 2.0**32),
        "scale": 0.0 if all_dropped else 1.0 / (1.0 - p),
        "all_dropped": int(all_dropped),
    }


def _dispatch(entry: str, count_of: Tensor, uniforms: dict, **buffers: Tensor) -> None:
    count = -(-count_of.numel // 4)
    kernels = count_of.device.kernels
    kernels.dispatch(
        kernels.get("ops/dropout.slang", entry, CHUNK=kernels.chunk),
        -(-count // kernels.chunk),
        count=count,
        **uniforms,
        **{k: t.buffer for k, t in buffers.items()},
    )


def _dense(t: Tensor) -> Tensor:
    """``t`` itself where the float4 kernels can read it, else a contiguous copy."""
    return t if float4_ready(t) else t.detach().copy_values()


class _Dropout(Function):
    flush_before_backward = False  # kernels only

    @staticmethod
    def forward(ctx, x, p, seed):
        ctx.uniforms = dropout_uniforms(p, seed)
        y = empty(x.shape, device=x.device)
        _dispatch("dropout4", x, ctx.uniforms, x=_dense(x), y=y)
        return y

    @staticmethod
    def jvp(ctx, t, *_):
        return _Dropout.apply(t, *ctx.args[1:])  # the same (seed, index) mask and scale

    @staticmethod
    def backward(ctx, g):
        x = ctx.inputs[0]
        g = _dense(g)
        target = ctx.grad_target(0) if float4_ready(x.grad_out) else None
        if target is not None:
            _dispatch("dropout_bwd_acc4", x, ctx.uniforms, g=g, dx=target, dx_in=target)
            return None
        dx = zeros(x.shape, device=x.device)
        _dispatch("dropout_bwd_acc4", x, ctx.uniforms, g=g, dx=dx, dx_in=dx)
        return dx


def dropout(x: Tensor, p: float, seed: int) -> Tensor:
    """Inverted dropout: each element kept with probability 1 - p and scaled by 1/(1 - p),
    else 0. The mask is a pure function of ``seed`` and the element's flat (row-major) index:
    the same seed gives the same mask on every backend and run, and the backward recomputes
    it. ``p = 0`` is the identity, ``p = 1`` gives zeros (and zero gradients). Give each
    dropout of a model, and each step, its own seed.

    >>> y = pydiff.ops.dropout(x, 0.1, seed=step)
    """
    need_float("dropout", x=x)
    if not isinstance(x, Tensor):
        raise TypeError(f"dropout: x must be a pydiff.Tensor, got {type(x).__name__}")
    if isinstance(p, bool) or not isinstance(p, Real) or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout: p={p!r} must be a probability in [0, 1]")
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise TypeError(f"dropout: seed must be an int, got {type(seed).__name__}")
    if not 0 <= int(seed) < SEED_LIMIT:
        raise ValueError(f"dropout: seed={seed} must be in [0, 2**64)")
    return _Dropout.apply(x, float(p), int(seed))
