"""gradcheck: compare backward gradients with central finite differences in float64.

ok = pydiff.gradcheck(m.polynomial, (2.0, 8.0, -1.0, x))           # x requires_grad
pydiff.gradcheck(Legendre3, (x,), eps=1e-3, atol=1e-3, rtol=1e-2)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import numpy as np

from . import finite_diff as fd
from .errors import GradcheckError
from .function import Function
from .module import ShaderFunction
from .policy import zero_policy
from .tape import Tape
from .tensor import Tensor


def as_callable(fn: Any) -> Callable[..., Any]:
    """``fn`` as a plain callable returning tensors (module functions return a tensor).

    as_callable(m.square)(x)       # a pydiff.Tensor, as m.square(x, _result="tensor")
    """
    if isinstance(fn, ShaderFunction):
        return lambda *a: fn(*a, _result="tensor")
    if inspect.isclass(fn) and issubclass(fn, Function):
        return fn.apply
    if callable(fn):
        return fn
    raise TypeError(
        f"gradcheck: fn must be a module function, a pydiff.Function or a callable, not {fn!r}"
    )


def _outputs(value: Any) -> list[Tensor]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    outs = [o for o in items if isinstance(o, Tensor)]
    if not outs:
        raise TypeError("gradcheck: fn returned no pydiff.Tensor")
    return outs


def _flat_outputs(f: Callable, inputs: Sequence[Any]) -> np.ndarray:
    return np.concatenate([o.numpy().astype(np.float64).ravel() for o in _outputs(f(*inputs))])


def _wants_forward(fn: Any, check_forward: bool | None) -> bool:
    if check_forward is not None:
        if check_forward and not isinstance(fn, ShaderFunction):
            raise TypeError(
                "gradcheck: check_forward=True needs a module function "
                "(forward mode runs Slang's fwd_diff)"
            )
        return check_forward
    if not isinstance(fn, ShaderFunction) or not fn.differentiable:
        return False
    # Automatic only where forward mode can see every input's derivative.
    return all(p.tensor_kind in (None, "fwd", "plain") for p in fn.params)


def _check_forward(
    fn: ShaderFunction,
    inputs: Sequence[Any],
    checked: list,
    us: dict,
    fd_ju: np.ndarray,
    v_flat: np.ndarray,
    u_jtv: float,
    atol: float,
    rtol: float,
) -> tuple[float, str] | None:
    args = list(inputs)
    for k, t in checked:
        args[k] = t.detach().with_tangent(us[k])
    _, tangent = fn.fwds(*args)
    jvp = np.asarray(
        tangent.numpy() if isinstance(tangent, Tensor) else tangent, np.float64
    ).ravel()
    i, excess = fd.worst_excess(jvp, fd_ju, atol, rtol)
    if excess > 0:
        return (
            excess,
            f"forward mode: JVP element {i} is {jvp[i]:.6g} but the central "
            f"difference along u gives {fd_ju[i]:.6g}",
        )
    ju_v = float(jvp @ v_flat)
    gap = fd.adjoint_gap(ju_v, u_jtv, atol, rtol)
    if gap > 0:
        return (
            gap,
            f"forward/reverse adjoint test: <JVP(u), v> = {ju_v:.6g} but <u, J^T v> = {u_jtv:.6g}",
        )
    return None


def gradcheck(
    fn: Any,
    inputs: Sequence[Any],
    *,
    eps: float = 1e-3,
    atol: float = 1e-3,
    rtol: float = 1e-2,
    raise_exception: bool = True,
    seed: int = 0,
    check_forward: bool | None = None,
) -> bool:
    """Check the backward of ``fn`` at ``inputs`` against central finite differences.

    ``fn`` is a module function (called with ``_result="tensor"``), a ``pydiff.Function``
    subclass, or a Python callable of pydiff calls returning tensor(s). Inputs with
    ``requires_grad`` are checked; others are held fixed.

    Pass rule, with random upstream v and direction u (fixed by ``seed``):
      1. vector-Jacobian product: for every element i of every checked input,
         ``|AD_i - FD_i| <= atol + rtol * |FD_i|`` where AD = (J^T v)_i from the tape and
         FD_i = <v, (f(x + eps e_i) - f(x - eps e_i)) / (2 eps)>;
      2. adjoint test: ``|<J u, v> - <u, J^T v>| <= atol + rtol * |<J u, v>|`` with J u by a
         central difference along u (exact up to rounding for linear maps).
      3. forward mode (module functions; ``check_forward=None`` checks it whenever the
         function supports ``.fwds``): the JVP ``J u`` from ``fn.fwds`` against the central
         difference along u, element by element, and ``<JVP(u), v> = <u, J^T v>``.
    Returns True, or raises GradcheckError naming the worst element (input, index, analytic,
    numeric); with ``raise_exception=False`` returns False instead.

    >>> x = pydiff.tensor([0.3, -1.2], requires_grad=True)
    >>> pydiff.gradcheck(m.polynomial, (2.0, 8.0, -1.0, x))
    True
    """
    f = as_callable(fn)
    checked = [(k, t) for k, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]
    if not checked:
        raise ValueError("gradcheck: no input has requires_grad=True; nothing to check")
    rng = np.random.default_rng(seed)
    originals = {k: t.numpy().astype(np.float64) for k, t in checked}

    # Analytic J^T v through the tape, into fresh gradient buffers.
    with Tape() as tape:
        outs = _outputs(f(*inputs))
    vs = [rng.uniform(-1.0, 1.0, o.expected_numpy_shape()) for o in outs]
    saved = {k: t.grad.numpy().copy() for k, t in checked}
    for _, t in checked:
        t.zero_grad()
    with zero_policy("accumulate"):
        if len(outs) == 1:
            tape.backward(outs[0], grad=vs[0])
        else:
            # Several outputs: L = sum_j <v_j, out_j>, one backward per output.
            for o, v in zip(outs, vs):
                tape.backward(o, grad=v)
    analytic = {k: t.grad.numpy().astype(np.float64) for k, t in checked}
    for k, t in checked:  # leave the caller's gradients as they were
        t.grad.copy_from_numpy(saved[k])
    v_flat = np.concatenate([v.ravel() for v in vs])

    loaded = dict(originals)  # the array each checked input holds now

    def load(values: dict[int, np.ndarray]) -> None:  # uploads only what changed
        for k, t in checked:
            if values[k] is not loaded[k]:
                t.copy_from_numpy(values[k])
                loaded[k] = values[k]

    def evaluate(values: dict[int, np.ndarray]) -> np.ndarray:  # f at values, flattened
        load(values)
        return _flat_outputs(f, inputs)

    def project(values: dict[int, np.ndarray]) -> float:  # <v, f(values)>
        return float(v_flat @ evaluate(values))

    worst: tuple[float, str] | None = None
    try:
        for k, _ in checked:
            numeric = fd.per_element(project, originals, k, eps)
            ad = analytic[k].ravel()
            i, excess = fd.worst_excess(ad, numeric, atol, rtol)
            if excess > 0 and (worst is None or excess > worst[0]):
                index = np.unravel_index(i, originals[k].shape)
                worst = (
                    excess,
                    f"input {k}, element {tuple(int(j) for j in index)}: analytic {ad[i]:.6g}, "
                    f"numeric {numeric[i]:.6g} (|diff| {abs(ad[i] - numeric[i]):.3g} > "
                    f"atol + rtol*|numeric| = {atol + rtol * abs(numeric[i]):.3g})",
                )
        # Adjoint dot-product test along a random direction u.
        us = {k: rng.uniform(-1.0, 1.0, originals[k].shape) for k, _ in checked}
        fd_ju = fd.central(evaluate, originals, us, eps)
        ju_v = float(v_flat @ fd_ju)
        u_jtv = float(fd.dot(us, analytic))
        gap = fd.adjoint_gap(ju_v, u_jtv, atol, rtol)
        if gap > 0 and worst is None:
            worst = (gap, f"adjoint test: <J u, v> = {ju_v:.6g} but <u, J^T v> = {u_jtv:.6g}")
        load(originals)  # forward mode runs at x itself
        if worst is None and _wants_forward(fn, check_forward):
            worst = _check_forward(fn, inputs, checked, us, fd_ju, v_flat, u_jtv, atol, rtol)
    finally:
        for k, t in checked:
            t.copy_from_numpy(originals[k])
    if worst is None:
        return True
    name = getattr(fn, "label", getattr(fn, "__name__", repr(fn)))
    message = f"gradcheck failed for {name}: {worst[1]}"
    if raise_exception:
        raise GradcheckError(message)
    return False
