"""The generated kernels a call plan (call_plan) dispatches itself: what the layout decides
(the function covered, each argument's kind, the kernel) is found once per plan; per call
only what the values decide is checked (float4 storage, gradient buffers apart from the
values read), and a call they rule out takes SlangPy's path, as on the full path.

Unlike SlangPy's call, the dispatch joins the device's deferred list (no submission of its
own): a loop of small calls pays lavapipe's submission once per ``DEFER_MAX`` calls.

    launch = ForwardLaunch.make(fn, args, result)        # None: not covered by the layout
    out = launch.run(fn, args, result, ready) if (ready := launch.ready(args, result)) else None
    done = BackwardLaunch(len(args), upstream.numel, dev.kernels).run(fn, args, upstream, grads)
"""

from __future__ import annotations

import math
import weakref
from typing import Any

from . import generated, generated_hold, generated_vector, planned_vector
from .creation import empty
from .signature import FunctionTarget
from .tensor import Tensor

# A launch keeps the bound object of its last call (binding the same buffers again costs
# nothing) while its buffers are this small: the object pins them, and a function keeps up
# to plan_layout.PLANS_MAX plans. Larger calls spend far longer computing than binding.
HELD_MAX = 1 << 12
# The same bound for a launch's last bindings (``last``): a call of at most this many elements
# keeps them, pinning at most a few such buffers after their tensors are dropped.
LAST_MAX_ELEMENTS = HELD_MAX // 4


def same_tensors(refs: tuple, args: tuple) -> bool:
    """``args`` holds, at each ``(index, weak reference)`` of ``refs``, the very tensor."""
    for i, ref in refs:
        if ref() is not args[i]:
            return False
    return True


def memo(last: list) -> tuple:
    """A launch's ``last`` read at once (a tuple: empty, or what it kept): its items read one
    by one could mix two threads' calls (another thread's call replacing it between the check
    and the use of the bindings: a dispatch of that thread's buffers with this call's numbers)
    or meet it emptied (``empty_cache`` in another thread: an IndexError out of the call)."""
    return tuple(last)  # (one C-level copy under the GIL: no other thread runs during it)


def _float4_tensors(args: tuple, tensors: tuple) -> bool:
    for i in tensors:
        if not args[i].float4:
            return False
    return True


class ForwardLaunch:
    """A forward plan's generated kernel: ``result`` is a tensor given or ``"tensor"``."""

    __slots__ = ("kernel", "tensors", "shape", "buffer_names", "number_names", "threads", "fixed")
    __slots__ += ("held", "last")

    def __init__(self, kernel: Any, args: tuple, shape: tuple, kernels: Any):
        self.kernel, self.shape = kernel, shape
        self.tensors = tuple(i for i, v in enumerate(args) if type(v) is Tensor)
        # (what generated.dispatch_forward binds: a tensor's buffer, else a float)
        self.buffer_names = tuple((f"pydiff_a{i}", i) for i in self.tensors)
        self.number_names = tuple(
            (f"pydiff_a{i}", i) for i in range(len(args)) if i not in self.tensors
        )
        self.threads, fixed = generated.geometry(math.prod(shape))
        self.fixed = list(fixed.items())
        self.held = kernels.new_held()  # its last call's bound object (kernels.dispatch_split)
        # The bindings of its last call into a given result, and weak references to that
        # result and the tensors read: a tensor's buffer never changes, so a call passing the
        # very same tensors binds the same buffers (a loop's repeated call: not built again).
        # A held list: empty_cache empties it, releasing the buffers the bindings refer to.
        self.last = kernels.new_held()

    @staticmethod
    def make(fn: FunctionTarget, args: tuple, result: Any) -> Any:
        """The launch of this layout (for a function of float vectors, planned_vector's), or
        None when the generator does not cover it (a parameter not a float, a tensor not
        float4 storage, ...: the reason in ``stats()``)."""
        if generated_vector.involves(fn):
            return planned_vector.VectorForwardLaunch.make(fn, args, result)
        given = result if type(result) is Tensor else None
        shape = generated.call_shape(list(args))
        kernel = generated.forward_kernel(fn, list(args), shape, given)
        if kernel is None:
            return None
        return ForwardLaunch(kernel, args, shape, fn.module.device.kernels)

    def ready(self, args: tuple, result: Any) -> Any:
        """Whether these values fit the kernel (every tensor, and a given result, float4
        storage): False, or what ``run`` binds them with: the last call's bindings (the very
        same tensors again: their storage was checked then), else True."""
        if type(result) is Tensor:
            last = tuple(self.last)  # (``memo``'s one read, without its frame: every call)
            if last and last[0]() is result and same_tensors(last[1], args):
                return last[2]  # (a list of the bindings, never empty)
            if not result.float4:
                return False
        return _float4_tensors(args, self.tensors)

    def run(self, fn: FunctionTarget, args: tuple, result: Any, ready: Any = True) -> Tensor:
        """The result written (the tensor given, or a new one); after ``ready`` (what it
        returned). (What ``generated.dispatch_forward`` binds, from names and sizes found once.)"""
        dev = fn.module.device
        if type(result) is not Tensor:
            out = empty(self.shape, device=dev)
            if generated_hold.holding(fn):  # (on a tape: for its backward to fuse)
                generated_hold.hold(fn, self.kernel, args, out)
                return out
            buffers = [(name, args[i].buffer) for name, i in self.buffer_names]
            buffers.append(("pydiff_result", out.buffer))
        elif ready is not True:
            out, buffers = result, ready  # (the last call's bindings: the same tensors)
        else:
            out = result
            buffers = [(name, args[i].buffer) for name, i in self.buffer_names]
            buffers.append(("pydiff_result", out.buffer))
            if result.numel <= LAST_MAX_ELEMENTS:
                refs = tuple((i, weakref.ref(args[i])) for i in self.tensors)
                self.last[:] = (weakref.ref(result), refs, buffers)
        scalars = []
        for name, i in self.number_names:  # (a loop: no comprehension's frame per call)
            scalars.append((name, float(args[i])))
        scalars += self.fixed
        dev.kernels.dispatch_split(
            self.kernel, self.threads, buffers, scalars, held=self.held, held_max=HELD_MAX
        )
        generated.STATS["forward"] += 1  # (generated.count, without its frame)
        return out


