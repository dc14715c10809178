"""The finite-difference core of pydiff's derivative checks (a leaf: NumPy only).

``pydiff.gradcheck``, ``pydiff check`` (modcheck) and its tensor variant (tensorcheck) all
test analytic derivatives (AD) against central differences (FD) with these pieces:

    central(evaluate, values, direction, h)      # (f(x + h d) - f(x - h d)) / (2 h)
    per_element(evaluate, values, name, h)       # one central difference per element
    smooth(d_eps, d_small, atol, rtol)           # step eps vs eps/4: no kink, finite
    for_precision(eps, atol, rtol, half)         # steps and tolerances for half values
    excess / worst_excess / compare              # |AD - FD| against atol + rtol * |FD|
    adjoint_gap(ju_v, u_jtv, atol, rtol)         # <J u, v> against <u, J^T v>
    dot(a, b)                                    # sum of elementwise products
    float32_step_hint(max_abs_x, eps, rtol)      # advice: eps too small for float32 at x

Inputs are a ``values`` dict (name -> float64 array) and ``evaluate(values) -> outputs``;
outputs are an array or number, or a list/tuple/dict of them.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

Values = Mapping[Any, np.ndarray]
#: name -> how that input holds a float64 value (``f32``); None or a name missing: exactly
Held = Mapping[Any, Callable[[np.ndarray], np.ndarray]] | None


def _shifted(values: Values, direction: Values, h: float) -> dict[Any, np.ndarray]:
    """values + h * direction; a key without a direction keeps its very array."""
    return {k: v + h * direction[k] if k in direction else v for k, v in values.items()}


def _quotient(plus: Any, minus: Any, h: float) -> Any:
    """(plus - minus) / (2 h) through lists, tuples and dicts of outputs."""
    if isinstance(plus, Mapping):
        return {k: _quotient(plus[k], minus[k], h) for k in plus}
    if isinstance(plus, (list, tuple)):
        return type(plus)(_quotient(a, b, h) for a, b in zip(plus, minus))
    return (plus - minus) / (2 * h)


def central(
    evaluate: Callable[[Values], Any],
    values: Values,
    direction: Values,
    h: float,
    held: Held = None,
) -> Any:
    """Central difference ``(evaluate(x + h d) - evaluate(x - h d)) / (2 h)`` along ``direction``
    (the points rounded as ``held`` says the inputs hold them: see ``realised_direction``).

    ``values`` maps names to arrays; names missing from ``direction`` are held fixed (passed
    through as the same array objects). ``evaluate`` is called at x + h d, then at x - h d;
    its output may be an array or number, or a list, tuple or dict of them (differenced
    item by item).

    >>> f = lambda v: v["x"] ** 2 * v["y"]
    >>> d = central(f, {"x": np.array([1.0, 2.0]), "y": np.array(3.0)},
    ...             {"x": np.array([1.0, 0.0])}, 1e-3)
    >>> np.round(d, 6).tolist()
    [6.0, 0.0]
    """
    plus, minus = (_held(_shifted(values, direction, s * h), held) for s in (1, -1))
    return _quotient(evaluate(plus), evaluate(minus), h)


def _held(values: dict[Any, np.ndarray], held: Held) -> dict[Any, np.ndarray]:
    """``values`` as the inputs will hold them (``held``: name -> rounding, e.g. to float32)."""
    if not held:
        return values
    return {k: held[k](v) if k in held else v for k, v in values.items()}


def realised_direction(values: Values, direction: Values, h: float, held: Held) -> dict:
    """The direction a central difference along ``direction`` actually takes once its points
    are rounded as the inputs hold them: ``(held(x + h d) - held(x - h d)) / (2 h)``. A
    float32 input near 1e3 moves by a multiple of 6.1e-5, not by h = 1e-3: the quotient is a
    derivative along this direction, not along ``direction``.

    >>> x = {"x": np.array([1000.0])}
    >>> realised_direction(x, {"x": np.array([1.0])}, 1e-3, {"x": f32})["x"].round(4).tolist()
    [0.9766]
    """
    plus, minus = (_held(_shifted(values, direction, s * h), held) for s in (1, -1))
    return {k: (plus[k] - minus[k]) / (2 * h) for k in direction}


def f32(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to float32 (as a float32 tensor holds it), in float64."""
    return np.asarray(a, dtype=np.float32).astype(np.float64)


