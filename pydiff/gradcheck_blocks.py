"""gradcheck's checks along a direction (the adjoint test, forward mode), one block of
inputs at a time: the checked inputs split by precision (half, other), each block's
direction checked against every group of outputs at the tolerances of that pair of dtypes.

A half input beside float ones loosened the whole direction's check before 2026-11-29: a
``[ForwardDerivative]`` (or a Function's ``jvp``) 2% off in a float input passed as soon as
a half input was checked too.

    worst = directions(fn, f, inputs, state, blocks, ...)   # None, or (excess, message)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from . import finite_diff as fd
from .arguments import map_tensors
from .forward_program import prepare, traced
from .module import ShaderFunction
from .tensor import Tensor
from .unrecorded import is_marked


def input_blocks(checked: list, in_half: dict) -> list[tuple[bool, list]]:
    """The checked inputs' labels by precision: [(half, labels)], one entry per precision
    present (one entry, every input, where all share it: the check as before)."""
    blocks = [(h, [k for k, _ in checked if in_half[k] == h]) for h in (False, True)]
    return [(h, labels) for h, labels in blocks if labels]


def adjoint_gaps(
    evaluate: Callable, originals: dict, us: dict, eps: float, held: dict, groups: dict,
    blocks: list, v_flat: np.ndarray, out_half: np.ndarray, tols: dict,
) -> tuple[tuple[float, str] | None, list]:  # fmt: skip
    """The adjoint test ``<J u, v> = <u, J^T v>`` per input block and output group
    (``groups``: J^T v per output group, 0 other, 1 half). Returns the first failure (or
    None) and, per block, (half, its direction really taken, J u by central differences)."""
    worst, along = None, []
    present = [g for g in (0, 1) if np.any(out_half == g)]
    for h, labels in blocks:
        ub = {k: us[k] for k in labels}
        fd_ju = fd.central(evaluate, originals, ub, eps, held)
        ub = fd.realised_direction(originals, ub, eps, held)  # the direction really taken
        along.append((h, ub, fd_ju))
        for g in present:  # each group of outputs at its tolerances
            vg = v_flat if len(present) == 1 else np.where(out_half == g, v_flat, 0.0)
            ju_v, u_jtv = float(vg @ fd_ju), float(fd.dot(ub, groups[g]))
            gap = fd.adjoint_gap(ju_v, u_jtv, *tols[bool(g) or h])
            if gap > 0 and worst is None:
                what = f"adjoint test{_block(blocks, h)}: <J u, v> = {ju_v:.6g}"
                worst = (gap, f"{what} but <u, J^T v> = {u_jtv:.6g}")
    return worst, along


def _block(blocks: list, h: bool) -> str:
    return "" if len(blocks) == 1 else f" along the {'half' if h else 'non-half'} inputs"


def forward_checks(
    fn: Any, f: Callable, inputs: Sequence[Any], state: Any, along: list, blocks: list,
    want: np.ndarray, v_flat: np.ndarray, analytic: dict, out_half: np.ndarray, tols: dict,
) -> tuple[float, str] | None:  # fmt: skip
    """Forward mode along each block's direction (``along``, from ``adjoint_gaps``): the
    value, the JVP against the central difference, and ``<JVP(u), v> = <u, J^T v>``, at the
    tolerances of the block's precision and each output's."""
    for h, ub, fd_ju in along:
        atol, rtol = (np.where(out_half | h, tols[True][i], tols[False][i]) for i in (0, 1))
        u_jtv = float(fd.dot(ub, analytic))
        worst = _check_forward(fn, f, inputs, state, ub, fd_ju, want, v_flat, u_jtv, atol, rtol)
        if worst is not None:  # "forward mode along the non-half inputs: JVP element ..."
            head, _, rest = worst[1].partition(": ")
            return worst[0], f"{head}{_block(blocks, h)}: {rest}"
    return None


def _check_forward(
    fn: Any, f: Callable, inputs: Sequence[Any], state: Any, us: dict, fd_ju: np.ndarray,
    want: np.ndarray, v_flat: np.ndarray, u_jtv: float, atol: Any, rtol: Any,
) -> tuple[float, str] | None:  # fmt: skip
    if not isinstance(fn, ShaderFunction):  # a Python function or Function: pydiff.jvp's
        dirs = [
            us[state.label_of(a)] if isinstance(a, Tensor) and state.label_of(a) in us else None
            for a in inputs
        ]
        xs, ts = prepare("gradcheck", inputs, dirs, "directions")
        primal, out = traced(f, xs, ts, "gradcheck")
        pairs = zip(primal, out) if isinstance(out, tuple) else [(primal, out)]
        pairs = [(p, t) for p, t in pairs if p.differentiable and not is_marked(p)]  # as outputs
    else:
        pairs = _shader_pairs(fn, inputs, state, us)
    got, jvp = (np.concatenate([_flat(pt[k]) for pt in pairs]) for k in (0, 1))
    # forward mode's value must be fn's own (a [ForwardDerivative]'s wrong primal passed before)
    i, excess = fd.worst_excess(got, want, atol, rtol)
    if excess > 0:
        return excess, f"forward mode: value element {i} is {got[i]:.6g}, fn gives {want[i]:.6g}"
    i, excess = fd.worst_excess(jvp, fd_ju, atol, rtol)
    if excess > 0:
        return (
            excess,
            f"forward mode: JVP element {i} is {jvp[i]:.6g} but the central "
            f"difference along u gives {fd_ju[i]:.6g}",
        )
    ju_v = float(jvp @ v_flat)
    gap = fd.adjoint_gap(ju_v, u_jtv, float(np.max(atol)), float(np.max(rtol)))
    if gap > 0:
        return (
            gap,
            f"forward/reverse adjoint test: <JVP(u), v> = {ju_v:.6g} but <u, J^T v> = {u_jtv:.6g}",
        )
    return None


def _flat(t: Any) -> np.ndarray:
    return np.asarray(t.numpy() if isinstance(t, Tensor) else t, np.float64).ravel()


def _shader_pairs(fn: ShaderFunction, inputs: Sequence[Any], state: Any, us: dict) -> list:
    # Detached views: tangents go on them, not on the caller's tensors. A tensor passed
    # twice (m.times(x, x)) is one variable: every argument on its storage gets its tangent.
    def with_direction(t: Tensor) -> Tensor:
        view, label = t.detach(), state.label_of(t)
        if label in us:
            view.with_tangent(us[label].reshape(t.expected_numpy_shape()))
        return view

    args = [map_tensors(a, with_direction) for a in inputs]  # struct (dict) fields too
    result = fn.fwds(*args)
    pairs = [] if result is None else [tuple(result)]
    written = [args[i] for i in fn.signature.written if isinstance(args[i], Tensor)]
    return pairs + [(w, w.tangent) for w in written if w.differentiable]  # as outputs