class BackwardLaunch:
    """A backward plan's generated kernels (every tensor argument of the result's shape, its
    gradient added into its ``grad_out``), one per way the gradient buffers are shared."""

    __slots__ = ("kernels", "covered", "names", "threads", "fixed", "held", "grad_names", "last")

    def __init__(self, count: int, numel: int, kernels: Any) -> None:
        self.kernels: dict = {}  # sums (parameters per shared gradient buffer) -> kernel
        self.covered = True  # False once the layout proved not covered: SlangPy's path
        self.names = tuple((f"pydiff_a{i}", i) for i in range(count))
        self.threads, fixed = generated.geometry(numel)
        self.fixed = [*fixed.items(), ("pydiff_zero", 0)]
        self.held: dict = {}  # per kernel, the bound object of its last call
        self.grad_names = tuple((f"pydiff_g{j}", f"pydiff_g{j}_in") for j in range(count))
        # As ForwardLaunch.last: a weak reference to the last call's upstream, (index, tensor,
        # gradient) references, and what they decided (the kernel, its bindings and held
        # object, the number arguments' names): the same tensors and gradient buffers again
        # pass the same checks (their layouts and storages are fixed) and bind the same.
        self.last = kernels.new_held()  # (emptied by empty_cache, as ForwardLaunch.last)

    def run(self, fn: FunctionTarget, args: tuple, upstream: Tensor, grads: dict) -> bool:
        """Add the gradients (``grads``: parameter index -> its gradient tensor, in order);
        False, nothing done, where these values or the layout rule the kernel out."""
        last = memo(self.last)
        if last and last[0]() is upstream:
            for i, tensor, grad in last[1]:  # (every tensor; grad None: one without)
                if tensor() is not args[i] or grad is not None and grad() is not grads[i]:
                    break
            else:
                kernel, buffers, held, numbers = last[2]
                scalars = []
                for name, i in numbers:  # (as ForwardLaunch.run)
                    scalars.append((name, float(args[i])))
                scalars += self.fixed
                kernels = fn.module.device.kernels
                kernels.dispatch_split(
                    kernel, self.threads, buffers, scalars, held=held, held_max=HELD_MAX
                )
                generated.STATS["backward"] += 1
                return True
        if not self.kernels and generated_vector.involves(fn):  # (until a kernel is found)
            self.covered = False  # float vectors: the full path's (generated_vector), if large
            return False
        if not upstream.float4:
            return False
        read = {id(upstream.storage)}
        buffers: list = []
        scalars: list = []
        for name, i in self.names:
            v = args[i]
            if type(v) is Tensor:
                if not v.float4:
                    return False
                read.add(id(v.storage))
                buffers.append((name, v.buffer))
            else:
                scalars.append((name, float(v)))
        shared: dict[int, list[int]] = {}  # (as generated.backward_kernel groups them)
        for i, g in grads.items():
            key = id(g.storage)
            if key in read or not g.float4:
                return False  # generated.backward declines these too
            shared.setdefault(key, []).append(i)
        sums = tuple(tuple(g) for g in shared.values())
        kernel = self.kernels.get(sums)
        if kernel is None:
            found = generated.backward_kernel(fn, list(args), upstream, grads)
            if found is None or found[2] or found[1] != sums:
                self.covered = False  # (the values were checked above: the layout's doing)
                return False
            kernel = self.kernels[sums] = found[0]
        for (name, name_in), members in zip(self.grad_names, sums):
            grad = grads[members[0]].buffer
            buffers += ((name, grad), (name_in, grad))
        buffers.append(("pydiff_up", upstream.buffer))
        scalars += self.fixed
        kernels = fn.module.device.kernels
        held = self.held.get(sums)
        if held is None:
            held = self.held[sums] = kernels.new_held()
        if upstream.numel <= LAST_MAX_ELEMENTS:
            refs = tuple(
                (i, weakref.ref(v), weakref.ref(grads[i]) if i in grads else None)
                for i, v in enumerate(args)
                if type(v) is Tensor
            )
            numbers = tuple((name, i) for name, i in self.names if type(args[i]) is not Tensor)
            self.last[:] = (weakref.ref(upstream), refs, (kernel, buffers, held, numbers))
        kernels.dispatch_split(kernel, self.threads, buffers, scalars, held=held, held_max=HELD_MAX)
        generated.STATS["backward"] += 1
        return True
