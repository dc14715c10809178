"""The generated float-vector kernel (pydiff.generated_vector) a forward call plan
(call_plan) dispatches itself, as planned_kernels does for float functions: the kernel of a
layout is found once per plan, and per call only what the values decide is checked (every
tensor, and a given result, contiguous from the start of its buffer). The dispatch joins the
device's deferred list, and a new result comes from the buffer pool: a loop of small calls
pays no submission and no buffer creation of its own (lavapipe, 16 float3 elements, a new
result each call: 62-67 us of CPU a call against 99-114 us through SlangPy's call). A ``.bwds``
of float vectors keeps SlangPy's call at small sizes (planned_kernels.BackwardLaunch).

    launch = VectorForwardLaunch.make(fn, args, result)    # None: not covered
    out = launch.run(fn, args, result) if launch.ready(args, result) else None
"""

from __future__ import annotations

import math
from typing import Any

from . import generated, generated_vector
from .signature import FunctionTarget
from .tensor import Tensor

# (as planned_kernels.HELD_MAX: a launch keeps its last bound object while its buffers are
# this small)
HELD_MAX = 1 << 12


class VectorForwardLaunch:
    """A forward plan's generated_vector kernel: ``result`` is a tensor given or none."""

    __slots__ = ("kernel", "threads", "shape", "width", "tensors", "buffers", "numbers")
    __slots__ += ("fixed", "held")

    def __init__(self, found: tuple, args: tuple, held: list):
        self.kernel, self.threads, self.shape, self.width = found
        self.tensors = tuple(i for i, v in enumerate(args) if type(v) is Tensor)
        # (what generated_vector.forward binds: a tensor's buffer, else a float)
        self.buffers = tuple((f"pydiff_a{i}", i) for i in self.tensors)
        self.numbers = tuple((f"pydiff_a{i}", i) for i in range(len(args)) if i not in self.tensors)
        self.fixed = [("pydiff_n", math.prod(self.shape)), ("pydiff_stride", self.threads)]
        self.held = held  # the bound object of its last call (kernels.dispatch_split)

    @staticmethod
    def make(fn: FunctionTarget, args: tuple, result: Any) -> "VectorForwardLaunch | None":
        """The launch of this layout, or None when generated_vector does not cover it (the
        reason in ``generated.stats()``)."""
        given = result if type(result) is Tensor else None
        found = generated_vector.forward_kernel(fn, list(args), given)
        if found is None:
            return None
        return VectorForwardLaunch(found, args, fn.module.device.kernels.new_held())

    def ready(self, args: tuple, result: Any) -> bool:
        """These values fit the kernel: every tensor (and a given result) contiguous from the
        start of its buffer (the rest the layout fixes; the plan checks devices, aliasing)."""
        if type(result) is Tensor and not result.dense:
            return False
        for i in self.tensors:
            if not args[i].dense:
                return False
        return True

    def run(self, fn: FunctionTarget, args: tuple, result: Any, ready: Any = True) -> Tensor:
        """The result written (the tensor given, or a new pooled one); after ``ready``
        (``ready``: what it returned, True)."""
        dev = fn.module.device
        out = result
        if type(out) is not Tensor:
            out = generated_vector.new_result(self.shape, self.width, dev)
        buffers = [(name, args[i].buffer) for name, i in self.buffers]
        buffers.append(("pydiff_result", out.buffer))
        scalars = [(name, float(args[i])) for name, i in self.numbers]
        scalars += self.fixed
        dev.kernels.dispatch_split(
            self.kernel, self.threads, buffers, scalars, held=self.held, held_max=HELD_MAX
        )
        generated.count("forward")
        generated.count("forward: vector")
        return out
