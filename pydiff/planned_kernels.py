"""The generated kernels a call plan (call_plan) dispatches itself: what the layout decides
(the function covered, each argument's kind, the kernel) is found once per plan; per call
only what the values decide is checked (float4 storage, gradient buffers apart from the
values read), and a call they rule out takes SlangPy's path, as on the full path.

Unlike SlangPy's call, the dispatch joins the device's deferred list (no submission of its
own): a loop of small calls pays lavapipe's submission once per ``DEFER_MAX`` calls.

    launch = ForwardLaunch.make(fn, args, result)        # None: not covered by the layout
    out = launch.run(fn, args, result) if launch.ready(args, result) else None
    done = BackwardLaunch(len(args), upstream.numel).run(fn, args, upstream, grads)
"""

from __future__ import annotations

import math
from typing import Any

from . import generated
from .creation import empty
from .signature import FunctionTarget
from .tensor import Tensor


def _float4_tensors(args: tuple, tensors: tuple) -> bool:
    for i in tensors:
        if not args[i].float4:
            return False
    return True


class ForwardLaunch:
    """A forward plan's generated kernel: ``result`` is a tensor given or ``"tensor"``."""

    __slots__ = ("kernel", "tensors", "shape", "names", "threads", "fixed")

    def __init__(self, kernel: Any, args: tuple, shape: tuple):
        self.kernel, self.shape = kernel, shape
        self.tensors = tuple(i for i, v in enumerate(args) if type(v) is Tensor)
        self.names = tuple((f"pydiff_a{i}", i) for i in range(len(args)))
        self.threads, self.fixed = generated.geometry(math.prod(shape))

    @staticmethod
    def make(fn: FunctionTarget, args: tuple, result: Any) -> "ForwardLaunch | None":
        """The launch of this layout, or None when the generator does not cover it (a
        parameter not a float, a tensor not float4 storage, ...: the reason in ``stats()``)."""
        given = result if type(result) is Tensor else None
        shape = generated.call_shape(list(args))
        kernel = generated.forward_kernel(fn, list(args), shape, given)
        return None if kernel is None else ForwardLaunch(kernel, args, shape)

    def ready(self, args: tuple, result: Any) -> bool:
        """These values fit the kernel: every tensor (and a given result) float4 storage."""
        if type(result) is Tensor and not result.float4:
            return False
        return _float4_tensors(args, self.tensors)

    def run(self, fn: FunctionTarget, args: tuple, result: Any) -> Tensor:
        """The result written (the tensor given, or a new one); after ``ready``. (What
        ``generated.dispatch_forward`` binds, from names and sizes found once.)"""
        dev = fn.module.device
        out = result if type(result) is Tensor else empty(self.shape, device=dev)
        bindings = {}
        for name, i in self.names:
            v = args[i]
            bindings[name] = v.buffer if type(v) is Tensor else float(v)
        bindings["pydiff_result"] = out.buffer
        bindings.update(self.fixed)
        dev.kernels.dispatch(self.kernel, self.threads, **bindings)
        generated.count("forward")
        return out


class BackwardLaunch:
    """A backward plan's generated kernels (every tensor argument of the result's shape, its
    gradient added into its ``grad_out``), one per way the gradient buffers are shared."""

    __slots__ = ("kernels", "covered", "names", "threads", "fixed")

    def __init__(self, count: int, numel: int) -> None:
        self.kernels: dict = {}  # sums (parameters per shared gradient buffer) -> kernel
        self.covered = True  # False once the layout proved not covered: SlangPy's path
        self.names = tuple((f"pydiff_a{i}", i) for i in range(count))
        self.threads, self.fixed = generated.geometry(numel)

    def run(self, fn: FunctionTarget, args: tuple, upstream: Tensor, grads: dict) -> bool:
        """Add the gradients (``grads``: parameter index -> its gradient tensor, in order);
        False, nothing done, where these values or the layout rule the kernel out."""
        if not upstream.float4:
            return False
        read = {id(upstream.storage)}
        bindings: dict = {}
        for name, i in self.names:
            v = args[i]
            if type(v) is Tensor:
                if not v.float4:
                    return False
                read.add(id(v.storage))
                bindings[name] = v.buffer
            else:
                bindings[name] = float(v)
        buffers: dict[int, list[int]] = {}  # (as generated.backward_kernel groups them)
        for i, g in grads.items():
            key = id(g.storage)
            if key in read or not g.float4:
                return False  # generated.backward declines these too
            buffers.setdefault(key, []).append(i)
        sums = tuple(tuple(g) for g in buffers.values())
        kernel = self.kernels.get(sums)
        if kernel is None:
            found = generated.backward_kernel(fn, list(args), upstream, grads)
            if found is None or found[2] or found[1] != sums:
                self.covered = False  # (the values were checked above: the layout's doing)
                return False
            kernel = self.kernels[sums] = found[0]
        for j, members in enumerate(sums):
            bindings[f"pydiff_g{j}"] = bindings[f"pydiff_g{j}_in"] = grads[members[0]].buffer
        bindings["pydiff_up"] = upstream.buffer
        bindings["pydiff_zero"] = 0
        bindings.update(self.fixed)
        fn.module.device.kernels.dispatch(kernel, self.threads, **bindings)
        generated.count("backward")
        return True
