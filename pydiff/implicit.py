"""``pydiff.fixed_point``: the solution of ``x = f(x, *params)``, differentiated implicitly.

    x = pydiff.fixed_point(lambda x, a, b: a * ops.tanh(x) + b, np.zeros(3), a, b)

The forward iterates ``x <- f(x, *params)``; nothing of it is recorded. The backward uses
the implicit function theorem at the solution x*: it solves the adjoint equation
``(I - df/dx)^T lam = xbar`` by the iteration ``lam <- xbar + (df/dx)^T lam`` (one VJP of f
at x* per step, each on a tape of its own), then gives ``pbar = (df/dp)^T lam``.

Stopping rules (infinity norms): the forward stops on ``|x_k - x_(k-1)| <= atol + tol |x_k|``;
the adjoint and tangent solves are linear in their right-hand side, so they stop on the
relative step ``|lam_k - lam_(k-1)| <= tol |lam_k|`` alone: the same iterations, to the same
relative accuracy, whatever the scale of the upstream gradient or the direction. Each goes
on until the error its last step leaves, step * rho / (1 - rho) for the contraction rho the
steps show, is within that bound too, or until float rounding stops the iteration getting
nearer: an iterate repeating exactly, or steps without a new low (``implicit_stop``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .backward_scope import separate_backward
from .creation import tensor as make_tensor
from .errors import ConvergenceError
from . import foreign, forward_trace
from .implicit_args import check_numbers, host_start, refuse_foreign
from .implicit_stop import StopRule, step_size, units_of
from .function import Function, FunctionCtx, first_order_only
from .grad_transforms import on_tape
from .module import OverloadedFunction, ShaderFunction
from .policy import zero_policy
from .tape import Tape, active_tape, suspend_recording
from .tensor import Tensor

#: The default iteration limit of the forward and the adjoint solve.
MAX_ITER = 1000
#: The forward solve's default absolute floor on the step (what a solution at 0 stops on).
ATOL = 1e-12


def _call(f: Callable[..., Any], x: Tensor, params: tuple) -> Tensor:
    """f(x, *params) as a tensor of x's shape, or a TypeError/ValueError naming f."""
    with foreign.data_calls():  # torch data f closes over: pydiff calls, pydiff results
        is_shader = isinstance(f, (ShaderFunction, OverloadedFunction))
        out = f(x, *params, _result="tensor") if is_shader else f(x, *params)
    name = getattr(f, "__name__", None) or getattr(f, "label", None) or repr(f)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"fixed_point: f ({name}) returned a {type(out).__name__}; it must return a "
            "pydiff Tensor of x's shape"
        )
    if out.expected_numpy_shape() != x.expected_numpy_shape():
        raise ValueError(
            f"fixed_point: f ({name}) returned shape {out.expected_numpy_shape()} for x of "
            f"shape {x.expected_numpy_shape()}; f must map x to a tensor of x's shape"
        )
    return out


