"""Call plans: what a forward call or ``.bwds`` of one argument layout needs per call, found
once by the full path and cached on the function, so that a repeated small call costs one
dict lookup and the per-call work (device, aliasing, version and storage bookkeeping, the
SlangPy call) instead of a dozen passes over its arguments.

A layout is what every check of the full path reads apart from values and storages: each
argument's kind (a Python number's type; a tensor's shape, element type and which gradient
buffers it has; a grid's shape, stride and offset) and the ``_result`` given (a tensor's
layout, ``'tensor'``, or none). A plan
is made only after the full path ran the layout without error, and only for calls without
the cases it handles apart (tapes, in-place and aliased tensors, struct and host-array
arguments, overloads, traps, generated kernels, zeroing policies other than ACCUMULATE,
deterministic mode, an open backward). Whatever a plan cannot decide from the layout it
checks per call; where a check would take the full path's other branch it declines
(``DECLINED``) before changing anything, and the caller runs the full path.

    plan = fn.plans.get(plan_layout.layout_key(args, kwargs))   # None: not run before
    out = plan.run(fn, args, kwargs.get("_result", MISSING)) if plan else DECLINED
    plan_layout.remember(fn, fn.plans, key, ForwardPlan.make(fn, key, ...))  # after the full path

The ``.bwds`` plan is backward_plan's (and grid_plan's for calls over a grid).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import slangpy as spy

from . import capture_refusals, capturing, generated, generated_switch, lint
from .arguments import MISSING, PLAIN, resolve_error
from .call_shape import tensor_result, zero_d_call
from .command_queue import DEFER
from .creation import empty
from .host_values import convert
from .grid_args import GRID
from .planned_kernels import LAST_MAX_ELEMENTS, ForwardLaunch, same_tensors
from .signature import FunctionTarget, overloaded
from .tape import active_tape
from .tensor import Tensor
from .view_overlap import holds_repeats

DECLINED = object()  # a plan's answer when the call must take the full path


def _constant(value: Any) -> Any:
    """``value`` (not a tensor: MISSING, "tensor") as ``last`` keeps a weak reference."""
    return lambda: value


def plan_numbers(key: tuple, bound: list) -> tuple[tuple, tuple]:
    """Number arguments (position, parameter) needing checks per call: floats for float
    parameters, passed as they are when in float32's range (checked inline), and the others,
    which ``convert`` checks and converts. The argument's type is the layout's (``key[i]``,
    positional: ``bound[i]`` is ``args[i]``'s parameter), the same in every call of the plan."""
    numbers = [(i, p) for i, (p, v) in enumerate(bound) if type(v) in PLAIN]
    floats = tuple((i, p) for i, p in numbers if key[i] is float and p.type_name == "float")
    return floats, tuple(n for n in numbers if n not in floats)


FLOAT_MAX = 3.4028234663852886e38  # float32's largest: a float that fits is passed as it is


def plan_natives(fn: FunctionTarget, args: tuple, floats: tuple, numbers: tuple, dev: Any) -> list:
    """The call's arguments as SlangPy takes them: ``plan_numbers``'s numbers checked (a float
    in float32's range passed as it is) and converted, raising the full path's range errors."""
    native = list(args)
    for i, p in floats:
        if not -FLOAT_MAX <= args[i] <= FLOAT_MAX:  # (NaN too)
            native[i] = convert(fn.label, p, args[i], dev)  # its range error
    for i, p in numbers:
        native[i] = convert(fn.label, p, args[i], dev)  # range checks, conversions
    return native


def numbers_checked(
    fn: FunctionTarget, args: tuple, floats: tuple, numbers: tuple, dev: Any
) -> None:
    """``plan_natives``'s checks alone (its range errors), for a generated kernel, which binds
    the numbers given itself."""
    for i, p in floats:
        if not -FLOAT_MAX <= args[i] <= FLOAT_MAX:
            convert(fn.label, p, args[i], dev)
    for i, p in numbers:
        convert(fn.label, p, args[i], dev)


def written_since(args: tuple, made: tuple) -> bool:
    """Whether an input the forward call that made a tensor read (``Storage.made_by[1]``) was
    written since: stale_reads refuses it (or uses a copy kept), on the full path."""
    for i, _, serial, version in made[1]:
        st = args[i].storage if i < len(args) and type(args[i]) is Tensor else None
        if st is not None and st.serial == serial and st.version != version:
            return True
    return False


def deferrable(queue: Any) -> bool:
    """Whether a SlangPy call may join the deferred list (``append_to``) instead of being
    submitted on its own: nothing recorded in this context's batch, no other thread's batch
    open (those are submitted before a SlangPy call: command_queue), deferral on."""
    return DEFER and not queue.open_batches and queue.pending_encoder() is None


def plannable(fn: FunctionTarget) -> bool:
    return not lint.refusing(fn.module.traps.get(fn.name)) and not overloaded(fn)


def may_generate(plan: Any, large: bool) -> bool:
    """Whether a call of ``plan`` may take the generated kernel: a small one once its layout
    has run ``planned_after`` times (generated_switch.planned_after) or in a capture (which
    needs it), any while ``PYDIFF_GENERATED`` is on (read each time for a large call, for a
    small one when the environment changed size: generated_switch.enabled_planned)."""
    if not large:
        plan.calls += 1
        if plan.calls <= plan.planned_after and capturing.recording() is None:
            generated.check_switch_planned()  # (the full path reads it at every call)
            return False
        return generated_switch.enabled_planned()
    return generated.enabled()


class ForwardPlan:
    """A forward call of one layout off a tape: no in-place parameter given a tensor, no
    tensor read that another argument or ``_result`` writes (checked per call)."""

    __slots__ = (
        "tensors", "reads", "writes", "read_names", "floats", "numbers", "numel",
        "result_tensor", "zero_d", "options", "calls", "planned_after", "launch", "defers",
        "new_shape", "params", "on_tape", "pools", "grid", "last", "device",
    )  # fmt: skip

    def __init__(self, fn: FunctionTarget, key: tuple, bound: list, result: Any):
        self.tensors = tuple(i for i, (_, v) in enumerate(bound) if type(v) is Tensor)
        self.reads = tuple(i for i in self.tensors if bound[i][0].reads_value)
        self.writes = tuple(i for i in self.tensors if bound[i][0].writes_value)
        self.read_names = tuple((i, bound[i][0].name) for i in self.reads)
        self.floats, self.numbers = plan_numbers(key, bound)
        # as generated_calls.call_forward decides (the layout fixes every tensor's size; a
        # grid's shape: large ones take the full path, which may generate their kernel)
        grids = [math.prod(v.shape.as_tuple()) for _, v in bound if type(v) is GRID]
        self.grid = bool(grids)
        self.numel = grids[0] if grids else generated.call_size(v for _, v in bound)
        self.result_tensor = type(result) is Tensor
        self.zero_d = zero_d_call(bound)  # all tensors 0-d: a (1,) result viewed as ()
        self.options: dict = {}
        tensor_result(fn, bound, self.options)  # a whole float3 tensor at a float3: a tensor
        self.calls = 0  # (counted while small: from planned_after on, generated kernels)
        self.planned_after = generated.planned_after(fn.module.device)
        self.launch: Any = None  # its generated kernel; False: not covered (planned_kernels)
        # SlangPy's call may be deferred (append_to) where it returns nothing pydiff needs:
        # a tensor given as _result, or a void function (its outputs tensors it writes).
        void = fn.signature.return_type == "void" and result is MISSING
        self.defers = (self.result_tensor or void) and not self.options and not self.zero_d
        self.new_shape: tuple | None = None  # a new float result's (ForwardPlan.make)
        self.pools = False  # whether it makes that result from the pool
        self.params = tuple(p for p, _ in bound)
        self.on_tape = False  # whether a call on a tape may take it (forward_call records it)
        self.last: tuple | None = None  # the tensors ``_checked`` passed last (weak references)
        self.device = fn.module.device  # (a module's, fixed)

    @staticmethod
    def make(
        fn: FunctionTarget,
        key: tuple,
        bound: list,
        result: Any,
        snapshots: dict,
        aliased: dict,
        out: Any = None,
    ):
        """The plan for the call of layout ``key`` that just ran through the full path (and
        returned ``out``), or None."""
        if snapshots or aliased or not plannable(fn):
            return None
        for p, v in bound:
            if type(v) is Tensor and (p.tensor_kind == "fwd" or p.in_place):
                return None
        grids = [math.prod(v.shape.as_tuple()) for _, v in bound if type(v) is GRID]
        if grids and grids[0] >= generated.MIN_ELEMENTS:
            return None  # (it would decline every call: the full path's generated kernel)
        plan = ForwardPlan(fn, key, bound, result)
        new = result is MISSING or (type(result) is str and result == "tensor")
        if new and type(out) is Tensor and out.dtype == "float" and out.shape and plan.tensors:
            # SlangPy's call would make the result: pydiff makes it (pooled) and defers
            plan.new_shape = out.shape
            plan.defers = plan.pools = not plan.options and not plan.zero_d
            # on a tape: a new result (never a narrowed one), every parameter given
            plan.on_tape = plan.defers and len(bound) == len(key) - 2 * ("_result" in key)
        elif grids and result is MISSING and plan.defers:  # a void call over a grid
            plan.on_tape = len(bound) == len(key)  # (every parameter given)
        return plan

    def _generated(self, fn: FunctionTarget, args: tuple, result: Any) -> Any:
        """This call's generated launch; None: SlangPy's call; DECLINED: the full path's."""
        large = self.numel >= generated.MIN_ELEMENTS
        if self.grid:
            return DECLINED if large else None
        if not large and self.calls >= self.planned_after:  # (may_generate's, inline)
            self.calls += 1
            if not generated_switch.enabled_planned() or self.zero_d or self.options:
                return None
        elif not may_generate(self, large) or self.zero_d or self.options:
            return DECLINED if large else None
        if result is MISSING and not self.tensors:  # (numbers only: SlangPy returns a number)
            return DECLINED if large else None
        if self.launch is None:
            self.launch = ForwardLaunch.make(fn, args, result) or False
        if self.launch is False:
            return DECLINED if large else None
        return self.launch  # (its ``ready`` is the caller's: what it finds binds the call)

    def run(self, fn: FunctionTarget, args: tuple, result: Any) -> Any:
        """The call, or DECLINED (nothing done) where the full path must decide. On a tape
        (``on_tape`` plans only) the caller records it."""
        if not self.on_tape and active_tape() is not None:
            return DECLINED
        launch = self._generated(fn, args, result)
        if launch is DECLINED:
            return DECLINED
        ready: Any = None
        if launch is not None and not (ready := launch.ready(args, result)):
            if self.numel >= generated.MIN_ELEMENTS:
                return DECLINED
            launch = None  # (these values: SlangPy's kernel)
        if launch is None and capturing.recording() is not None:
            capture_refusals.refuse_planned(fn.label, self, None, result)  # (SlangPy's kernel)
        dev = self.device
        written = [args[i].storage for i in self.writes] if self.writes else []
        if self.result_tensor:
            written.append(result.storage)
        last = self.last
        if type(ready) is list:
            pass  # the launch's last call's very tensors: they passed ``_checked`` then
        elif last is None or last[0]() is not result or not same_tensors(last[1], args):
            if not self._checked(args, result, dev, written):
                return DECLINED
        if launch is None:
            native = plan_natives(fn, args, self.floats, self.numbers, dev)
        elif self.numbers:  # (the kernel binds the numbers itself: their range checks only)
            numbers_checked(fn, args, self.floats, self.numbers, dev)
        else:
            for i, p in self.floats:  # (numbers_checked's first loop, without its frame)
                if not -FLOAT_MAX <= args[i] <= FLOAT_MAX:
                    convert(fn.label, p, args[i], dev)  # its range error
        label = fn.call_label
        # forward_call._mark_reread, and stale_reads.mark_made's record of the reads (a
        # parameter only written never is in read_by_writer; none is read and written here)
        reads = []
        for i, name in self.read_names:
            st = args[i].storage
            if st.last_writer == label and name in st.read_by_writer:
                st.reread = True
            reads.append((i, name, st.serial, st.version))
        made = (fn, reads)
        if launch is not None:
            out = launch.run(fn, args, result, ready)
            for st in written:
                st.wrote(label)
                st.made_by = made
            if not self.result_tensor:  # (a given result's storage is among those written)
                out.storage.made_by = made  # (stale_reads.mark_made)
            return out
        if self.defers and deferrable(dev.queue):
            return self._deferred(fn, args, result, native, written, made)
        dev.queue.flush()  # kernels queued in a batched backward run first
        for i in self.tensors:
            native[i] = args[i].bind(True)
        pooled = empty(self.new_shape, device=dev) if self.pools else None  # (as deferred)
        try:
            if pooled is not None or self.result_tensor:
                out = fn.native(*native, _result=(result if pooled is None else pooled).bind(True))
            elif result is MISSING:
                out = fn.native(*native, **self.options)
            else:
                out = fn.native(*native, _result=result)
        except Exception as exc:
            raise resolve_error(fn, exc) from None
        for st in written:
            st.wrote(label)
            st.made_by = made
        if pooled is not None:
            pooled.storage.made_by = made
            return pooled
        if self.result_tensor:
            return result
        if isinstance(out, spy.Tensor):
            dev.queue.allocated(out.storage.size)  # (SlangPy made it)
            out = Tensor(out.view(()) if self.zero_d else out, dev)
            out.storage.made_by = made
            return out
        if self.zero_d and type(out) is np.ndarray and out is not result:  # (1,) + element
            return out.reshape(out.shape[1:])
        return out

    def _checked(self, args: tuple, result: Any, dev: Any, written: list) -> bool:
        """Whether the tensors are on the plan's device and no two written arguments, nor a
        written and a read one, share a storage (else the full path decides). What depends on
        the tensors alone (their devices and storages never change), never on their values:
        kept in ``last`` (weak references) for a small call, whose next call with the very
        same tensors skips it, as one whose launch binds them as its last call did."""
        for i in self.tensors:
            if args[i].device is not dev:
                return False  # (the full path names the parameter)
        if self.result_tensor and result.device is not dev:
            return False
        if len(set(map(id, written))) != len(written):
            return False  # two written arguments on one storage: the full path refuses
        if self.result_tensor and holds_repeats(result):
            return False  # (an expanded view written: the full path refuses it)
        for i in self.writes:
            if holds_repeats(args[i]):
                return False
        for i in self.reads if written else ():
            if args[i].storage in written:  # (Storage compares by identity)
                return False  # aliased: the full path keeps the values read
        if self.numel <= LAST_MAX_ELEMENTS:
            refs = tuple((i, weakref.ref(args[i])) for i in self.tensors)
            self.last = (weakref.ref(result) if self.result_tensor else _constant(result), refs)
        return True

    def _deferred(
        self, fn: FunctionTarget, args: tuple, result: Any, native: list, written: list, made: tuple
    ) -> Any:
        """SlangPy's call appended to the deferred list: submitted with the next flush (a
        read, another SlangPy call) or after ``DEFER_MAX`` commands, not once per call."""
        held = []  # (loops, no comprehensions: this runs on every call)
        for i in self.tensors:
            held.append(bound := args[i].bind(True, False))
            native[i] = bound
        if self.new_shape is not None:
            result = empty(self.new_shape, device=self.device)
        append = fn.native.append_to
        if type(result) is Tensor:
            held.append(out := result.bind(True, False))
            record = lambda enc: append(enc, *native, _result=out)  # noqa: E731
        else:
            record = lambda enc: append(enc, *native)  # noqa: E731
        try:
            self.device.queue.defer(record, held)
        except Exception as exc:
            raise resolve_error(fn, exc) from None
        label = fn.call_label
        for st in written:
            st.wrote(label)
            st.made_by = made
        if self.new_shape is not None:
            result.storage.made_by = made
        return result if type(result) is Tensor else None
