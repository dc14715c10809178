"""What each parameter of a ``.bwds`` binds on the general path (``BackwardArgs``), and the
work left after SlangPy's backward kernel: gradient buffers with the zeroing policy applied
before the first add, scratch buffers for inputs that need no gradient, separate grad_in and
grad_out for values a call reads and writes, values of the backward's own for the forward it
reruns, the ``inout`` wrapper's two arguments, full-shape buffers for broadcast parameters and
fixed-point accumulators for ``FwdDiffTensor``s (summed into their buffers after the call), and
the upstream gradient of the result.

    b = BackwardArgs(fn, scope, prior)      # backward_call's builder, bound by bwds_binding
    native = b.tensor_arg(p, x)             # per parameter
    b.after_call(); b.finish()              # after the kernel
"""

from __future__ import annotations

from typing import Any

import slangpy as spy

from . import broadcast_grad, written_mask
from .arguments import MISSING, check_device, deep_bind, fwd_tensor_struct, scratch
from .backward_scope import BackwardScope
from .bwds_checks import half_seed, primal_sink, upstream_arg, warn_no_gradient
from .call_shape import refuse_struct_grads
from .fixed_point_grad import FixedPointAccumulator
from .grad_restore import GradSnapshot, resets
from .signature import FunctionTarget, ParamInfo
from .tensor import Tensor
from .written_mask import WrittenMask as Mask

_SCALAR_RESULTS = {"float", "half", "double"}


