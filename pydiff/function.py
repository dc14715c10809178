"""Custom differentiable operations with a PyTorch-style ``Function`` API.

class Scale(pydiff.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return m.scale(x, s, _result="tensor")
    @staticmethod
    def backward(ctx, grad):
        return m.scale(grad, ctx.s, _result="tensor")

with pydiff.Tape() as tape:
    y = Scale.apply(x, 2.0)
tape.backward(y, grad=np.ones(y.shape))
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from . import foreign, forward_trace
from .backward_scope import active_scope, backward_scope
from .backward_claims import Claim, producer_claim
from .function_checks import as_tensor, bound_args, check_reached, gradients, own_outputs
from .function_checks import captured_reads, forward_writes, nested_tensors, refuse_nested
from .function_checks import add_on_device, detach_marked, tangent_in_dtype
from .tape import active_tape, pause_recording, resume_recording, suspend_recording
from .tensor import Tensor
from .unrecorded import MADE_OFF_TAPE, note_marked, note_unrecorded


_OWN_OPS = ("pydiff.ops_", "pydiff.tensor_api")  # fixed backward kernels, none refused part-way
_NESTED, _wants_grad = (list, tuple, dict), Tensor.requires_grad.fget  # (refuse_nested's)


class FunctionCtx:
    """What ``forward`` leaves for ``backward``: saved tensors and any attributes.

    >>> ctx.save_for_backward(x, w); ctx.scale = 2.0
    >>> x, w = ctx.saved_tensors
    """

    def __init__(self, name: str = "Function", inputs: list[Tensor] | None = None) -> None:
        self.saved_tensors: tuple = ()
        #: The tensor inputs of ``forward``, in order, and which of them need a gradient.
        self.inputs: list[Tensor] = list(inputs or [])
        self.needs_input_grad: tuple[bool, ...] = tuple([t.requires_grad for t in self.inputs])
        #: The Function's class name (for messages).
        self.name = name
        #: Inputs whose gradient ``backward`` added itself through ``grad_target``.
        self.targets: set[int] = set()
        #: The arguments of ``forward`` and its outputs as a tuple (for ``jvp``).
        self.args: tuple = ()
        self.outputs: tuple = ()
        #: Storage versions of the saved tensors when saved (id(storage): version).
        self.saved_versions: dict[int, int] = {}
        #: The outputs ``mark_non_differentiable`` was given.
        self.non_differentiable: tuple = ()

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep tensors for ``backward``. Saved inputs and outputs are checked at the backward
        (as PyTorch does): an input overwritten in place after it was saved (in ``forward``
        too), an output after the forward, raises RuntimeError."""
        self.saved_tensors = tuple(tensors)
        self.saved_versions = {
            id(t.storage): t.storage.version for t in tensors if isinstance(t, Tensor)
        }

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """In ``forward``: these outputs get no gradient (returned without gradient buffers;
        ``backward`` gets None; no tangent; gradcheck leaves them out), as integer and bool
        outputs. Without a backward, they need not depend on the inputs (not checked).

        >>> ctx.mark_non_differentiable(counts)
        """
        self.non_differentiable += outputs
        note_marked([o for o in outputs if all(o is not i for i in self.inputs)], self.name)

    def marked(self, output: Any) -> bool:
        """Whether ``output`` (that object) was given to ``mark_non_differentiable``."""
        return any(output is o for o in self.non_differentiable)

    def grad_target(self, k: int) -> Tensor | None:
        """In ``backward``: tensor input ``k``'s gradient buffer, ready to be **added** into
        (its zeroing policy applied), or None when it needs no gradient. Add your gradient
        there yourself (e.g. with a kernel that accumulates) and return None for input k:
        this saves a temporary and a separate accumulation.

        >>> target = ctx.grad_target(0)
        >>> if target is not None: m.add_into(target, g)          # then return None for it
        """
        inputs = self.inputs  # (_input_index's fast path inline: pydiff's own backwards)
        x = inputs[
            k if type(k) is int and 0 <= k < len(inputs) else self._input_index(k, "grad_target")
        ]
        if not x.requires_grad:
            return None
        scope, grad = active_scope(), x.grad_out  # (the policy zeroes it in place)
        if scope is not None and k not in self.targets:
            scope.before_accumulate(x, grad, f"input {k} of {self.name}")
        self.targets.add(k)
        return grad

    def producer(self, k: int) -> Claim | None:
        """In ``backward`` under ``Tape.backward``: the recorded Function call that produced
        tensor input ``k``, when this backward may do that call's backward as well (it alone
        reads the input, the call's one output; see ``backward_claims.Claim``), else None.
        Add what that backward would add (through ``claim.ctx.grad_target``), then
        ``claim.take_over()``.

        >>> claim = ctx.producer(0)
        >>> if claim is not None and claim.function is MyLinear:   # do its backward too, then
        ...     claim.take_over()
        """
        claim = producer_claim(self.inputs[self._input_index(k, "producer")])
        if claim is not None:
            claim.ctx.targets = set()  # its backward's additions start here, as in its own run
        return claim

    def _input_index(self, k: Any, where: str) -> int:
        """``k`` checked as the index of a tensor input (no negative indices: input k is the
        k-th tensor argument of ``forward``, and -1 would alias another)."""
        n = len(self.inputs)
        if type(k) is int and 0 <= k < n:  # (pydiff's own backwards: every call)
            return k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < n:
            raise IndexError(
                f"{self.name}: ctx.{where}({k!r}): k must be the index of a tensor input of "
                f"forward, 0 to {n - 1} ({n} tensor input{'s' if n != 1 else ''})"
            )
        return int(k)


