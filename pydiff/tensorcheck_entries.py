"""What a ``pydiff check`` row of a tensor function compares (pydiff.tensorcheck): the
entries of both probe sizes joined, the entries left out and why, and the notes a row says.

    entries = Entries.join([first, second])   # the 4-per-axis probe, then the larger one
    note = entries.worst(rtol=1e-2)           # "worst at x[5] (output y, 31 per axis): ..."

An entry is one (output, input element) pair: the derivative of <v, output> with respect to
that element, from ``.bwds`` (``ad``) and from central differences (``numeric``, by
``along`` and ``per_element``, with how far float32 rounding of the outputs can move them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import finite_diff as fd

#: Roundings at an output's scale that the function's own float32 arithmetic may add to the
#: output's last one (samples/pinn_poisson's net_xx, 32 terms near 60: up to 3 seen).
ROUNDINGS = 8
#: Sizes per axis of the second probe, by the tensors' axes: 31 for 1-D tensors, 15 for 2-D,
#: 7 for 3-D (none for 4-D: 7^4 exceeds ``tensorcheck.PROBE_MAX_ELEMENTS``). Every first
#: probe's size is a multiple of 4 (4 and its doublings): these are 7 more than a multiple of
#: 8, so a backward that handles 2, 4 or 8 elements a step and drops the tail (``n % 4`` of
#: them) is wrong at the last element, always checked; and 1-D tensors reach past a second
#: tile of 16 (larger sizes for 2-D took twice as long over the samples: 10 -> 19 s).
LARGER_SIZES = {1: 31, 2: 15, 3: 7}


def larger_size(size: int, dims: int, max_elements: int) -> int | None:
    """The second probe's size per axis after a first one at ``size``, or None where none
    fits: ``LARGER_SIZES[dims]``, or past it (a function that needed as many or more) the
    smallest size above ``size`` that is 7 more than a multiple of 8.

    >>> [larger_size(4, 1, 1024), larger_size(4, 2, 1024), larger_size(4, 3, 1024)]
    [31, 15, 7]
    >>> larger_size(16, 2, 1024), larger_size(32, 1, 1024), larger_size(32, 2, 1024)
    (23, 39, None)
    """
    above = size + 8 - (size + 1) % 8  # the smallest n > size with n % 8 == 7
    sizes = (LARGER_SIZES[dims], above) if dims in LARGER_SIZES else (above,)
    return next((n for n in sizes if n > size and n**dims <= max_elements), None)


#: Elements of each input tensor perturbed in the second probe (each costs six calls): the
#: last one and a seeded random draw of the rest, all outside the block the first probe
#: covered (a 1-D tensor of 31 has 27 there, so all of them are taken; a 2-D one of 15 has
#: 209), and element 0 besides.
SAMPLED_ELEMENTS = 32


def sampled_elements(
    shape: tuple, covered: int, rng: np.random.Generator, count: int = SAMPLED_ELEMENTS
) -> np.ndarray:
    """Flat indices of up to ``count`` elements of a tensor of ``shape`` lying outside the
    block ``[0, covered)`` per axis (what a smaller probe perturbed): the last element, then
    a seeded random draw of the others, in increasing order; and first, element 0.

    >>> sampled_elements((31,), 4, np.random.default_rng(0)).tolist()[:3]
    [0, 4, 5]
    """
    grid = np.indices(shape).reshape(len(shape), -1)
    outside = np.flatnonzero(np.any(grid >= covered, axis=0))
    if outside.size > count:
        rest = rng.choice(outside[:-1], count - 1, replace=False)
        outside = np.sort(np.append(rest, outside[-1]))
    # and the first element: at the larger size, elements of the first block may take other
    # threads' contributions (a breaker's y[i] = x[i % 4]^2 storing where it must add)
    return np.append(0, outside)


def element_label(name: str, index: tuple, output: str, where: str) -> str:
    """An entry's label: the element in NumPy order, then for 2 to 4 axes as a Slang vector
    index, which is reversed (``w.load(int2(9, 6))`` reads NumPy's ``w[6, 9]``: x is the last
    axis; an ``int[2]`` array index is in NumPy order), then the output and the probe's size.

    >>> element_label("w", (6, 9), "(result)", "15 per axis")
    'w[6, 9] (Slang index int2(9, 6); output (result), 15 per axis)'
    """
    numpy = ", ".join(str(int(i)) for i in index)
    slang = ", ".join(str(int(i)) for i in reversed(index))
    vector = f"Slang index int{len(index)}({slang}); " * (2 <= len(index) <= 4)
    return f"{name}[{numpy}] ({vector}output {output}, {where})"


@dataclass
class Entries:
    """The entries of one row (an input's backward, or the adjoint) from one or more probes."""

    ad: np.ndarray
    numeric: np.ndarray
    valid: np.ndarray  # compared: finite, smooth and resolved
    finite: np.ndarray  # False: left out as outside the domain (a non-finite output's doing)
    atol: np.ndarray  # per entry, widened by the outputs' float32 rounding
    labels: list[str]  # per entry: "x[5] (output y, 31 per axis)" (element_label)
    unresolved: int = 0  # entries left out: the step cannot resolve them (``unresolved``)
    dropped: list[str] = field(default_factory=list)  # "2 of 4 at 4 per axis", per probe
    excused: int = 0  # of those not finite, entries whose differences were finite
    ARRAYS = ("ad", "numeric", "valid", "finite", "atol")  # (a class constant, not a field)

    @classmethod
    def join(cls, parts: list["Entries"]) -> "Entries":
        """One row's entries from several probes."""
        arrays = (np.concatenate([getattr(p, k) for p in parts]) for k in cls.ARRAYS)
        labels = [label for p in parts for label in p.labels]
        dropped = [d for p in parts for d in p.dropped]
        unresolved, excused = (sum(getattr(p, k) for p in parts) for k in ("unresolved", "excused"))
        return cls(*arrays, labels, unresolved, dropped, excused)

    def excused_note(self) -> str:
        """Why a row with ``excused`` entries is not passed."""
        return (
            f"not passed: the derivative is NaN or infinite at {self.excused} entr"
            f"{'y' if self.excused == 1 else 'ies'} where finite differences are finite, beside "
            "NaN outputs (a NaN thread's backward times 0 cannot be told from a wrong "
            "derivative): check it on inputs where every output is finite"
        )

    def worst(self, rtol: float) -> str:
        """Where the row fails worst, naming the element and the probe's size; "" if it
        passes (or compares nothing)."""
        if not self.valid.any():
            return ""
        excess = np.where(self.valid, fd.excess(self.ad, self.numeric, self.atol, rtol), -np.inf)
        at = int(np.argmax(excess))
        if excess[at] <= 0:
            return ""
        return f"worst at {self.labels[at]}: AD {self.ad[at]:.4g}, FD {self.numeric[at]:.4g}"

    def notes(self) -> str:
        """Entries left out because outputs were NaN or infinite, when any were."""
        if not self.dropped:
            return ""
        out = int((~self.finite).sum())
        notes = [
            f"output elements NaN or infinite ({', '.join(self.dropped)}) left out of <v, outputs>"
        ]
        if out:
            notes.append(f"{out} entr{'y' if out == 1 else 'ies'} not finite there left out")
        return "; ".join(notes)


def unresolved(
    numeric: np.ndarray, ad: np.ndarray, rounding: np.ndarray, atol: float
) -> np.ndarray:
    """Entries the step cannot resolve: float32 rounding of the outputs they move (over the
    step) is above ``atol``, above half of what either side claims, and above their
    disagreement (a larger one is real: a breaker's 0.020 apart against 0.0118). There a
    difference of 0 says nothing (an output near 1e6 moved less than its rounding step by
    x^2's derivative, and a wrong 100 against a true 0.01 looked alike): they are left out
    and counted, and
    the row says to take a larger ``--eps``.

        unresolved(np.array([0.0]), np.array([6.0]), np.array([250.0]), 1e-3)   # [True]
    """
    claimed = np.maximum(np.abs(numeric), np.abs(ad))
    with np.errstate(invalid="ignore"):
        # (a disagreement larger than the rounding is a real one: compared, not left out)
        return (rounding > atol) & (rounding > 0.5 * claimed) & (np.abs(numeric - ad) <= rounding)


def widened(atol, valid: np.ndarray, given: float, unresolved: int = 0, note: str = "") -> str:  # noqa: ANN001
    """A row's note: its tolerance grew past twice ``given`` (float32 rounding of large
    outputs, ``along``), how many entries the step could not resolve, and
    ``note`` (entries left out, where it fails worst); else "".

        widened(np.array([1e-3, 0.09]), np.array([True, True]), 1e-3)   # "atol up to 0.09: ..."
    """
    notes = []
    widest = float(np.max(np.broadcast_to(atol, np.shape(valid))[valid], initial=0.0))
    if widest > 2 * given:
        notes.append(f"atol up to {widest:.3g}: float32 rounding of the outputs the step moved")
    if unresolved:
        notes.append(
            f"{unresolved} element(s) left out: the step cannot resolve them against the "
            "outputs' float32 rounding (rerun with a larger --eps)"
        )
    return "; ".join(notes + [note] * bool(note))


#: The step at which an output counts as depending on an element (it moves there): a large
#: output the check's step leaves unmoved may still depend on it.
DEPENDENCE_STEP = 0.05


def along(setup: Any, upstream: dict, direction: dict, steps: tuple) -> list:
    """Per step, per output: the central difference of <upstream, output> along
    ``direction`` and how far float32 rounding can move it. The rounding counts the outputs
    that depend on the direction (they move at ``DEPENDENCE_STEP`` or at the step): one that
    does not cancels exactly, however large (a constant 1e7 beside must not widen the
    tolerance), while one that depends but did not move at the step still rounds. Roundings
    add as independent errors (the root of the sum of squares: a plain sum over 1024 outputs
    let a dropped gradient pass), ``ROUNDINGS`` of them at each output's scale."""

    def shifted(h: float) -> dict:
        return {k: v + h * direction[k] if k in direction else v for k, v in setup.values.items()}

    far_high, far_low = setup.run(shifted(DEPENDENCE_STEP)), setup.run(shifted(-DEPENDENCE_STEP))
    out = []
    for h in steps:
        high, low = setup.run(shifted(h)), setup.run(shifted(-h))
        differences, roundings = {}, {}
        with np.errstate(invalid="ignore"):
            for k in high:
                moved = np.where(upstream[k] != 0, (high[k] - low[k]) * upstream[k], 0.0)
                differences[k] = float(np.sum(moved)) / (2 * h)
                depends = (high[k] != low[k]) | (far_high[k] != far_low[k])
                steps_k = np.spacing(np.abs(high[k][depends]).astype(np.float32)) + np.spacing(
                    np.abs(low[k][depends]).astype(np.float32)
                )
                spread = float(np.sqrt(np.nansum((upstream[k][depends] * steps_k / 2) ** 2)))
                roundings[k] = ROUNDINGS * spread / (2 * h)
        out.append((differences, roundings))
    return out


def per_element(setup: Any, upstream: dict, name: str, steps: tuple, chosen: np.ndarray) -> list:
    """``along`` each ``chosen`` element (flat index) of input ``name`` in turn: per step,
    (per output an array of differences, per output an array of roundings), one entry per
    chosen element."""
    shape = setup.values[name].shape
    count = int(np.prod(shape))
    found = [({}, {}) for _ in steps]
    for at, k in enumerate(chosen):
        unit = np.zeros(count)
        unit[k] = 1.0
        for (out, rounding), (d, r) in zip(
            found, along(setup, upstream, {name: unit.reshape(shape)}, steps)
        ):
            for o in d:
                out.setdefault(o, np.zeros(len(chosen)))[at] = d[o]
                rounding.setdefault(o, np.zeros(len(chosen)))[at] = r[o]
    return found