def per_element(
    evaluate: Callable[[Values], Any],
    values: Values,
    name: Any,
    h: float,
    *,
    batch: int = 0,
    project: Callable[[Any], Any] | None = None,
    held: Held = None,
) -> np.ndarray:
    """Central differences along each element of ``values[name]``, one element at a time,
    each divided by the step its rounded points really take (``held``: how the inputs hold
    values, see ``realised_direction``); NaN where rounding leaves no step at all.

    ``evaluate`` (or ``project`` applied to its central difference) must give a number.
    With ``batch=1`` the leading axis holds independent sample points: element j of every
    point is perturbed in the same two calls and each gives one number per point. Returns
    shape ``values[name].shape[:batch] + (elements,)``, elements counted after the batch axes.

    >>> f = lambda v: float(np.sum(v["x"] ** 2))
    >>> np.round(per_element(f, {"x": np.array([1.0, -2.0])}, "x", 1e-3), 6).tolist()
    [2.0, -4.0]
    >>> pts = {"p": np.array([[1.0, 2.0], [3.0, 4.0]])}        # 2 points, 2 components
    >>> g = lambda v: v["p"][:, 0] * v["p"][:, 1]              # one number per point
    >>> np.round(per_element(g, pts, "p", 1e-3, batch=1), 6).tolist()
    [[2.0, 1.0], [4.0, 3.0]]
    """
    base = np.asarray(values[name])
    lead = base.shape[:batch]
    count = int(np.prod(base.shape[batch:]))
    out = np.zeros(lead + (count,))
    for j in range(count):
        unit = np.zeros(lead + (count,))
        unit[..., j] = 1.0
        direction = {name: unit.reshape(base.shape)}
        d = central(evaluate, values, direction, h, held)
        d = d if project is None else project(d)
        if held and name in held:  # per point: the step element j really takes, over h
            real = realised_direction(values, direction, h, held)[name].reshape(lead + (count,))
            with np.errstate(divide="ignore", invalid="ignore"):
                d = np.where(real[..., j] == 0, np.nan, np.asarray(d) / real[..., j])
        out[..., j] = d
    return out


def smooth(d_eps: Any, d_small: Any, atol: float, rtol: float) -> np.ndarray:
    """Where a central difference is usable: finite, and step eps agrees with a smaller step.

    ``d_eps`` and ``d_small`` are the differences with steps eps and eps/4; where they
    disagree by more than ``atol + rtol * |d_eps|`` the point lies near a kink or a
    discontinuity.

    >>> smooth(np.array([1.0, 1.0, np.nan]), np.array([1.0, 0.5, np.nan]), 1e-3, 1e-2).tolist()
    [True, False, False]
    """
    with np.errstate(invalid="ignore"):  # inf - inf: not finite, hence not smooth
        return np.isfinite(d_eps) & (np.abs(d_eps - d_small) <= atol + rtol * np.abs(d_eps))