class Function:
    """Base class of custom operations: static ``forward(ctx, *args)`` and, optionally,
    ``backward(ctx, *grad_outputs)``.

    Pattern 1: a forward made of pydiff calls needs no backward; the tape records those
    calls. Pattern 2: a forward from calls you do not want recorded (or from host code) with
    a hand-written backward returning one gradient per tensor input (``None`` where there is
    none; non-tensor arguments are not counted). Gradients may be pydiff Tensors or arrays.

    >>> class Legendre3(pydiff.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return m.p3(x, _result="tensor")
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return m.p3_grad(ctx.saved_tensors[0], g, _result="tensor")
    """

    #: Submit the pending kernels before ``backward`` runs (it may hand its upstream to raw
    #: SlangPy). pydiff's own ops set False (their backwards append pydiff kernels or call what
    #: flushes by itself: host reads, SlangPy calls): one submission per backward, not per op.
    flush_before_backward = True

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any) -> Any:
        raise NotImplementedError("subclasses of pydiff.Function define forward(ctx, *args)")

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def jvp(ctx: FunctionCtx, *tangents: Any) -> Any:
        """Forward mode (``pydiff.jvp``, ``jacfwd``, ``hvp``): one tangent per argument of
        ``forward`` (None for non-tensors and tensors without one), returns one tangent per
        output (None: zero). ``ctx`` holds what ``forward`` saved and ``ctx.outputs``. Write
        it with pydiff ops: under a tape they record, so ``hvp`` differentiates it again.

        >>> @staticmethod
        ... def jvp(ctx, tx):                 # forward: y = exp(x)
        ...     return pydiff.ops.mul(tx, ctx.outputs[0])
        """
        raise NotImplementedError

    @classmethod
    def _has_backward(cls) -> bool:
        return cls.backward is not Function.backward

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run forward; inside a Tape, record it so ``tape.backward`` reaches the inputs;
        inside ``pydiff.jvp``, give its outputs tangents (``jvp``). Keyword arguments are
        bound to ``forward``'s parameters, as torch binds them (``bound_args``)."""
        args = bound_args(cls.__name__, cls.forward, args, kwargs) if kwargs else args
        for k, a in enumerate(args):
            if not isinstance(a, Tensor) and (framework := foreign.framework(a)) is not None:
                raise TypeError(
                    f"{cls.__name__}.apply: argument {k} is a {framework} tensor; a "
                    f"pydiff.Function takes pydiff tensors: pydiff.torch_function("
                    f"{cls.__name__}.apply)(...) runs it inside {framework} autograd, or "
                    "convert the tensor with pydiff.from_torch(t)"
                )
        if (trace := forward_trace.active()) is not None:
            if cls.jvp is not Function.jvp:  # (one without: the calls inside carry them)
                has = trace.tangent
                refuse_nested(
                    cls.__name__, args, lambda t: has(t) is not None, "has a tangent", "tangents"
                )
            tangents = forward_trace.tangents_of(args)
            if any(t is not None for t in tangents):
                return _forward_mode(cls, args, tangents)
        return cls._run(args)[0]

    @classmethod
    def _run(cls, args: tuple) -> tuple[Any, FunctionCtx]:
        """``apply``'s work without forward mode: the result and the FunctionCtx."""
        name = cls.__name__
        inputs = [(i, a) for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx = FunctionCtx(name, [a for _, a in inputs])
        ctx.args = args
        tape = active_tape()
        if cls.backward is Function.backward:  # (_has_backward, inline)
            result = cls.forward(ctx, *args)  # pattern 1: the calls inside are recorded
            if tape is None:
                return result, ctx
            nested = [t for a in args for _, t in nested_tensors(a, "")]
            sources = {id(t.storage) for t in ctx.inputs + nested if t.requires_grad}
            if not sources:
                return result, ctx
            return _passed_through(cls, tape, result, inputs, ctx, sources), ctx
        if tape is not None and any([isinstance(a, _NESTED) for a in args]):  # (hold tensors)
            refuse_nested(name, args, _wants_grad, "requires grad", "gradients")
        own = cls.__module__.startswith(_OWN_OPS)
        check_writes = forward_writes(name, inputs, True) if tape is not None and not own else None
        captured_reads(name, inputs)  # (in a capture: a replay refuses once one is dropped)
        token = pause_recording()  # (suspend_recording's, without its object and frames)
        try:
            result = cls.forward(ctx, *args)
        finally:
            resume_recording(token)
        if check_writes is not None:
            check_writes(ctx.saved_versions)
        items = result if (outputs_tuple := isinstance(result, tuple)) else (result,)
        outputs = own_outputs(cls, items, inputs, inputs[0][1].device if inputs else None)
        # Integer and bool outputs (indices, masks) and marked ones have no gradient.
        marked = ctx.marked
        chosen = [k for k, (i, o) in enumerate(zip(items, outputs)) if marked(i) or marked(o)]
        constant = set(chosen) | {k for k, o in enumerate(outputs) if not o.differentiable}
        if constant:
            detach = [k in constant and o.requires_grad for k, o in enumerate(outputs)]
            outputs = tuple(o.detach() if d else o for d, o in zip(detach, outputs))
        note_marked([outputs[k] for k in chosen], name)  # (own_outputs' copies, detached views)
        for o in outputs:
            o.storage.wrote(f"{name}.forward")
        needs = any(ctx.needs_input_grad)
        if tape is not None and not needs:
            note_unrecorded(outputs, name, [t for _, t in inputs])
        if tape is None and needs:  # (.bwds of one warns: bwds_checks)
            for k, o in enumerate(outputs):
                if k not in constant:
                    gone = lambda _, i=id(o): MADE_OFF_TAPE.pop(i, None)  # noqa: E731
                    MADE_OFF_TAPE[id(o)] = (weakref.ref(o, gone), name, o.storage.version)
        if tape is not None and needs and len(constant) < len(outputs):
            for k, o in enumerate(outputs):
                if k not in constant and not o.requires_grad:
                    # Zeroed by the backward in its own command list (or when read first).
                    o.requires_grad_(True, zero_later=True)
            saved = ctx.saved_versions  # an input's values as saved: forward may write it after
            reads: list = []
            for k, (_, t) in enumerate(inputs):
                version = saved.get(id(t.storage))
                if version is None:
                    reads.append((f"input {k} of {name}", t, t.storage.version))
                else:
                    reads.append((f"input {k} of {name}, saved for its backward,", t, version))
            saved_ids = {id(t.storage) for t in ctx.saved_tensors if isinstance(t, Tensor)}
            reads += [  # outputs the backward reads (the inputs are read anyway)
                (f"output {k} of {name}, saved for its backward,", o)
                for k, o in enumerate(outputs)
                if id(o.storage) in saved_ids
            ]

            def run_backward(entry: Any) -> None:
                _run_backward(cls, ctx, [t for _, t in inputs], outputs, constant)

            writes = [o for k, o in enumerate(outputs) if k not in constant]
            tape.record(  # may_refuse: a user's backward (restoring)
                f"{name}.apply",
                reads,
                writes,
                run_backward,
                function=cls,
                ctx=ctx,
                may_refuse=not own,
            )
        ctx.outputs = outputs
        return (outputs if outputs_tuple else outputs[0]), ctx


def _forward_mode(cls: type, args: tuple, tangents: tuple) -> Any:
    """``apply`` inside ``pydiff.jvp`` with tangents for some inputs: the class's ``jvp``; a
    forward of recorded calls (pattern 1) without one carries the tangents through them."""
    name = cls.__name__
    if cls.jvp is Function.jvp:
        if cls._has_backward():
            raise NotImplementedError(
                f"{name} has a backward but no jvp: forward mode (pydiff.jvp, jacfwd, hvp, "
                f"hessian) cannot pass through it. Define @staticmethod jvp(ctx, *tangents) "
                "returning one tangent per output (see pydiff.Function.jvp)"
            )
        result, ctx = cls._run(args)  # the calls inside carry the tangents; marked: none
        return detach_marked(result, ctx) if ctx.non_differentiable else result
    trace = forward_trace.active()
    with forward_trace.suspended():
        result, ctx = cls._run(args)
        ctx.outputs = result if isinstance(result, tuple) else (result,)
        got = cls.jvp(ctx, *tangents)
    many = isinstance(result, tuple)
    got = got if many and isinstance(got, (tuple, list)) else (got,)
    if len(got) != len(ctx.outputs):
        raise RuntimeError(
            f"{name}.jvp() returned {len(got)} tangents but forward returned "
            f"{len(ctx.outputs)} outputs; return one per output (None: zero)"
        )
    for k, (o, t) in enumerate(zip(ctx.outputs, got)):
        t = None if ctx.marked(o) else t  # a constant, as in reverse mode (before 11-29: not)
        if t is not None and not isinstance(t, Tensor):
            tangent_in_dtype(t, o, name, k, None)  # booleans refused
            first_order_only(ctx, f"{name}.jvp() returned a {type(t).__name__}, not pydiff ops")
            t = as_tensor(t, o.device, cls, "jvp", k)
        if t is not None:  # in the output's dtype, as backward's gradients are converted
            t = tangent_in_dtype(t, o, name, k, lambda why: first_order_only(ctx, why))
        if t is not None and t.expected_numpy_shape() != o.expected_numpy_shape():
            raise RuntimeError(
                f"{name}.jvp() tangent {k} has shape {t.expected_numpy_shape()} but output {k} "
                f"has shape {o.expected_numpy_shape()}; return a tangent of the output's shape"
            )
        trace.set(o, t)
    return result


def first_order_only(ctx: FunctionCtx, why: str) -> None:
    """In a ``jvp`` rule not written with recorded ops: refuse when a tape records it for
    a second derivative (``hvp``/``hessian``: reverse over forward), which would be wrong."""
    if active_tape() is not None and any(t.requires_grad for t in ctx.inputs):
        raise NotImplementedError(
            f"{ctx.name}: its forward-mode tangent ({why}) cannot be differentiated again, so "
            "hvp/hessian (reverse over forward) cannot pass through it; use jvp, jacfwd or "
            "jacrev (first derivatives) for functions that use it"
        )


def _passed_through(
    cls: type, tape: Any, result: Any, inputs: list, ctx: FunctionCtx, sources: set
) -> Any:
    """Pattern 1's outputs on a tape, each that is an input (or a view of one: ``return x``)
    replaced by a copy recorded on the tape with the identity's backward (no recorded call
    wrote the input, so the tape could not reach it from the output, nor its gradient the
    input); marked ones detached. The others must be connected to inputs that require grad
    (``sources``, storage ids) by recorded calls (``check_reached``)."""
    many = isinstance(result, tuple)
    taken = {id(t.storage) for _, t in inputs}
    identity = type(cls.__name__, (Function,), {"backward": staticmethod(lambda ctx, g: g)})
    outputs, checked = [], []
    for k, o in enumerate(result if many else (result,)):
        if isinstance(o, Tensor) and ctx.marked(o):
            o = detach_marked(o, ctx)  # (no tangent, left out by gradcheck)
        elif isinstance(o, Tensor) and id(o.storage) in taken and o.requires_grad:
            with suspend_recording():
                copy = o.copy_values()
            copy.storage.wrote(f"{cls.__name__}.forward")
            copy.requires_grad_(True)
            forward_trace.derived(o, copy, lambda t: t)  # the input's tangent (pydiff.jvp)
            one = FunctionCtx(cls.__name__, [o])

            def run_backward(entry: Any, ctx: FunctionCtx = one, o: Tensor = o, c: Tensor = copy):
                _run_backward(identity, ctx, [o], (c,))

            tape.record(
                f"{cls.__name__}.apply", [(f"input of {cls.__name__}", o)], [copy], run_backward
            )
            o = copy
        elif isinstance(o, Tensor):
            checked.append((k, o))
        outputs.append(o)
    check_reached(cls.__name__, tape, checked, sources)
    return tuple(outputs) if many else outputs[0]


def _run_backward(
    cls: type, ctx: FunctionCtx, inputs: list[Tensor], outputs: tuple, constant: set = frozenset()
) -> None:
    """Run ``cls.backward`` and add its gradients into the inputs' (``constant``: indices of
    the outputs without gradient, which get None)."""
    outer = active_scope()
    if outer is not None and cls.flush_before_backward:
        outer.flush()  # the upstream gradients must be complete before user code reads them
    grad_outputs = tuple([None if k in constant else o.grad_in for k, o in enumerate(outputs)])
    ctx.targets = set()  # (what this backward adds through grad_target: not an earlier one's)
    grads = gradients(cls, ctx, cls.backward(ctx, *grad_outputs), inputs)
    adds = []  # every gradient checked before any is added (a refusal changes none)
    for k, (g, x) in enumerate(zip(grads, inputs)):
        if k in ctx.targets:
            if g is not None:
                raise RuntimeError(
                    f"{cls.__name__}.backward() added input {k}'s gradient through "
                    "ctx.grad_target and also returned one; return None for it"
                )
            continue
        if g is None or not x.requires_grad:
            continue
        want = x.expected_numpy_shape()
        got = g.expected_numpy_shape() if isinstance(g, Tensor) else g.shape
        if got != want:
            kind = f" (a {g.dtype} tensor)" if isinstance(g, Tensor) else ""
            raise RuntimeError(
                f"{cls.__name__}.backward() gradient {k} has shape {got}{kind} but input "
                f"{k} has shape {want} ({x.dtype}); return a gradient of the input's shape"
            )
        adds.append((k, g, x))
    if not adds:  # (all added through grad_target, or none: no scope to open)
        return
    with backward_scope(f"{cls.__name__}.backward") as scope:
        for k, g, x in adds:
            arr = None if isinstance(g, Tensor) else g
            scope.before_accumulate(x, x.grad_out, f"input {k} of {cls.__name__}")
            if (
                isinstance(g, Tensor)
                and g.dtype == "float" == x.grad_out.dtype
                and g.device == x.device
            ):
                add_on_device(x.grad_out, g)  # no host round trip
            else:
                arr = g.numpy() if arr is None else arr
                held = x.grad_out.numpy()
                with np.errstate(over="ignore"):  # a sum past the range is inf, as on the device
                    total = (held + arr).astype(held.dtype)
                x.grad_out.copy_from_numpy(total, caller=f"{cls.__name__}.backward()")
            scope.mark_result(x.grad_out)