class BackwardArgs:
    """Builds the native arguments of one ``.bwds`` call and the work to do after it."""

    def __init__(self, fn: FunctionTarget, scope: BackwardScope, prior: frozenset = frozenset()):
        self.fn = fn
        self.prior = prior  # storages whose value before the call a tape's graph still needs
        self.cleared: list[tuple[Mask | None, Tensor]] = []  # (None: all) written grads
        self.scope = scope
        self.label = fn.label
        self.after: list[tuple[Tensor, Tensor]] = []  # (temp gradient, destination) copies
        self.no_grad: list[str] = []  # vectorised parameters bound without a gradient
        self.device = fn.module.device
        self.shape: tuple[int, ...] | None = None  # the call's shape, when pydiff can tell
        self.separate: set[int] = set()  # grad buffers several parameters add into
        self.reductions: list[tuple[spy.Tensor, Tensor]] = []  # (full-shape grad, parameter)
        self.fixed: list[tuple[FixedPointAccumulator, spy.Tensor]] = []  # (words, add into)
        self.untracked: list[str] = []  # deterministic mode: gradients left to float atomics
        self.masks: dict[str, Mask] = {}  # parameters bound through the masked wrapper
        self.passes: list[tuple[Mask, Tensor, Tensor]] = []  # (mask, upstream, grad)
        self.stored_once: frozenset = frozenset()  # written tensors needing no store counts
        self.wanted = False  # a direct .bwds where some argument wants a gradient
        self.kept: GradSnapshot | None = None  # a counted call's gradients before it

    def scratch_grads(self, t: Tensor, role: str) -> spy.Tensor:
        """Gradient buffers for a tensor whose gradient nobody asked for."""
        return scratch(self.device, t, role)

    def _desc(self, p: ParamInfo) -> str:
        return f"{self.label}: parameter '{p.name}'"

    def accumulating(self, t: Tensor, p: ParamInfo, desc: str | None = None) -> None:
        """The policy of ``t`` applied before this backward adds into its gradient."""
        grad, desc = t.grad_out, desc or self._desc(p)
        if grad.shape != t.shape:
            raise ValueError(f"{desc}: gradient shape {grad.shape} != primal {t.shape}")
        if self.kept is None and resets(self.scope, t, grad):  # (kept: a refusal puts back)
            self.kept = GradSnapshot(self.scope, self.device)
        if self.kept is not None:
            self.kept.keep(grad)  # (before the policy may zero it)
        self.scope.before_accumulate(t, grad, desc)

    def _needs_upstream(self, t: Tensor, p: ParamInfo, what: str) -> None:
        if not t.requires_grad and (what == "written" or self.wanted):
            raise ValueError(
                f"{self._desc(p)} is {what} by the call, so its backward reads the upstream "
                f"gradient from the tensor's grad buffer, but the tensor has none; pass "
                f"t.with_grads(...) holding dL/d{p.name} (or ones: .with_grads(ones=True))"
            )

    def own_primal(self, t: Tensor, bound: spy.Tensor, keep: bool) -> spy.Tensor:
        """``bound``'s gradient buffers on values of the backward's own. A backward kernel
        reruns the forward, which writes into written parameters: into ``t`` that would change
        the caller's values behind the version counters (a second backward over a recording
        would then read the wrong values). ``keep``: the call also reads them (a copy)."""
        primal = t.copy_values().native if keep else primal_sink(self.device, t)
        return primal.with_grads(grad_in=bound.grad_in, grad_out=bound.grad_out, zero=False)

    def separate_grads(self, t: Tensor, p: ParamInfo) -> spy.Tensor:
        """Bind a read-and-written tensor with distinct grad_in and grad_out buffers."""
        if not t.requires_grad:  # (bound unflushed: what SlangPy records comes after)
            return t.bind(False, False).with_grads(
                grad_in=self.scratch_grads(t, "zeros"),
                grad_out=self.scratch_grads(t, "sink"),
                zero=False,
            )
        if t.grad_in is not t.grad_out:
            self.accumulating(t, p)
            return t.bind(True)
        # One shared buffer: it holds the upstream gradient now and must hold the gradient
        # w.r.t. the value before the call afterwards.
        upstream = t.grad_in
        result = t.new_grad_buffer()
        self.after.append((result, upstream))
        values, gi, go = (u.bind(False, False) for u in (t, upstream, result))
        return values.with_grads(grad_in=gi, grad_out=go, zero=False)

    def tensor_arg(self, p: ParamInfo, t: Tensor) -> spy.Tensor:
        check_device(self.fn, t, f"parameter '{p.name}'")
        refuse_struct_grads(self.fn.label, p, t)
        if p.tensor_kind == "plain" or (p.tensor_kind is None and not p.differentiable):
            warn_no_gradient(self.fn, p, t)
            if p.writes_value:  # the backward reruns the forward: not into the caller's values
                return t.copy_values().native if p.reads_value else primal_sink(self.device, t)
            return t.native
        if p.tensor_kind == "diff" and not t.requires_grad and not p.no_diff_tensor:
            raise ValueError(
                f"{self._desc(p)} is a concrete {p.type_name}: it needs a tensor with gradient "
                f"buffers (requires_grad=True / .with_grads()); SlangPy would bind a null "
                f"descriptor. For data that needs no gradient use I{p.type_name}"
            )
        if p.no_diff_tensor and p.access in ("write", "read_write"):
            # no_diff: its stores' backward reads a zero upstream (the caller's would flow to
            # what was stored), its loads' adds go to a sink; its gradient stays as it was
            warn_no_gradient(self.fn, p, t)
            keep = p.access == "read_write"
            primal = t.copy_values().native if keep else primal_sink(self.device, t)
            zeros, sink = self.scratch_grads(t, "zeros"), self.scratch_grads(t, "sink")
            bound = primal.with_grads(grad_in=zeros, grad_out=sink, zero=False)
            if t.requires_grad and id(t.storage) in self.prior:  # (a tape: the value before
                return written_mask.bind_written(self, p, t, bound, True)  # gets none there)
            return bound
        if p.io == "out" or p.access == "write":
            self._needs_upstream(t, p, "written")
            bound = self.own_primal(t, t.bind(True), keep=False)
            return written_mask.bind_written(self, p, t, bound, id(t.storage) in self.prior)
        if p.access == "read_write":
            self._needs_upstream(t, p, "read and written")  # (others' gradients need it)
            masked = written_mask.needs_mask(p, t, self.label)
            bound = self.own_primal(t, self.separate_grads(t, p), keep=True)
            return written_mask.bind_in_place(self, p, t, bound, masked)
        if not t.requires_grad or p.no_diff_tensor and p.access == "read":
            if p.no_diff_tensor:
                warn_no_gradient(self.fn, p, t)  # (no_diff: the loads' adds go to a sink)
            if p.tensor_kind is None:
                # A vectorised value with no gradient wanted: bind the primal alone, and
                # make that part of the kernel's identity (SlangPy's call cache is blind to
                # gradients and would reuse the wrong kernel for a later call).
                self.no_grad.append(p.name)
                return t.bind(False, False)
            # Interface diff tensors need a gradient buffer on Vulkan/D3D12: a throwaway one.
            sink = self.scratch_grads(t, "sink")
            return t.native.with_grads(grad_in=sink, grad_out=sink, zero=False)
        self.accumulating(t, p)
        if p.tensor_kind is None and p.differentiable:
            return self._vectorised_grad(p, t)
        return t.bind(True)

    def _vectorised_grad(self, p: ParamInfo, t: Tensor) -> spy.Tensor:
        """Bind a vectorised input's gradient: a full-shape buffer summed after the call when
        the value is broadcast (or, in deterministic mode, shared with another parameter)."""
        broadcast = broadcast_grad.is_broadcast(t, self.shape, p)
        shared = id(t.grad_out.storage) in self.separate
        if not (broadcast or shared):
            return t.bind(True)
        if not broadcast_grad.expandable(t):
            self.untracked.append(
                f"the gradient of parameter '{p.name}' ({t.dtype}, broadcast or shared) is added "
                f"with float atomics: pydiff sums only {'/'.join(broadcast_grad.EXPANDABLE)} "
                "gradients itself; pass a full-shape tensor and sum it with pydiff.ops.sum"
            )
            return t.bind(True)
        native = broadcast_grad.expand(
            self.scope, self.device, t, self.shape if broadcast else None, len(self.reductions), p
        )
        self.reductions.append((native.grad_out, t))
        return native

    def fwd_arg(self, p: ParamInfo, t: Tensor) -> dict:
        """pydiff's FwdDiffTensor: gradients go to a fixed-point accumulator, added into the
        gradient buffer SlangPy would have used after the call."""
        bound = self.tensor_arg(p, t)
        acc = FixedPointAccumulator(
            self.scope, self.device, t.numel, self._desc(p), len(self.fixed), t.requires_grad
        )
        if t.requires_grad:
            self.fixed.append((acc, bound.grad_out))
        return fwd_tensor_struct(self.fn, p, t, None, bound.grad_in, acc.fields())

    def after_call(self) -> None:
        """Sum the full-shape and fixed-point gradients into their buffers (in order), and
        pass the upstream through the elements in-place calls did not write."""
        for name, mask in self.masks.items():
            mask.check_single_writes(self.scope, self.label, name, self.kept)
        if not self.fixed:
            self.kept = None  # (its copies back to the pool; kept for the overflow checks)
        for mask, upstream, grad in self.passes:
            mask.pass_unwritten(self.scope, upstream, grad)
        written_mask.clear_overwritten(self.scope, self.device, self.cleared)
        for acc, grad in self.fixed:
            acc.add_into(grad)
        for full, t in self.reductions:
            broadcast_grad.reduce_into(self.scope, self.device, full, t)

    def inout_args(self, p: ParamInfo, value: Any) -> dict[str, Any]:
        """The two wrapper arguments (value before, value after) for an ``inout`` parameter."""
        if not isinstance(value, Tensor):
            return {f"{p.name}__in": deep_bind(value), f"{p.name}__out": deep_bind(value)}
        check_device(self.fn, value, f"parameter '{p.name}'")
        self._needs_upstream(value, p, "read and written")
        both = self.separate_grads(value, p)
        return {
            f"{p.name}__in": value.bind(False, False).with_grads(
                grad_in=both.grad_out, grad_out=both.grad_out, zero=False
            ),
            f"{p.name}__out": primal_sink(self.device, value).with_grads(
                grad_in=both.grad_in, grad_out=both.grad_in, zero=False
            ),
        }

    def result_arg(self, result: Any, ret_name: str) -> Any:
        if type(result) is Tensor and result.grad_in is not None:
            if result.device is not self.device:
                check_device(self.fn, result, "_result")
            if id(result.storage) in self.prior:  # overwritten: its value before gets none
                self.cleared.append((None, result.grad_in))
            return upstream_arg(self.device, result, False)  # (unflushed: recorded in order)
        if result is MISSING:
            if ret_name == "void":
                return MISSING
            raise ValueError(
                f"{self.label}.bwds needs _result=: the upstream gradient of its {ret_name} "
                "result, as the result tensor with gradients (y.with_grads(ones=True)) or a number"
            )
        if isinstance(result, Tensor):
            check_device(self.fn, result, "_result")
            if not result.requires_grad:
                raise ValueError(
                    f"{self.label}.bwds: _result has no gradient buffer to read the upstream "
                    "gradient from; pass y.with_grads(...) holding dL/dy (or "
                    ".with_grads(ones=True))"
                )
            return upstream_arg(self.device, result, False)
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            if ret_name not in _SCALAR_RESULTS:
                raise TypeError(
                    f"{self.label}.bwds: a number as _result seeds a scalar result, but the "
                    f"result is {ret_name}; pass a tensor with gradients"
                )
            if ret_name == "half":
                return half_seed(self.label, self.device, self.shape, float(result))
            # SlangPy reads a plain float as the primal and seeds a zero gradient.
            return spy.diffPair(p=0.0, d=float(result))
        if isinstance(result, spy.DiffPair):
            return result
        # NumPy arrays and raw SlangPy tensors are silently read as zero gradients by SlangPy.
        raise TypeError(
            f"{self.label}.bwds: _result must be a pydiff.Tensor with gradients, a number or a "
            f"slangpy.diffPair, not {type(result).__name__}; e.g. "
            "pydiff.tensor(upstream).with_grads() and copy the upstream into its .grad"
        )

    def finish(self) -> None:
        for temp, dest in self.after:
            self.scope.keep(dest)
            self.scope.flush()
            dest.copy_(temp)
            self.scope.mark_result(dest)
