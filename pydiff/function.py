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
from .creation import tensor as make_tensor
from .backward_claims import Claim, producer_claim
from .tape import active_tape, suspend_recording
from .tensor import Tensor, float4_ready


class FunctionCtx:
    """What ``forward`` leaves for ``backward``: saved tensors and any attributes.

    >>> ctx.save_for_backward(x, w); ctx.scale = 2.0
    >>> x, w = ctx.saved_tensors
    """

    def __init__(self, name: str = "Function", inputs: list[Tensor] | None = None) -> None:
        self.saved_tensors: tuple = ()
        #: The tensor inputs of ``forward``, in order, and which of them need a gradient.
        self.inputs: list[Tensor] = list(inputs or [])
        self.needs_input_grad: tuple[bool, ...] = tuple(t.requires_grad for t in self.inputs)
        #: The Function's class name (for messages).
        self.name = name
        #: Inputs whose gradient ``backward`` added itself through ``grad_target``.
        self.targets: set[int] = set()
        #: The arguments of ``forward`` and its outputs as a tuple (for ``jvp``).
        self.args: tuple = ()
        self.outputs: tuple = ()

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep tensors for ``backward``. Saved inputs and outputs are checked at the backward
        (as PyTorch does): overwritten in place after the forward, they raise RuntimeError."""
        self.saved_tensors = tuple(tensors)

    def grad_target(self, k: int) -> Tensor | None:
        """In ``backward``: tensor input ``k``'s gradient buffer, ready to be **added** into
        (its zeroing policy applied), or None when it needs no gradient. Add your gradient
        there yourself (e.g. with a kernel that accumulates) and return None for input k:
        this saves a temporary and a separate accumulation.

        >>> target = ctx.grad_target(0)
        >>> if target is not None: m.add_into(target, g)          # then return None for it
        """
        x = self.inputs[self._input_index(k, "grad_target")]
        if not x.requires_grad:
            return None
        scope = active_scope()
        if scope is not None and k not in self.targets:
            scope.before_accumulate(x, x.grad_out, f"input {k} of {self.name}")
        self.targets.add(k)
        return x.grad_out

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

    #: Submit the backward's pending kernels before ``backward`` runs, so that it may hand
    #: its upstream gradients to raw SlangPy. pydiff's own ops, whose backward only appends
    #: pydiff kernels or calls what flushes by itself (host reads, SlangPy calls), set False:
    #: one submission per backward instead of one per op.
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
    def apply(cls, *args: Any) -> Any:
        """Run forward; inside a Tape, record it so ``tape.backward`` reaches the inputs;
        inside ``pydiff.jvp``, give its outputs tangents (``jvp``)."""
        for k, a in enumerate(args):
            if not isinstance(a, Tensor) and (framework := foreign.framework(a)) is not None:
                raise TypeError(
                    f"{cls.__name__}.apply: argument {k} is a {framework} tensor; a "
                    f"pydiff.Function takes pydiff tensors: pydiff.torch_function("
                    f"{cls.__name__}.apply)(...) runs it inside {framework} autograd, or "
                    "convert the tensor with pydiff.from_torch(t)"
                )
        if forward_trace.active() is not None:
            tangents = forward_trace.tangents_of(args)
            if any(t is not None for t in tangents):
                return _forward_mode(cls, args, tangents)
        return cls._run(args)[0]

    @classmethod
    def _run(cls, args: tuple) -> tuple[Any, FunctionCtx]:
        """``apply``'s work without forward mode: the result and the FunctionCtx."""
        inputs = [(i, a) for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx = FunctionCtx(cls.__name__, [a for _, a in inputs])
        ctx.args = args
        tape = active_tape()
        if not cls._has_backward():
            result = cls.forward(ctx, *args)  # pattern 1: the calls inside are recorded
            if tape is None or not any(ctx.needs_input_grad):
                return result, ctx
            return _passed_through(cls, tape, result, inputs), ctx
        with suspend_recording():
            result = cls.forward(ctx, *args)
        outputs_tuple = isinstance(result, tuple)
        device = inputs[0][1].device if inputs else None
        outputs = _own_outputs(cls, result if outputs_tuple else (result,), inputs, device)
        for o in outputs:
            o.storage.wrote(f"{cls.__name__}.forward")
            if tape is None and any(ctx.needs_input_grad):
                gone = lambda _, k=id(o): MADE_OFF_TAPE.pop(k, None)  # noqa: E731
                MADE_OFF_TAPE[id(o)] = (weakref.ref(o, gone), cls.__name__, o.storage.version)
        if tape is not None and any(ctx.needs_input_grad):
            for o in outputs:
                if not o.requires_grad:
                    # Zeroed by the backward in its own command list (or when read first).
                    o.requires_grad_(True, zero_later=True)
            reads = [(f"input {k} of {cls.__name__}", t) for k, (_, t) in enumerate(inputs)]
            reads += [  # outputs the backward reads (the inputs are read anyway)
                (f"output {k} of {cls.__name__}, saved for its backward,", o)
                for k, o in enumerate(outputs)
                if any(isinstance(t, Tensor) and t.storage is o.storage for t in ctx.saved_tensors)
            ]

            def run_backward(entry: Any) -> None:
                _run_backward(cls, ctx, [t for _, t in inputs], outputs)

            tape.record(
                f"{cls.__name__}.apply", reads, list(outputs), run_backward, function=cls, ctx=ctx
            )
        ctx.outputs = outputs
        return (outputs if outputs_tuple else outputs[0]), ctx


# Outputs of Functions with a backward computed off a tape from inputs that require a
# gradient (x[1:], x.T): copies with no path back, which .bwds warns of (bwds_checks).
# {id: (weakref to the tensor, class name, storage version then)}; by id: tensors refuse ==.
MADE_OFF_TAPE: dict[int, tuple] = {}


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
        return cls._run(args)[0]  # the calls inside carry the tangents
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
        if t is not None and not isinstance(t, Tensor):
            first_order_only(ctx, f"{name}.jvp() returned a {type(t).__name__}, not pydiff ops")
            t = _as_tensor(t, o.device, cls, "jvp", k)
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


def _passed_through(cls: type, tape: Any, result: Any, inputs: list) -> Any:
    """Pattern 1's outputs, each that is an input (or a view of one: ``return x``) replaced
    by a copy recorded on the tape with the identity's backward. No recorded call wrote the
    input, so the tape could not reach it from the output (nor its gradient the input)."""
    many = isinstance(result, tuple)
    taken = {id(t.storage) for _, t in inputs}
    identity = type(cls.__name__, (Function,), {"backward": staticmethod(lambda ctx, g: g)})
    outputs = []
    for o in result if many else (result,):
        if isinstance(o, Tensor) and id(o.storage) in taken and o.requires_grad:
            with suspend_recording():
                copy = o.copy_values()
            copy.storage.wrote(f"{cls.__name__}.forward")
            copy.requires_grad_(True)
            forward_trace.derived(o, copy, lambda t: t)  # the input's tangent (pydiff.jvp)
            ctx = FunctionCtx(cls.__name__, [o])

            def run_backward(entry: Any, ctx: FunctionCtx = ctx, o: Tensor = o, c: Tensor = copy):
                _run_backward(identity, ctx, [o], (c,))

            tape.record(
                f"{cls.__name__}.apply", [(f"input of {cls.__name__}", o)], [copy], run_backward
            )
            o = copy
        outputs.append(o)
    return tuple(outputs) if many else outputs[0]


def _as_tensor(value: Any, device: Any, cls: type, where: str, k: int) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, list) and any(isinstance(v, Tensor) for v in value):
        raise TypeError(
            f"{cls.__name__}.{where}() returned a list holding pydiff Tensors; return several "
            "outputs as a tuple (return a, b)"
        )
    if isinstance(value, (np.ndarray, list, float, int)):
        return make_tensor(np.asarray(value, dtype=np.float32), device=device)
    raise TypeError(
        f"{cls.__name__}.{where}() output {k} is a {type(value).__name__}; return pydiff "
        "Tensors (or NumPy arrays)"
    )


