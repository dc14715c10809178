"""Fixed-point gradient accumulators for pydiff's tensor types (FwdDiffTensor, RWFwdDiffTensor).

A backward adds each contribution to two int64 words per element (shaders/accumulate.slang):
integer addition is associative, so the sum has the same bits whatever order the threads
arrive in, and it is exact down to 2^-64. After the call the words are added into the float
gradient (rounded once). IEEE's values the words cannot hold are carried beside them, per
element: an inf contribution makes that element's gradient inf, +inf with -inf or any NaN
makes it NaN, as a float sum would. A finite contribution or partial sum out of range
raises ``GradientOverflowError`` instead of wrapping silently.

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
RESOLUTION = 2.0**-64  # each contribution is truncated (towards zero) to a multiple of this


def dummy_fields(device: Any) -> dict:
    """Fields for a FwdDiffTensor whose gradient is never added to (forward calls)."""
    key = ("fixed-point", "dummy")
    if key not in device.scratch:
        words = spy.Tensor.zeros(device.native, (2,), "int64_t")
        special = spy.Tensor.zeros(device.native, (1,), "uint")
        device.scratch[key] = {"words": words.storage, "special": special.storage}
    return device.scratch[key]


class FixedPointAccumulator:
    """The int64 words and per-element IEEE bits of one tensor's gradient in one backward
    call (this thread's scratch buffers), and the status its addition reports."""

    def __init__(self, scope: Any, device: Any, numel: int, desc: str, ordinal: int, checked: bool):
        key = ("fixed-point", numel, ordinal)
        if key not in device.scratch:
            n = max(numel, 1)
            device.scratch[key] = (
                spy.Tensor.zeros(device.native, (2 * n,), "int64_t"),
                spy.Tensor.zeros(device.native, (n,), "uint"),
            )
        self.words, self.special = device.scratch[key]
        scope.clear(device, self.words)
        scope.clear(device, self.special)
        self.status = spy.Tensor.zeros(device.native, (1,), "uint")
        self.scope, self.device, self.numel, self.desc = scope, device, numel, desc
        if checked:
            scope.on_finish(self._check)

    def fields(self) -> dict:
        return {"words": self.words.storage, "special": self.special.storage}

    def add_into(self, grad: Any) -> None:
        """Dispatch grad += the accumulated sum (``grad`` a contiguous float SlangPy tensor)."""
        node = self.device.library.det_fixed_point_add_into
        flat = grad.view((self.numel,))
        self.scope.dispatch(
            node,
            spy.grid((self.numel,)),
            self.words.storage,
            self.special.storage,
            self.status.storage,
            flat,
        )

    def _check(self) -> None:
        with self.device.queue.lock:  # a host read: exclusive, after what is pending
            self.device.queue.flush()
            bits = int(self.status.to_numpy().reshape(-1)[0])
        if bits & 1:
            raise GradientOverflowError(
                f"{self.desc}: the gradient left pydiff's fixed-point range (each contribution "
                f"|g| < 2^30 = {CONTRIBUTION_LIMIT:.0f}, every partial sum < 2^31 = "
                f"{SUM_LIMIT:.0f}); "
                "this gradient buffer is not valid. Scale the loss down"
            )
