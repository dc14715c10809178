"""When ``fixed_point``'s iterations stop: the step test, corrected for slow contraction,
and the float rounding floor.

    stop = StopRule(tol=1e-6, atol=1e-12)
    for ...:
        residual, size = step_size(old, new)
        if stop(old, new, residual, size): break
    stop.cycle       # (period, largest step) where it stopped on a repeating iterate

A step of ``s`` in an iteration contracting by ``rho`` per step leaves an error of about
``s * rho / (1 - rho)`` (the rest of the geometric series), far more than ``s`` where rho
is near 1 (``rho = 0.99``: 99 s). So once the step itself is within the bound, the
iteration goes on until that estimated error is within it too. ``rho`` comes from the last
two steps at which the step had halved since the previous such step (a ratio of
consecutive steps is no estimate once they are a few float32 units; a ratio of 2 is).

Where float rounding keeps the error above that bound, the iteration stops at the floor,
recognised by what it does there rather than by a guess at its size:

- the iterate repeats one it had before, exactly: the iteration (a deterministic map of
  float values) is periodic from then on and can get no nearer, however long it runs.
  Near a solution, float32 rounding ends almost every iteration of a small state this way:
  at a fixed point (period 1), or a short cycle where the contraction rotates (complex
  eigenvalues of df/dx: a period-5 cycle for a rotation by 2.5 rad). The cycle's steps are
  rounding, a few units of the largest term, and may lie above ``tol * max|x|``; a cycle
  whose steps are above ``CYCLE_UNITS`` units of ``max|x|`` (and the bound) is no rounding floor
  (``f`` oscillates), and ``cycle_refused`` says so.
- a large state seldom repeats exactly, but its rounding errors average out: its steps,
  once within the bound, stop reaching a new low. The steps of a converging iteration
  reach one at least every halving time (the contraction quarters the step in two, more
  than a rotation or a non-normal transient can raise the max-abs step), so 4 halving
  times without one is the floor. (Quantised to whole units, a step can stay equal for
  dozens of iterations while the error still falls: a count of a few steps stopped a
  rho = 0.99 rotation at 17 times its floor.)
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

#: A repeating iterate whose steps are all within this many units (eps) of max|x| is float
#: rounding (a few units of f's terms, up to about 70 seen where rho is 0.998), as long as
#: that is within ``CYCLE_CAP * max|x|``; larger repeating steps are an oscillating f.
CYCLE_UNITS = 1024
CYCLE_CAP = 1e-3
#: Halving times without a new low of the step (within the bound) that mark the floor.
STALL_HALVINGS = 4


def step_size(old: np.ndarray, new: np.ndarray) -> tuple[float, float]:
    """(max |new - old|, max |new|): the step and the size of the new iterate."""
    if not new.size:
        return 0.0, 0.0
    return float(np.max(np.abs(new - old))), float(np.max(np.abs(new)))


class StopRule:
    """When an iteration may stop. Once the whole step is within ``atol + tol * max|x|``:
    when every element's step is within ``atol + tol * |element|`` too (as numpy.isclose; a
    small, slowly converging component is not stopped by the size of a large one) and so
    is the error the step leaves, step * rho / (1 - rho) for the contraction rho the steps
    show (where that exceeds the step: rho above 1/2); or when the steps have reached no
    new low for ``STALL_HALVINGS`` halving times (float rounding of f's terms). At any
    step, when the iterate repeats an earlier one exactly (the float rounding floor; see
    the module docstring): then ``cycle`` is (period, largest step of the cycle), and
    ``cycle_refused()`` says whether those steps are too large to be rounding.

    >>> stop = StopRule(1e-6, 0.0); stop(old, new, *step_size(old, new))
    """

    def __init__(self, tol: float, atol: float, eps: float = float(np.finfo(np.float32).eps)):
        self.tol, self.atol, self.eps = tol, atol, eps
        self.count, self.best, self.best_at = 0, math.inf, 0
        # (iteration, step) where the step had halved since the one before; the first step.
        self.halvings: list[tuple[int, float]] = []
        self.seen: dict[bytes, int] = {}  # a digest of each iterate: the iteration it came
        self.steps: list[float] = []
        self.size = 0.0
        self.cycle: tuple[int, float] | None = None

    def __call__(self, old: np.ndarray, new: np.ndarray, residual: float, size: float) -> bool:
        self.count, self.size = self.count + 1, size
        self.steps.append(residual)
        if not self.halvings or residual <= 0.5 * self.halvings[-1][1]:
            self.halvings = [*self.halvings[-1:], (self.count, residual)]
        if residual < 0.99 * self.best:
            self.best, self.best_at = residual, self.count
        if residual <= self.atol + self.tol * size:
            step, mag = np.abs(new - old), np.abs(new)
            if not new.size or bool(np.all(step <= self.atol + self.tol * mag)):
                if self.error_within(step, mag, residual, size):
                    return True
            if self.count - self.best_at >= max(8, STALL_HALVINGS * self.halving_time()):
                return True
        return self.repeats(new)

    def halving_time(self) -> int:
        """Iterations the step last took to halve (all of them so far if it never did)."""
        if len(self.halvings) < 2:
            return self.count
        return self.halvings[1][0] - self.halvings[0][0]

    def repeats(self, new: np.ndarray) -> bool:
        """Whether ``new`` equals an earlier iterate (digests of 16 bytes: a collision is
        beyond any run's length), recording the cycle it closes."""
        key = hashlib.blake2b(np.ascontiguousarray(new).tobytes(), digest_size=16).digest()
        first = self.seen.setdefault(key, self.count)
        if first == self.count:
            return False
        period = self.count - first
        self.cycle = (period, max(self.steps[-period:]))
        return True

    def cycle_refused(self) -> bool:
        """Whether the cycle stopped on has steps too large for float rounding: both above
        the step bound and above ``CYCLE_UNITS`` units of max|x| (1.2e-4 max|x| in float32)."""
        if self.cycle is None:
            return False
        limit = self.atol + max(self.tol, min(CYCLE_UNITS * self.eps, CYCLE_CAP)) * self.size
        return self.cycle[1] > limit

    def stalled_for(self) -> int:
        """Iterations since the step last reached a new low."""
        return self.count - self.best_at

    def error_within(self, step: np.ndarray, mag: np.ndarray, residual: float, size: float) -> bool:
        """Whether the error the step leaves, step * rho / (1 - rho), is within the bound."""
        if len(self.halvings) < 2 or residual <= 0.0:
            return True  # within the bound from the first step, or exactly still
        (k0, s0), (k1, s1) = self.halvings
        rho = (s1 / s0) ** (1.0 / (k1 - k0))
        left = rho / (1.0 - rho)  # the rest of the series, per unit of this step
        if left <= 1.0:
            return True
        return residual * left <= self.atol + self.tol * size and bool(
            np.all(step * left <= self.atol + self.tol * mag)
        )


def units_of(values: np.ndarray) -> float:
    """The relative rounding unit (eps) of ``values``' float type; float32's otherwise."""
    kind = values.dtype if values.dtype.kind == "f" else np.float32
    return float(np.finfo(kind).eps)