class _Params:
    """``params`` with the tensors taken out of the dicts (structs), lists and tuples they
    sit in: ``tensors`` are what ``FixedPoint.apply`` records (each gets its gradient), and
    ``build(tensors)`` puts these (or detached copies, leaves of a VJP) back in their places.

    >>> _Params(({"a": a, "b": 2.0}, c)).build([a2, c2])   # ({"a": a2, "b": 2.0}, c2)
    """

    def __init__(self, params: tuple):
        self.tensors: list[Tensor] = []
        self.layout = self._take(tuple(params))

    def _take(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            self.tensors.append(value)
            return _Slot(len(self.tensors) - 1)
        if type(value) is dict:
            return {k: self._take(v) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._take(v) for v in value)
        return value

    def build(self, tensors: Any) -> tuple:
        """The params with ``tensors`` (one per ``self.tensors``, in order) in their places."""
        return _put(self.layout, tuple(tensors))


class _Slot(int):
    """Where ``_Params`` took a tensor out: its index among the tensors."""


def _put(layout: Any, tensors: tuple) -> Any:
    if isinstance(layout, _Slot):
        return tensors[layout]
    if type(layout) is dict:
        return {k: _put(v, tensors) for k, v in layout.items()}
    if type(layout) in (list, tuple):
        return type(layout)(_put(v, tensors) for v in layout)
    return layout


def _refuse_closure_reads(f: Callable[..., Any], x0: Tensor, params: _Params) -> None:
    """One probe of f at (x0, params) detached, where a tape records or pydiff.jvp runs: a
    result that still wants a gradient or carries a tangent read one from somewhere else (a
    closure, a global), whose derivative the implicit solve would not see: refused. The
    parameters themselves read through the closure are fine (``_closure_params``; in
    forward mode, the parameter itself or a view made inside f: the tangent solve gives
    exactly those tensors their tangents)."""
    trace = forward_trace.active()
    if active_tape() is None and trace is None:
        return
    xl = x0.detach()
    args = [p.detach() for p in params.tensors]
    probe = None if trace is None else _ParamsHidden(trace, params.tensors)
    with suspend_recording(), Tape(reads_other_tapes=True) as tape, forward_trace.tracing(probe):
        out = _call(f, xl, params.build(args))
    if out.requires_grad:
        _closure_params(f, tape, [xl, *args], params.tensors)
    if probe is not None and probe.tangent(out) is not None:
        name = getattr(f, "__name__", None) or repr(f)
        raise ValueError(
            f"fixed_point: f ({name}) reads a tensor that carries a tangent but is not one of "
            "params or a view of one made inside f (a closure's or a global's, or a view "
            "made before the call); its derivative would be wrong. Pass it to fixed_point "
            "after x0, as a parameter of f"
        )


class _ParamsHidden(forward_trace.Trace):
    """The active trace with the parameters' own tangents hidden (for the probe): what then
    still reaches f's result came from a tensor that is not a parameter."""

    def __init__(self, outer: forward_trace.Trace, params: list[Tensor]):
        super().__init__()
        self.outer, self.params = outer, {id(p): p for p in params}

    def tangent(self, x: Any) -> Any:
        own = super().tangent(x)
        if own is not None or self.params.get(id(x)) is x:
            return own
        return self.outer.tangent(x)


def _not_converged(
    which: str, steps: int, residual: float, bound: str, hint: str, stop: StopRule
) -> None:
    if math.isfinite(residual):
        how = f"did not converge in max_iter={steps} iterations"
    else:  # overflow: stop at once rather than iterate on inf/nan
        how = f"diverged at iteration {steps} (the values overflowed or became NaN)"
    stalled = stop.stalled_for()
    if math.isfinite(residual) and stalled >= max(8, steps // 4) and stop.size > 0:
        hint = (
            f"The steps reached no new low in the last {stalled} iterations (lowest "
            f"{stop.best:.3g}): float rounding of f's terms keeps x moving by that much; a "
            f"tol above {stop.best / stop.size:.2g} accepts it. " + hint
        )
    raise ConvergenceError(
        f"fixed_point: the {which} {how}: last residual max|change| = {residual:.3g} "
        f"(it stops at max|change| <= {bound}). {hint}"
    )


def _refuse_cycle(which: str, stop: StopRule) -> None:
    """ConvergenceError where the iterate repeats with steps too large for rounding."""
    if not stop.cycle_refused():
        return
    period, largest = stop.cycle
    relative = largest / stop.size if stop.size > 0 else math.inf
    tol = (
        f" If it is float rounding, a tol above {relative:.2g} accepts it."
        if relative < 0.01
        else ""
    )
    raise ConvergenceError(
        f"fixed_point: the {which} repeats itself every {period} iterations with steps up "
        f"to {largest:.3g} (max|x| = {stop.size:.3g}): it oscillates around the solution "
        "instead of reaching it (f is not a contraction there, |df/dx| >= 1); start x0 "
        f"nearer the solution or change f.{tol}"
    )


#: The adjoint and tangent solves' hint when they do not converge.
_LINEAR_HINT = (
    "It converges where the forward does (spectral radius of df/dx at x* below 1); "
    "raise max_iter or tol."
)


def _vjp(
    f: Callable[..., Any], x: Tensor, params: _Params, wants: list[bool], lam: np.ndarray, dx: bool
) -> tuple[np.ndarray | None, list[Any]]:
    """lam^T df/dx (if ``dx``) and lam^T df/dp for the tensors of params ``wants`` marks, at
    (x, params): one forward of f on a fresh tape, one backward. A parameter f also reads
    through its closure (``a`` or ``a.reshape(...)``, not the argument it received) lends
    its gradient buffer for the backward: that share is added to its argument's."""
    with suspend_recording():  # also when the outer backward runs inside its tape's `with`
        xl = x.detach().requires_grad_(True) if dx else x.detach()
        args = [
            p.detach().requires_grad_(True) if w else p.detach()
            for p, w in zip(params.tensors, wants)
        ]
        with Tape(reads_other_tapes=True) as tape:
            out = _call(f, xl, params.build(args))
        closure = _closure_params(f, tape, [xl, *args], params.tensors)
        out = on_tape(out, tape, [xl, *args])
        lent = {id(_base(params.tensors[i])): params.tensors[i].lend_grads() for i in closure}
        try:
            if out.requires_grad and out.producer is tape:
                with zero_policy("accumulate"), separate_backward():
                    tape.backward(out, grad=lam.reshape(out.expected_numpy_shape()))
            gx = xl.grad.numpy().astype(np.float64) if dx else None
            grads: list[Any] = [a.grad if w else None for a, w in zip(args, wants)]
            for i in closure:  # (after the backward's kernels: read while still lent)
                if wants[i]:
                    grads[i] = grads[i].numpy() + params.tensors[i].grad.numpy()
        finally:
            for give_back in lent.values():
                give_back()
    return gx, grads


def _base(t: Tensor) -> Tensor:
    return t.base if t.base is not None else t


def _closure_params(f: Callable[..., Any], tape: Tape, given: list, params: list) -> list[int]:
    """The indices of the ``params`` that f read on ``tape`` through its closure rather than
    through the ``given`` arguments (the detached copies it received): the parameter
    itself, or a view of it (``a.reshape(...)``), whose gradient the VJP collects apart.
    Any other tensor with gradients that f reads without receiving it (a closure's, a
    global's, the rest of the buffer a parameter is a part of) is refused: its gradient
    would be wrong (one VJP's share per adjoint step). A view of a given tensor is that
    tensor."""
    found: list[int] = []
    for t in tape.inputs():
        if not t.requires_grad or any(_base(t) is g for g in given):
            continue
        whole = [
            i
            for i, p in enumerate(params)
            if p is t or (_base(p) is _base(t) and p.numel == _base(p).numel)
        ]
        if whole:
            found += [whole[0]] if whole[0] not in found else []
            continue
        name = getattr(f, "__name__", None) or repr(f)
        raise ValueError(
            f"fixed_point: f ({name}) reads a tensor of shape {t.shape} that requires a "
            "gradient but is not one of params or a view of one (a closure's or a global's, "
            "one inside a param other than a dict, list or tuple, or the rest of the buffer a "
            "param is a part of); its gradient would be wrong. Pass it to fixed_point after "
            "x0, as a parameter of f"
        )
    return found


class FixedPoint(Function):
    """The recorded solve: forward iterates f, backward solves the adjoint equation."""

    flush_before_backward = True

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        f: Any,
        tol: float,
        atol: float,
        max_iter: int,
        x0: Tensor,
        params: _Params,
        *tensors: Tensor,
    ) -> Tensor:
        fixed = params.build(t.detach() for t in tensors)
        start = x0.numpy()
        if not np.all(np.isfinite(start)):
            raise ValueError("fixed_point: x0 holds NaN or inf; start from finite values")
        eps = units_of(start)
        x, old, stop = x0, start.astype(np.float64), StopRule(tol, atol, eps)
        for steps in range(1, max_iter + 1):
            x = _call(f, x, fixed)
            new = x.numpy().astype(np.float64)
            residual, size = step_size(old, new)
            if not math.isfinite(residual):
                break
            done, old = stop(old, new, residual, size), new
            if done:
                _refuse_cycle("forward solve x = f(x, *params)", stop)
                ctx.f, ctx.tol, ctx.max_iter, ctx.params = f, tol, max_iter, params
                ctx.eps = eps
                ctx.save_for_backward(x)  # the backward linearises f here: overwrites refused
                return x
        _not_converged(
            "forward solve x = f(x, *params)",
            steps,
            residual,
            f"atol + tol * max|x| = {atol:g} + {tol:g} * {size:.3g}",
            "The iteration converges where f is a contraction in x (|df/dx| < 1 near the "
            "solution); raise max_iter or tol, or start x0 nearer the solution. A solution "
            "near 0 needs an absolute floor: raise atol to the accuracy x* needs.",
            stop,
        )

    @staticmethod
    def jvp(ctx: FunctionCtx, *tangents: Any) -> Tensor:
        """Implicit function theorem: dx* = (I - df/dx)^-1 (df/dp dp), solved by the iteration
        dx <- df/dx dx + df/dp dp (one JVP of f at x* per step; converges as the forward)."""
        first_order_only(ctx, "an iteration of JVPs of f at the solution")
        x, params, tparams = ctx.saved_tensors[0].detach(), ctx.params, tangents[6:]
        if all(t is None for t in tparams):
            return None
        shape, args = x.expected_numpy_shape(), (x, *params.tensors)

        def tangent(dx: Any, dps: tuple) -> np.ndarray:  # df/dx dx + df/dp dps at x*
            out = forward_trace.tangent_through(
                lambda x, *p: _call(ctx.f, x, params.build(p)), args, (dx, *dps)
            )
            return np.zeros(shape) if out is None else out.numpy().astype(np.float64)

        def apply(dx: np.ndarray) -> np.ndarray:  # df/dx dx
            t = make_tensor(dx.astype(np.float32), dtype=x.dtype, device=x.device)
            return tangent(t, (None,) * len(tparams))

        rhs = tangent(None, tparams)
        dx = _solve("tangent solve (I - df/dx) dx = df/dp dp", "dx", rhs, apply, ctx)
        return make_tensor(dx.astype(np.float32), dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx: FunctionCtx, xbar: Tensor) -> tuple:
        params = ctx.params
        wants = [p.requires_grad for p in params.tensors]
        (x,) = ctx.saved_tensors

        def apply(lam: np.ndarray) -> np.ndarray:  # (df/dx)^T lam
            return _vjp(ctx.f, x, params, [False] * len(wants), lam, True)[0]

        seed = xbar.numpy().astype(np.float64)
        lam = _solve("adjoint solve (I - df/dx)^T lam = xbar", "lam", seed, apply, ctx)
        _, grads = _vjp(ctx.f, x, params, wants, lam, False)
        return (None, *grads)  # x* does not depend on x0


def _solve(
    which: str, name: str, rhs: np.ndarray, apply: Callable[[np.ndarray], np.ndarray], ctx: Any
) -> np.ndarray:
    """v = rhs + L v (L = ``apply``, linear) by the iteration v <- rhs + L v from v = rhs,
    stopping on the relative step alone (linear in rhs: 0 <= 0 for rhs = 0). Non-finite
    elements of rhs (a NaN or inf upstream gradient or tangent) are not a diverging solve:
    the finite part is solved, then they are carried through L (``_spread``), as IEEE
    arithmetic carries them through any other op."""
    bad = ~np.isfinite(rhs)
    finite = np.where(bad, 0.0, rhs)
    v, stop = finite, StopRule(ctx.tol, 0.0, ctx.eps)
    for steps in range(1, ctx.max_iter + 1):
        new = finite + apply(v)
        residual, size = step_size(v, new)
        if not math.isfinite(residual):
            break
        done, v = stop(v, new, residual, size), new
        if done:
            _refuse_cycle(which, stop)
            return _spread(rhs, bad, v, apply, ctx.max_iter) if bad.any() else v
    _not_converged(
        which,
        steps,
        residual,
        f"tol * max|{name}| = {ctx.tol:g} * {size:.3g}",
        _LINEAR_HINT,
        stop,
    )


def _spread(
    rhs: np.ndarray, bad: np.ndarray, v: np.ndarray, apply: Callable, max_iter: int
) -> np.ndarray:
    """``v`` (the solution for rhs's finite part) with rhs's non-finite elements put in and
    carried through L: each step of v <- rhs + L v takes them one hop further (an elementwise
    f: nowhere), until the set of non-finite elements stops growing, after which it never
    grows again. Those elements of rhs keep their value (the leading term of the series
    rhs + L rhs + ..., so an inf keeps its sign); the others reach none of them and keep
    their solution."""
    v = np.where(bad, rhs, v)
    reached = bad
    for _ in range(max_iter):
        v = np.where(bad, rhs, rhs + apply(v))
        now = ~np.isfinite(v)
        if np.array_equal(now, reached):
            break
        reached = now
    return v


def fixed_point(
    f: Callable[..., Any],
    x0: Any,
    *params: Any,
    tol: float = 1e-6,
    max_iter: int = MAX_ITER,
    atol: float = ATOL,
) -> Tensor:
    """The solution x* of ``x = f(x, *params)`` by iterating ``x <- f(x, *params)`` from x0,
    recorded on the active tape with a backward by the implicit function theorem.

    ``f`` is a shader function (called with ``_result="tensor"``) or a Python function of
    pydiff ops and shader calls, mapping x to a tensor of x's shape. The iteration stops when
    every element's step, and the error it leaves for the contraction rho the steps show
    (step * rho / (1 - rho)), is within ``atol + tol * |x_k|`` (as numpy.isclose: ``tol``
    relative, ``atol`` an absolute floor for a solution at or near 0), or it reaches the
    float32 rounding floor: an iterate repeats exactly (a repeat with steps above 1024 units
    of max|x| is an oscillation: ConvergenceError), or the steps, within the bound, reach no
    new low for 4 halving times (see ``StopRule``).
    Gradients flow to the tensor ``params``, also those inside dicts (structs), lists and
    tuples (numbers are constants), never through the iterations: the backward solves
    ``(I - df/dx)^T lam = xbar`` by ``lam <- xbar + (df/dx)^T lam`` with one VJP of f at x*
    per step until ``max|lam_k - lam_(k-1)| <= tol * max|lam_k|`` (relative alone: the solve
    is linear in xbar, so any scale of the upstream gradient gets the same accuracy), then
    ``pbar = (df/dp)^T lam``; NaN or inf in xbar propagate as IEEE arithmetic carries them
    (``_solve``). x* does not depend on x0, which gets no gradient. A forward or
    adjoint solve that does not converge in ``max_iter`` iterations (or overflows) raises
    ``pydiff.ConvergenceError`` with the last residual. Works on a ``pydiff.Tape``, under
    ``pydiff.grad`` and in ``pydiff.torch_function``.

    >>> a = pydiff.tensor([0.5], requires_grad=True)
    >>> b = pydiff.tensor([1.0], requires_grad=True)
    >>> with pydiff.Tape() as tape:
    ...     x = pydiff.fixed_point(lambda x, a, b: a * x + b, np.zeros(1), a, b)
    >>> tape.backward(x)            # x* = b / (1 - a) = 2; b.grad = 1/(1-a) = 2, a.grad = 4
    """
    if not callable(f):
        raise TypeError(f"fixed_point: f must be callable, not {type(f).__name__}")
    check_numbers(tol, atol, max_iter)
    refuse_foreign(params)
    if not isinstance(x0, Tensor):
        x0 = host_start(x0, next((p.device for p in _Params(params).tensors), None))
    elif x0.scalar_type not in ("float", "half"):
        raise TypeError(f"fixed_point: x0 has dtype {x0.dtype!r}; it must be a float tensor")
    flat = _Params(params)
    _refuse_closure_reads(f, x0, flat)
    return FixedPoint.apply(f, float(tol), float(atol), int(max_iter), x0, flat, *flat.tensors)