def _own_outputs(cls: type, items: tuple, inputs: list, device: Any) -> tuple[Tensor, ...]:
    """The outputs as tensors of their own: an output that is an input, a view of one (same
    storage) or another output again is copied. Sharing an input's gradient buffers would
    count that input's gradient twice (the seed and backward's gradient land in one buffer),
    and marking the output written would look like an overwrite of the input."""
    taken = {id(t.storage) for _, t in inputs}
    outputs = []
    for k, o in enumerate(items):
        t = _as_tensor(o, device, cls, "forward", k)
        if id(t.storage) in taken:
            t = t.copy_values()
        taken.add(id(t.storage))
        outputs.append(t)
    return tuple(outputs)


_GRAD_TYPES = "a pydiff.Tensor, a NumPy array (or number) or None"


def _expected(cls: type, inputs: list[Tensor]) -> str:
    shapes = ", ".join(f"input {k}: shape {x.expected_numpy_shape()}" for k, x in enumerate(inputs))
    return (
        f"{cls.__name__}.backward() must return one gradient per tensor input of forward "
        f"({len(inputs)}: {shapes}), each {_GRAD_TYPES} (None: no gradient for that input); "
        "several as a tuple"
    )


def _gradients(cls: type, ctx: FunctionCtx, grads: Any, inputs: list[Tensor]) -> tuple:
    """backward's return value as one checked entry per tensor input."""
    name = cls.__name__
    if grads is None and not ctx.targets:
        raise TypeError(
            f"{name}.backward() returned None (a missing return?). {_expected(cls, inputs)}; "
            f"to give no gradient at all return {'(None,)' if len(inputs) == 1 else 'Nones'}"
        )
    if isinstance(grads, list) and len(inputs) > 1:
        if len(grads) == len(inputs) and all(
            g is None or isinstance(g, (Tensor, np.ndarray)) for g in grads
        ):
            grads = tuple(grads)  # a list of one gradient per input
    if not isinstance(grads, tuple):
        grads = (grads,)
    if len(grads) != len(inputs):
        raise RuntimeError(
            f"{name}.backward() returned {len(grads)} gradients but expected "
            f"{len(inputs)} (one per tensor input of forward, None where there is none). "
            f"{_expected(cls, inputs)}"
        )
    checked = []
    for k, g in enumerate(grads):
        if g is None or isinstance(g, Tensor):
            checked.append(g)
            continue
        what = f"{name}.backward() gradient {k} is a {type(g).__name__}"
        if isinstance(g, (str, bytes, dict, set)) or not isinstance(
            g, (np.ndarray, list, tuple, float, int, np.number)
        ):
            raise TypeError(f"{what}; it must be {_GRAD_TYPES}. {_expected(cls, inputs)}")
        try:
            arr = np.asarray(g)
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"elements of type {arr.dtype}")
            arr = arr.astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{what} that is not an array of numbers ({exc}); it must be {_GRAD_TYPES}. "
                f"{_expected(cls, inputs)}"
            ) from None
        checked.append(arr)
    return tuple(checked)


