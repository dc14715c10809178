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

from typing import Any

import numpy as np

from .backward_scope import active_scope, backward_scope
from .creation import tensor as make_tensor
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

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tuple(tensors)

    def grad_target(self, k: int) -> Tensor | None:
        """In ``backward``: tensor input ``k``'s gradient buffer, ready to be **added** into
        (its zeroing policy applied), or None when it needs no gradient. Add your gradient
        there yourself (e.g. with a kernel that accumulates) and return None for input k:
        this saves a temporary and a separate accumulation.

        >>> target = ctx.grad_target(0)
        >>> if target is not None: m.add_into(target, g)          # then return None for it
        """
        x = self.inputs[k]
        if not x.requires_grad:
            return None
        scope = active_scope()
        if scope is not None and k not in self.targets:
            scope.before_accumulate(x, x.grad_out, f"input {k} of {self.name}")
        self.targets.add(k)
        return x.grad_out


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

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any) -> Any:
        raise NotImplementedError("subclasses of pydiff.Function define forward(ctx, *args)")

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def _has_backward(cls) -> bool:
        return cls.backward is not Function.backward

    @classmethod
    def apply(cls, *args: Any) -> Any:
        """Run forward; inside a Tape, record it so ``tape.backward`` reaches the inputs."""
        inputs = [(i, a) for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx = FunctionCtx(cls.__name__, [a for _, a in inputs])
        tape = active_tape()
        if not cls._has_backward():
            return cls.forward(ctx, *args)  # pattern 1: the calls inside are recorded
        with suspend_recording():
            result = cls.forward(ctx, *args)
        outputs_tuple = isinstance(result, tuple)
        device = inputs[0][1].device if inputs else None
        outputs = tuple(
            _as_tensor(o, device, cls, "forward", k)
            for k, o in enumerate(result if outputs_tuple else (result,))
        )
        for o in outputs:
            o.storage.wrote(f"{cls.__name__}.forward")
        if tape is not None and any(ctx.needs_input_grad):
            for o in outputs:
                if not o.requires_grad:
                    o.requires_grad_(True)
            reads = [(f"input {k} of {cls.__name__}", t) for k, (_, t) in enumerate(inputs)]

            def run_backward(entry: Any) -> None:
                _run_backward(cls, ctx, [t for _, t in inputs], outputs)

            tape.record(f"{cls.__name__}.apply", reads, list(outputs), run_backward)
        return outputs if outputs_tuple else outputs[0]


def _as_tensor(value: Any, device: Any, cls: type, where: str, k: int) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (np.ndarray, list, float, int)):
        return make_tensor(np.asarray(value, dtype=np.float32), device=device)
    raise TypeError(
        f"{cls.__name__}.{where}() output {k} is a {type(value).__name__}; return pydiff "
        "Tensors (or NumPy arrays)"
    )


def _run_backward(cls: type, ctx: FunctionCtx, inputs: list[Tensor], outputs: tuple) -> None:
    outer = active_scope()
    if outer is not None:
        outer.flush()  # the upstream gradients must be complete before user code reads them
    grad_outputs = tuple(o.grad_in for o in outputs)
    grads = cls.backward(ctx, *grad_outputs)
    if not isinstance(grads, tuple):
        grads = (grads,)
    if len(grads) != len(inputs):
        raise RuntimeError(
            f"{cls.__name__}.backward() returned {len(grads)} gradients but expected "
            f"{len(inputs)} (one per tensor input of forward, None where there is none)"
        )
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
            arr = None if isinstance(g, Tensor) else np.asarray(g, dtype=np.float64)
            want = x.expected_numpy_shape()
            got = g.expected_numpy_shape() if isinstance(g, Tensor) else arr.shape
            if got != want:
                raise RuntimeError(
                    f"{cls.__name__}.backward() gradient {k} has shape {got} but input "
                    f"{k} has shape {want}"
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
            dst=dst.native.storage,
            dst_in=dst.native.storage,
            src=src.native.storage,
            count=count,
        )
    else:
        dev.flush()  # SlangPy runs it now: what is queued goes first
        dev.library.accumulate(dst.native, src.native)
    dst.storage.wrote("a Function's gradient")
