"""When ``fixed_point``'s iterations stop: the step test, corrected for slow contraction.

    stop = StopRule(tol=1e-6, atol=1e-12)
    for ...:
        residual, size = step_size(old, new)
        if stop(old, new, residual, size): break

A step of ``s`` in an iteration contracting by ``rho`` per step leaves an error of about
``s * rho / (1 - rho)`` (the rest of the geometric series), far more than ``s`` where rho
is near 1 (``rho = 0.99``: 99 s). So once the step itself is within the bound, the
iteration goes on until that estimated error is within it too. ``rho`` comes from the last
two steps at which the step had halved since the previous such step: a ratio of consecutive
steps is no estimate once they are a few float32 units (16 units, then 16 again), a ratio
of at least 2 is. Steps that then take more than twice as long to halve again as they last
did (or never halved) have reached the rounding floor, and the iteration stops there.
"""

from __future__ import annotations

import math

import numpy as np


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
    show (where that exceeds the step: rho above 1/2); or when the steps stop shrinking
    (float32 rounding of terms larger than a small element: 5 steps without a new low; or
    no halving in twice the steps the last one took), where nothing more can be resolved.

    >>> stop = StopRule(1e-6, 0.0); stop(old, new, *step_size(old, new))
    """

    def __init__(self, tol: float, atol: float):
        self.tol, self.atol, self.best, self.stalled = tol, atol, math.inf, 0
        self.count = 0
        # (iteration, step) where the step had halved since the one before; the first step.
        self.halvings: list[tuple[int, float]] = []

    def __call__(self, old: np.ndarray, new: np.ndarray, residual: float, size: float) -> bool:
        self.count += 1
        if not self.halvings or residual <= 0.5 * self.halvings[-1][1]:
            self.halvings = [*self.halvings[-1:], (self.count, residual)]
        if residual > self.atol + self.tol * size:
            return False
        step, mag = np.abs(new - old), np.abs(new)
        if not new.size or bool(np.all(step <= self.atol + self.tol * mag)):
            return self.error_within(step, mag, residual, size)
        if residual < 0.99 * self.best:
            self.best, self.stalled = residual, 0
        else:
            self.stalled += 1
        return self.stalled >= 5

    def error_within(self, step: np.ndarray, mag: np.ndarray, residual: float, size: float) -> bool:
        """Whether the error the step leaves, step * rho / (1 - rho), is within the bound,
        or the steps (already within it) have stopped shrinking: the rounding floor."""
        if len(self.halvings) < 2 or residual <= 0.0:
            return True  # within the bound from the first step, or exactly still
        (k0, s0), (k1, s1) = self.halvings
        if self.count - k1 > 2 * (k1 - k0):
            return True  # no halving in twice the steps the last one took
        rho = (s1 / s0) ** (1.0 / (k1 - k0))
        left = rho / (1.0 - rho)  # the rest of the series, per unit of this step
        if left <= 1.0:
            return True
        return residual * left <= self.atol + self.tol * size and bool(
            np.all(step * left <= self.atol + self.tol * mag)
        )