def _run_backward(cls: type, ctx: FunctionCtx, inputs: list[Tensor], outputs: tuple) -> None:
    outer = active_scope()
    if outer is not None and cls.flush_before_backward:
        outer.flush()  # the upstream gradients must be complete before user code reads them
    grad_outputs = tuple(o.grad_in for o in outputs)
    ctx.targets = set()  # (what this backward adds through grad_target: not an earlier one's)
    grads = _gradients(cls, ctx, cls.backward(ctx, *grad_outputs), inputs)
    with backward_scope(f"{cls.__name__}.backward") as scope:
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
            arr = None if isinstance(g, Tensor) else g
            want = x.expected_numpy_shape()
            got = g.expected_numpy_shape() if isinstance(g, Tensor) else arr.shape
            if got != want:
                kind = f" (a {g.dtype} tensor)" if isinstance(g, Tensor) else ""
                raise RuntimeError(
                    f"{cls.__name__}.backward() gradient {k} has shape {got}{kind} but input "
                    f"{k} has shape {want} ({x.dtype}); return a gradient of the input's shape"
                )
            scope.before_accumulate(x, x.grad_out, f"input {k} of {cls.__name__}")
            if (
                isinstance(g, Tensor)
                and g.dtype == "float" == x.grad_out.dtype
                and g.device == x.device
            ):
                _add_on_device(x.grad_out, g)  # no host round trip
            else:
                arr = g.numpy() if arr is None else arr
                x.grad_out.copy_from_numpy(x.grad_out.numpy() + arr)
            scope.mark_result(x.grad_out)


def _add_on_device(dst: Tensor, src: Tensor) -> None:
    """dst += src for float tensors of one device and shape."""
    dev = dst.device
    if src.shape == dst.shape and float4_ready(src, dst):
        count = -(-src.numel // 4)
        kernel = dev.kernels.get("tensor_helpers.slang", "accumulate4")
        dev.kernels.dispatch(
            kernel,
            count,
            dst=dst.buffer,
            dst_in=dst.buffer,
            src=src.buffer,
            count=count,
        )
    else:
        dev.flush()  # SlangPy runs it now: what is queued goes first
        dev.library.accumulate(dst.native, src.native)
    dst.storage.wrote("a Function's gradient")