def excess(ad: Any, fd: Any, atol: float, rtol: float) -> Any:
    """``|AD - FD| - (atol + rtol * |FD|)``: positive where AD fails against the reference FD.

    A NaN or infinity on either side is a failure (``inf``): every comparison with NaN is
    false, so it would otherwise pass; callers leave out non-finite FD entries (outside the
    domain) before comparing when that is what they mean.

    >>> excess(np.array([1.0, 2.0]), np.array([1.0005, 2.1]), 1e-3, 1e-2).round(4).tolist()
    [-0.0105, 0.078]
    >>> excess(np.array([np.nan, np.inf]), np.array([1.0, np.inf]), 1e-3, 1e-2).tolist()
    [inf, inf]
    """
    ad, fd = np.asarray(ad, np.float64), np.asarray(fd, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.abs(ad - fd) - (atol + rtol * np.abs(fd))
    return np.where(np.isfinite(ad) & np.isfinite(fd), e, np.inf)


def worst_excess(ad: np.ndarray, fd: np.ndarray, atol: float, rtol: float) -> tuple[int, float]:
    """(flat index, excess) of the element with the largest excess (a NaN or infinity on
    either side counts as ``inf``). The check fails there when the excess is above 0.

    >>> worst_excess(np.array([1.0, 2.0]), np.array([1.0005, 2.1]), 1e-3, 1e-2)[0]
    1
    """
    e = np.ravel(excess(ad, fd, atol, rtol))
    i = int(np.argmax(e))
    return i, float(e[i])


class Comparison(NamedTuple):
    """AD against FD over the valid entries (see ``compare``)."""

    max_abs: float  # max |AD - FD|
    max_rel: float  # max |AD - FD| / max(|FD|, atol)
    failed: bool  # some entry has |AD - FD| > atol + rtol * |FD|, or a non-finite AD
    nonfinite: int = 0  # valid entries (FD finite) where AD is NaN or infinite


def compare(
    ad: np.ndarray, fd: np.ndarray, valid: np.ndarray, atol: Any, rtol: float
) -> Comparison | None:
    """Max absolute and relative error and the verdict over entries where ``valid`` (``atol``
    a number, or one per entry);
    None when no entry is valid. A NaN or infinite AD where FD is valid fails (and makes
    the maxima NaN/inf); ``nonfinite`` counts those entries.

    >>> compare(np.array([1.0, 5.0]), np.array([1.0005, 2.0]), np.array([True, False]),
    ...         1e-3, 1e-2).failed
    False
    """
    if not valid.any():
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(ad - fd)[valid]
        ref = np.abs(fd)[valid]
        rel = err / np.maximum(ref, np.broadcast_to(atol, np.shape(valid))[valid])
    failed = (excess(ad, fd, atol, rtol)[valid] > 0).any()
    bad = int((~np.isfinite(np.broadcast_to(ad, valid.shape)))[valid].sum())
    return Comparison(float(err.max()), float(rel.max()), bool(failed), bad)


def adjoint_gap(ju_v: float, u_jtv: float, atol: float, rtol: float) -> float:
    """Adjoint (dot-product) test: ``|<J u, v> - <u, J^T v>| - (atol + rtol * |<J u, v>|)``.

    ``ju_v`` comes from a central difference (or forward mode) along u, ``u_jtv`` from the
    backward pass; the test fails when the gap is above 0.

    >>> adjoint_gap(2.0, 2.0005, 1e-3, 1e-2) > 0
    False
    """
    return float(excess(u_jtv, ju_v, atol, rtol))


#: Smallest step of a check through half values: 32 of half's steps near 1 (2^-10 each), a
#: power of two so that x + h and x + 2 h stay exact for sampled |x| < 1.5 on half's grid.
HALF_EPS = 2.0**-5


class Precision(NamedTuple):
    """Steps and tolerances of one check (see ``for_precision``)."""

    eps: float  # the central difference's step
    second: float  # the other step of the kink test (``smooth``)
    atol: float
    rtol: float


def check_settings(where: str, eps: float, atol: float, rtol: float) -> None:
    """Refuse a step or tolerance that would make a check pass without checking: a step that
    is not a positive finite number (every point then looks like a kink, and is skipped), a
    tolerance that is negative or NaN (no comparison can fail, or none can pass).

    >>> check_settings("gradcheck", eps=1e-3, atol=1e-3, rtol=1e-2)
    """
    for name, value, low in (("eps", eps, "> 0"), ("atol", atol, ">= 0"), ("rtol", rtol, ">= 0")):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise TypeError(f"{where}: {name}={value!r} must be a number")
        if not math.isfinite(value) or value < 0 or (name == "eps" and value == 0):
            raise ValueError(f"{where}: {name}={value!r} must be a finite number {low}")


def for_precision(eps: float, atol: float, rtol: float, half: bool = False) -> Precision:
    """The step and tolerances a check uses: as given for float; following half's
    resolution when the function takes or returns half values (``half``).

    Half holds 11 significant bits: a half input changes by at least one of its steps
    (2^-10 near 1), and a value rounded to half (an output, or an intermediate computed in
    half) carries a relative error up to 2^-11, which a central difference divides by 2 h.
    So with ``half`` the step becomes a power of two of at least ``HALF_EPS``, the kink test
    compares with step 2 h instead of h / 4 (that rounding grows as the step shrinks), and
    the tolerances grow to ``atol >= 2e-2``, ``rtol >= 3e-2`` (a derivative off by 10%
    still fails).

    >>> for_precision(1e-3, 1e-3, 1e-2)
    Precision(eps=0.001, second=0.00025, atol=0.001, rtol=0.01)
    >>> for_precision(1e-3, 1e-3, 1e-2, half=True)
    Precision(eps=0.03125, second=0.0625, atol=0.02, rtol=0.03)
    """
    if not half:
        return Precision(eps, eps / 4, atol, rtol)
    h = float(2.0 ** np.ceil(np.log2(max(eps, HALF_EPS))))  # a power of two: exact in half
    return Precision(h, 2 * h, max(atol, 2e-2), max(rtol, 3e-2))


def float32_step_hint(magnitude: float, eps: float, rtol: float) -> str:
    """Advice for a failed check through float32 inputs as large as ``magnitude``, when
    rounding ``x +- eps`` to float32 alone moves the step ``2 eps`` by more than a quarter
    of ``rtol`` (a correct derivative can then fail); "" otherwise.

    Float32 values near x are ``spacing(x)`` apart (6.1e-5 near 1e3), so the step actually
    taken is off by up to one spacing: a relative error ``spacing(x) / (2 eps)`` of the
    difference quotient, 3% at x = 1e3 with eps = 1e-3 (the outputs' rounding adds to it).

    >>> float32_step_hint(1.0, 1e-3, 1e-2)
    ''
    >>> float32_step_hint(1e3, 1e-3, 1e-2)[:40]
    'inputs reach |x| = 1000, where float32 v'
    """
    spacing = float(np.spacing(np.float32(magnitude)))
    if not math.isfinite(spacing) or spacing / (2 * eps) <= rtol / 4:
        return ""
    return (
        f"inputs reach |x| = {magnitude:g}, where float32 values are {spacing:.2g} apart "
        f"({spacing / (2 * eps):.1%} of the step 2*eps = {2 * eps:.2g}): rounding x +- eps "
        "and f(x +- eps) to float32 can make a correct derivative fail; try eps near "
        f"1e-3 * max|x| (eps={1e-3 * magnitude:.3g}), or check the function in double"
    )


def dot(a: Any, b: Any, axis: int | None = None) -> Any:
    """``sum_k sum(a[k] * b[k])``: dicts matched by the keys of ``a``, sequences item by item;
    with ``axis`` the inner sums run along that axis only (e.g. one number per point).

    >>> float(dot({"x": np.array([1.0, 2.0])}, {"x": np.array([3.0, 4.0])}))
    11.0
    >>> dot([np.array([[1.0, 2.0], [3.0, 4.0]])], [np.ones((2, 2))], axis=1).tolist()
    [3.0, 7.0]
    """
    pairs = ((a[k], b[k]) for k in a) if isinstance(a, Mapping) else zip(a, b)
    return sum(np.sum(x * y, axis=axis) for x, y in pairs)


def element_message(
    label: str, index: tuple, ad: float, num: float, atol: float, rtol: float, stuck: str = ""
) -> str:
    """The failure message for one element: a difference beyond the tolerance, a point with
    no step, a non-finite difference or gradient (gradcheck's)."""
    where = f"{label}, element {index}"
    if stuck:
        return (
            f"{where}: {stuck} rounds to one value as the input holds it (float32): there is "
            "no step to take a difference over; raise eps (about 1e-3 * |x|)"
        )
    if not np.isfinite(num):
        return (
            f"{where}: the finite difference is {num:.6g} (the function is not finite near "
            "this point, so its derivative cannot be checked here; move the point)"
        )
    if not np.isfinite(ad):
        return f"{where}: analytic {ad:.6g} where the finite difference is finite ({num:.6g})"
    return (
        f"{where}: analytic {ad:.6g}, numeric {num:.6g} (|diff| {abs(ad - num):.3g} > "
        f"atol + rtol*|numeric| = {atol + rtol * abs(num):.3g})"
    )
