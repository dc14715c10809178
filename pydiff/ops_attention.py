"""Scaled dot-product attention, softmax(scale Q K^T) V, on one 2-D head or on batches of
heads (..., T, D) such as (B, H, T, D), with PyTorch's causal mask, forward and hand-written
backward (the probabilities saved; no atomics).

    out = ops_attention.attention(q, k, v)                  # (T, D), (S, D), (S, E) -> (T, E)
    out = ops_attention.attention(q, k, v, causal=True)     # (B, H, T, D) ... -> (B, H, T, E)
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np
import slangpy as spy

from . import forward_trace

from .creation import empty, tensor
from .function import Function
from .module import library
from .ops_args import finite_number, need_float, same_device
from .ops_elementwise import add, mul
from .ops_linear import matmul
from .ops_norm import softmax, softmax_rows, softmax_rows_bwd
from .products import product
from .tensor import Tensor


class _Attention(Function):
    """One 2-D head without a mask, on the matrix-product kernels."""

    flush_before_backward = False  # kernels only

    @staticmethod
    def forward(ctx, q, k, v, scale):
        p = softmax_rows(product("mm_nt", q, k, (q.shape[0], k.shape[0])), scale, False)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, p)  # the probabilities: no recomputation in backward
        return product("mm_nn", p, v, (q.shape[0], v.shape[1]))

    @staticmethod
    def jvp(ctx, tq, tk, tv, _):
        scale = ctx.args[3]
        f = lambda q, k, v: by_ops(q, k, v, False, scale)  # noqa: E731
        return forward_trace.tangent_through(f, ctx.args[:3], (tq, tk, tv))

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved_tensors
        dv = product("mm_tn", p, g, v.shape) if v.requires_grad else None  # P^T dO
        dp = product("mm_nt", g, v, p.shape)  # dO V^T
        ds = softmax_rows_bwd(p, dp, ctx.scale, False)  # includes the scale
        dq = product("mm_nn", ds, k, q.shape) if q.requires_grad else None  # dS K
        dk = product("mm_tn", ds, q, k.shape) if k.requires_grad else None  # dS^T Q
        return dq, dk, dv


def _heads(t: Tensor) -> Tensor:
    """``t`` (..., r, c) as a (heads, r, c) view without gradients (a copy if not contiguous)."""
    shape = (math.prod(t.shape[:-2]),) + tuple(t.shape[-2:])
    t = t.detach()
    try:
        return t.reshape(shape)
    except ValueError:  # not contiguous
        return t.copy_values().reshape(shape)


def _bmm(a: Tensor, b: Tensor, ta: bool, tb: bool, alpha: float, shape: tuple) -> Tensor:
    """alpha * A B per head, A = a or a^T, B = b or b^T (shaders/ops/attention.slang)."""
    out = empty(shape, device=a.device)
    library(a.device).attn_bmm(spy.grid(shape), a, b, int(ta), int(tb), float(alpha), out)
    return out


class _BatchedAttention(Function):
    """Batches of heads, or a causal mask: the kernels of shaders/ops/attention.slang."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        q3, k3, v3 = _heads(q), _heads(k), _heads(v)
        (n, t, _), s, e = q3.shape, k3.shape[1], v3.shape[2]
        scores = empty((n, t, s), device=q.device)
        library(q.device).attn_scores(spy.grid((n, t, s)), q3, k3, scale, int(causal), scores)
        p = softmax_rows(scores.reshape((n * t, s)), 1.0, False).reshape((n, t, s))
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, p)  # the probabilities: no recomputation in backward
        return _bmm(p, v3, False, False, 1.0, (n, t, e)).reshape(q.shape[:-1] + (e,))

    @staticmethod
    def jvp(ctx, tq, tk, tv, *_):
        causal, scale = ctx.args[3:]
        f = lambda q, k, v: by_ops(q, k, v, causal, scale)  # noqa: E731
        return forward_trace.tangent_through(f, ctx.args[:3], (tq, tk, tv))

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved_tensors
        q3, k3, v3, g3 = _heads(q), _heads(k), _heads(v), _heads(g)
        n, t, s = p.shape
        dv = _bmm(p, g3, True, False, 1.0, v3.shape) if v.requires_grad else None  # P^T dO
        dp = _bmm(g3, v3, False, True, 1.0, p.shape)  # dO V^T
        ds = softmax_rows_bwd(p.reshape((n * t, s)), dp.reshape((n * t, s)), 1.0, False)
        ds = ds.reshape(p.shape)  # the softmax's backward; the scale comes below
        dq = _bmm(ds, k3, False, False, ctx.scale, q3.shape) if q.requires_grad else None
        dk = _bmm(ds, q3, True, False, ctx.scale, k3.shape) if k.requires_grad else None
        return tuple(
            None if d is None else d.reshape(x.shape) for d, x in ((dq, q), (dk, k), (dv, v))
        )


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    need_float("attention", q=q, k=k, v=v)
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or len(t.shape) < 2:
            got = t.shape if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"attention: {arg} must be a float tensor of 2 or more dimensions (T, D) or "
                f"(..., T, D), got {got}"
            )
    same_device("attention", q=q, k=k, v=v)
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ValueError(
            f"attention: q {q.shape}, k {k.shape} and v {v.shape} must have the same leading "
            "(batch, head) dimensions (no broadcasting)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"attention: q {q.shape} and k {k.shape} must have the same last dimension"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"attention: k {k.shape} and v {v.shape} must have the same number of rows "
            "(keys, axis -2)"
        )


def attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Scaled dot-product attention softmax(scale Q K^T) V, as
    ``torch.nn.functional.scaled_dot_product_attention``: Q (..., T, D), K (..., S, D),
    V (..., S, E) -> (..., T, E), the leading (batch, head) dimensions equal, or 2-D.

    ``causal=True`` masks key s > query t (PyTorch's ``is_causal``: the top-left aligned lower
    triangle, also for T != S). ``scale`` defaults to 1/sqrt(D); ``scale=1.0`` is the
    unscaled form of the autodiff guide.

    >>> out = pydiff.ops.attention(Q, K, V)                   # (T, D), (S, D), (S, E)
    >>> out = pydiff.ops.attention(q, k, v, causal=True)      # (B, H, T, D) -> (B, H, T, E)
    """
    _check(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"attention: causal must be True or False, got {causal!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"attention: scale must be a number or None, got {scale!r}")
    scale = finite_number("attention", "scale", scale)  # NaN or inf: every output NaN
    if len(q.shape) == 2 and not causal:
        return _Attention.apply(q, k, v, scale)
    return _BatchedAttention.apply(q, k, v, causal, scale)


#: The most score entries one block of heads of ``by_ops`` holds (the rest: more blocks).
SCORES_BLOCK = 1 << 22


class _Rows(Function):
    """The rows of 2-D tensors one after another (NumPy's concatenate on axis 0)."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.rows = [p.shape[0] for p in parts]
        out = np.concatenate([p.numpy() for p in parts])
        return tensor(out, dtype=parts[0].dtype, device=parts[0].device)

    @staticmethod
    def jvp(ctx, *tangents):
        parts = ctx.args
        return _Rows.apply(*[t if t is not None else p * 0.0 for p, t in zip(parts, tangents)])

    @staticmethod
    def backward(ctx, g):
        return tuple(np.split(g.numpy().astype(np.float64), np.cumsum(ctx.rows)[:-1]))


def _heads_by_ops(q2, k2, v2, n, t, s, causal, scale):
    """n heads stacked as rows (n t, d), (n s, d), (n s, e): one (nT, nS) product whose
    entries between different heads (and above the diagonal, causal) are -1e30."""
    head_q, head_k = np.repeat(np.arange(n), t), np.repeat(np.arange(n), s)
    masked = head_q[:, None] != head_k[None, :]
    if causal:
        masked |= np.tile(np.arange(s), n)[None, :] > np.tile(np.arange(t), n)[:, None]
    scores = mul(matmul(q2, k2.T), scale)
    if masked.any():
        mask = tensor(np.where(masked, -1e30, 0.0).astype(np.float32), device=q2.device)
        scores = add(scores, mask)
    return matmul(softmax(scores), v2)


def by_ops(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """Attention written with matmul, softmax and slicing (the forward-mode rule, run under a
    trace so that a tape records it for hvp): heads in blocks of at most SCORES_BLOCK score
    entries, each block one masked product, the blocks' rows joined."""
    lead, (t, d), (s, e) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    n = math.prod(lead)
    q2, k2, v2 = q.reshape((n * t, d)), k.reshape((n * s, d)), v.reshape((n * s, e))
    per = max(1, int(math.isqrt(SCORES_BLOCK // (t * s))))  # heads per block
    if per >= n:
        out = _heads_by_ops(q2, k2, v2, n, t, s, causal, scale)
    else:
        blocks = []
        for a in range(0, n, per):
            b = min(a + per, n)
            qa, ka, va = q2[a * t : b * t], k2[a * s : b * s], v2[a * s : b * s]
            blocks.append(_heads_by_ops(qa, ka, va, b - a, t, s, causal, scale))
        out = _Rows.apply(*blocks)
    return out.reshape(lead + (t, e))
