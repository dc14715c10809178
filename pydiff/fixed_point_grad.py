"""Fixed-point gradient accumulators for pydiff's tensor types (FwdDiffTensor, RWFwdDiffTensor).

A backward adds each contribution to two int64 words per element (shaders/accumulate.slang):
integer addition is associative, so the sum has the same bits whatever order the threads
arrive in, and it is exact down to 2^-64. After the call the words are added into the float
gradient (rounded once); contributions or sums out of range, and NaN/inf, raise instead of
wrapping silently.

    acc = FixedPointAccumulator(scope, device, x.numel, "f.bwds: parameter 'x'", 0, True)
    fields = acc.fields()            # the FixedPointGrad struct SlangPy binds
    acc.add_into(x.grad.native)      # after the call: x.grad += sum, checked at scope end
"""

from __future__ import annotations

from typing import Any

import slangpy as spy

from .errors import GradientOverflowError

SUM_LIMIT = 2.0**31  # |every partial sum| must stay below this
CONTRIBUTION_LIMIT = 2.0**30  # |each single contribution|
RESOLUTION = 2.0**-64  # each contribution is truncated to a multiple of this


def dummy_fields(device: Any) -> dict:
    """Fields for a FwdDiffTensor whose gradient is never added to (forward calls)."""
    key = ("fixed-point", "dummy")
    if key not in device.scratch:
        words = spy.Tensor.zeros(device.native, (2,), "int64_t")
        status = spy.Tensor.zeros(device.native, (1,), "uint")
        device.scratch[key] = {"words": words.storage, "status": status.storage, "slot": 0}
    return device.scratch[key]


class FixedPointAccumulator:
    """The int64 words for one tensor's gradient in one backward call, and their status."""

    def __init__(self, scope: Any, device: Any, numel: int, desc: str, ordinal: int, checked: bool):
        key = ("fixed-point", numel, ordinal)
        if key not in device.scratch:
            device.scratch[key] = spy.Tensor.zeros(device.native, (2 * max(numel, 1),), "int64_t")
        self.words = device.scratch[key]
        scope.clear(device, self.words)
        self.status = spy.Tensor.zeros(device.native, (1,), "uint")
        self.scope, self.device, self.numel, self.desc = scope, device, numel, desc
        if checked:
            scope.on_finish(self._check)

    def fields(self) -> dict:
        return {"words": self.words.storage, "status": self.status.storage, "slot": 0}

    def add_into(self, grad: Any) -> None:
        """Dispatch grad += the accumulated sum (``grad`` a contiguous float SlangPy tensor)."""
        node = self.device.library.det_fixed_point_add_into
        flat = grad.view((self.numel,))
        self.scope.dispatch(node, spy.grid((self.numel,)), self.words.storage, flat)

    def _check(self) -> None:
        bits = int(self.status.to_numpy().reshape(-1)[0])
        if bits & 2:
            raise GradientOverflowError(
                f"{self.desc}: a gradient contribution was NaN or infinite; pydiff's fixed-point "
                "accumulator cannot hold it, so this gradient buffer is not valid"
            )
        if bits & 1:
            raise GradientOverflowError(
                f"{self.desc}: the gradient left pydiff's fixed-point range (each contribution "
                f"|g| < 2^30 = {CONTRIBUTION_LIMIT:.0f}, every partial sum < 2^31 = "
                f"{SUM_LIMIT:.0f}); "
                "this gradient buffer is not valid. Scale the loss down"
            )
