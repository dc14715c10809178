"""PyTorch interop: tensors both ways, and pydiff code inside torch autograd.

On CUDA ``to_torch`` hands torch a view of pydiff's own buffer (zero-copy, after pydiff's
pending work), and ``from_torch`` of a CUDA tensor copies on the device (SlangPy 0.43 cannot
wrap memory it did not allocate). On Vulkan values cross through NumPy, one copy each way
(bit-exact). torch is imported only when one of these is used.

    x = pydiff.from_torch(torch.randn(4), requires_grad=True)
    t = pydiff.to_torch(x)                              # a torch.Tensor with x's values
    layer = pydiff.torch_function(m.my_layer)           # callable of torch tensors, autograd
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import numpy as np
import slangpy as spy

from . import foreign, forward_trace, temporary_copies, torch_args
from .creation import empty as make_empty, tensor as make_tensor
from .device import Device, resolve_device
from .dtype_names import dtype_name
from .errors import OpDtypeError
from .grad_transforms import on_tape
from .lost_derivative import refuse_lost_copy
from .tape import Tape, active_tape
from .tensor import Tensor
from .torch_args import describe
from .torch_dtypes import FROM_TORCH, converted, host_torch
from .torch_passes import accumulates_leaves, pass_without_leaves, running_pass, torch_pass

#: pydiff scalar type -> torch dtype name.
TO_TORCH = {"float": "float32", "half": "float16", "int": "int32", "uint": "uint32"}
#: pydiff scalar type -> SlangPy's DataType, for views of a CUDA buffer.
_SPY_TYPES = {
    "float": spy.DataType.float32,
    "half": spy.DataType.float16,
    "int": spy.DataType.int32,
    "uint": spy.DataType.uint32,
}


def torch_module() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(
            "pydiff's PyTorch interop needs torch: pip install 'pydiff[torch]' (or any torch)"
        ) from None
    return torch


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch.Tensor (False, without importing torch, when not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def from_torch(
    t: Any,
    *,
    device: Device | str | None = None,
    requires_grad: bool | None = None,
    dtype: str | None = None,
) -> Tensor:
    """A pydiff tensor with the values, shape and dtype of the torch tensor ``t`` (a copy).

    float32, float16, int32 and uint32 convert exactly; float64 and int64 only when asked
    (``dtype="float"`` / ``dtype="int"``: a narrowing copy, int64 values checked to fit);
    other dtypes raise TypeError. ``requires_grad`` defaults to ``t.requires_grad``.

    >>> x = pydiff.from_torch(torch.linspace(0, 1, 5), requires_grad=True)
    >>> labels = pydiff.from_torch(torch.tensor([0, 2, 1]), dtype="int")   # int64 -> int32
    """
    torch = torch_module()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch: t must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(
            f"from_torch: t has layout {t.layout} (sparse); pydiff tensors are dense: pass "
            "t.to_dense()"
        )
    if t.device.type == "meta":
        raise ValueError(
            "from_torch: t is on torch's 'meta' device: it has a shape but no values to copy"
        )
    if requires_grad is not None and not isinstance(requires_grad, (bool, np.bool_)):
        raise TypeError(f"from_torch: requires_grad must be a bool or None, not {requires_grad!r}")
    given_grad = t.requires_grad
    t = t.detach().resolve_conj().resolve_neg()  # (a negated view: numpy() refused it)
    name = str(t.dtype).removeprefix("torch.")
    # (a NumPy dtype compared equal to a name: np.dtype(np.float64) == "float" narrowed)
    dtype = None if dtype is None else dtype_name(dtype)
    if t.numel() == 0:
        raise ValueError(
            f"from_torch: t has shape {tuple(t.shape)}: no elements (a pydiff tensor has one "
            "at least)"
        )
    if name in FROM_TORCH and dtype in (None, FROM_TORCH[name]):
        target = FROM_TORCH[name]
        arr = None if t.is_cuda else t.detach().contiguous().numpy()
    else:  # (same width asked for, a narrowing asked for, or TypeError naming dtype=)
        target, arr = converted(name, dtype, t.detach().cpu().contiguous, "from_torch", "torch.")
    wants_grad = given_grad if requires_grad is None else requires_grad
    if wants_grad and target not in ("float", "half"):
        raise ValueError(f"from_torch: requires_grad=True needs a floating dtype, not {target!r}")
    dev = resolve_device(device)
    if t.is_cuda and dev.type == "cuda" and name in FROM_TORCH:
        out = make_empty(tuple(t.shape), dtype=target, device=dev, requires_grad=bool(wants_grad))
        shared_view(out).copy_(t.detach())  # on the device: no host round trip
        torch.cuda.current_stream(t.device).synchronize()  # before pydiff's kernels read it
        return out.wrote_from_outside("pydiff.from_torch")
    if arr is None:
        arr = t.detach().cpu().contiguous().numpy()
    return make_tensor(arr, dtype=target, device=dev, requires_grad=bool(wants_grad))


def to_torch(x: Tensor) -> Any:
    """A torch tensor with the values, shape and dtype of ``x`` (vector dtypes such as float3
    keep their components as a last axis). On a CUDA device it is a view of ``x``'s buffer
    (zero-copy, taken after pydiff's pending work: later writes by either side show in the
    other); elsewhere a CPU copy. It has no autograd link to ``x``: use ``torch_function``.

    >>> t = pydiff.to_torch(pydiff.tensor([1.0, 2.0]))      # tensor([1., 2.])
    >>> g = pydiff.to_torch(x.grad)

    Refused (``TypeError``) where the copy would lose a derivative without a word, as the
    DLPack export is: ``x`` requires a gradient while a pydiff tape records, or has a tangent
    under ``pydiff.jvp`` (before, ``grad`` of ``from_torch(to_torch(x) * 2)`` was 0).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"to_torch: x must be a pydiff.Tensor, not {type(x).__name__}")
    refuse_lost_copy(x, "pydiff.to_torch")
    if x.device.type == "cuda":  # (a view of its memory: of the row's copy, for a row)
        temporary_copies.refuse_row_export(x, "pydiff.to_torch(row), a zero-copy export on CUDA,")
    return _torch_of(x)


def _torch_of(x: Tensor) -> Any:
    """``to_torch`` without the refusal: pydiff's own hand-over of results and gradients."""
    torch = torch_module()
    if x.scalar_type not in TO_TORCH:  # (int64_t, int8_t, double, ...: a host copy)
        return host_torch(x, torch)
    if x.device.type == "cuda" and torch.cuda.is_available():
        return shared_view(x)
    values = x.numpy()  # (np.ascontiguousarray would make a 0-d array 1-D)
    return torch.from_numpy(values if values.flags.c_contiguous else values.copy(order="C"))


def shared_view(x: Tensor) -> Any:
    """A torch CUDA tensor over ``x``'s own buffer (a CUDA device's tensor of a scalar or
    vector dtype), once pydiff's pending work on it has run. SlangPy's view keeps the buffer
    alive, so pydiff never reuses it while torch holds the view.

    >>> shared_view(x).add_(1.0)         # x's values, changed in place by torch
    """
    torch = torch_module()
    native = x.native  # submits pydiff's deferred kernels
    x.device.native.wait_for_idle()
    item = torch.empty((), dtype=getattr(torch, TO_TORCH[x.scalar_type])).element_size()
    element = x.expected_numpy_shape()[len(x.shape) :]
    per = int(native.dtype.buffer_layout.stride) // item
    if len(element) > 1 or (element and per < element[0]):
        raise TypeError(f"to_torch: no zero-copy view of dtype {x.dtype!r} (a matrix dtype)")
    buf = native.storage
    flat = buf.to_torch(_SPY_TYPES[x.scalar_type], [buf.size // item], [1], 0)
    strides = [int(s) * per for s in native.strides][: len(x.shape)] + ([1] if element else [])
    return flat.as_strided(tuple(x.expected_numpy_shape()), strides, int(native.offset) * per)


def torch_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a callable of pydiff tensors: a shader function, an op, a ``pydiff.Function``
    or Python composing them) as a callable of torch tensors that takes part in torch
    autograd: the forward runs ``fn`` on a pydiff tape, the backward runs the tape and hands
    torch the gradients of the positional tensor arguments. Results are torch tensors.

    >>> f = pydiff.torch_function(m.polynomial)
    >>> y = f(2.0, 8.0, -1.0, torch.tensor([1.0, 2.0], requires_grad=True))
    >>> y.sum().backward()
    """
    if not callable(fn):
        raise TypeError(f"torch_function: fn must be callable, not {type(fn).__name__}")

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if active_tape() is not None:
            raise RuntimeError(
                f"pydiff.torch_function({getattr(fn, '__name__', fn)}) inside a pydiff tape "
                "(Tape, grad, vjp, jacrev...): torch_function runs outside pydiff tapes (they do "
                "not nest); there call fn on pydiff tensors (pydiff.from_torch(t) for torch's)"
            )
        return _bridge().apply(fn, kwargs, _anchor(args, kwargs), *args)

    return call


def _anchor(args: tuple, kwargs: dict) -> Any:
    """The torch leaf each call takes as its first tensor input while torch records (torch
    records a call for inputs of its own only: a pydiff argument's, or a pydiff tensor the
    function closes over, gradient would be lost; outputs that need none are marked
    non-differentiable after the forward). Its gradient accumulator tells the backward
    whether the pass writes every leaf's ``.grad`` (``accumulates_leaves``): no user names
    it. One leaf for every call: torch never adds anything into it (its gradient is None)."""
    return _shared_anchor() if torch_module().is_grad_enabled() else None


@functools.cache
def _shared_anchor() -> Any:
    return torch_module().ones((), requires_grad=True)


def _convert_arg(value: Any, where: str, nested: str = "", device: Any = None) -> Any:
    """A torch tensor argument as a pydiff tensor on ``device`` (the call's: ``torch_args``;
    int64 narrowed where it fits: torch's labels), and torch tensors inside lists, tuples
    and dicts (they cannot need gradients)."""
    if is_torch_tensor(value):
        if nested and value.requires_grad:
            raise ValueError(
                f"{where} holds a torch tensor that requires grad inside a {nested}: torch "
                "autograd reaches direct positional arguments "
                "only; pass it as one"
            )
        name = str(value.dtype).removeprefix("torch.")
        if name == "float64":
            raise TypeError(
                f"{where} is a torch.float64 tensor; pydiff computes in float32: pass t.float()"
            )
        narrow = "int" if name == "int64" else None
        try:
            grad = value.is_floating_point() and value.requires_grad
            return from_torch(value, device=device, requires_grad=grad, dtype=narrow)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
    if isinstance(value, (list, tuple)):
        return type(value)(_convert_arg(v, where, type(value).__name__, device) for v in value)
    if isinstance(value, dict):
        return {k: _convert_arg(v, where, "dict", device) for k, v in value.items()}
    return value


@functools.cache
def _bridge() -> Any:
    torch = torch_module()

    class PydiffFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, fn: Any, kwargs: dict, _anchor: Any, *args: Any) -> Any:
            label = getattr(fn, "__name__", None) or repr(fn)
            dev = torch_args.home_device(fn, args, kwargs)
            inputs = [_convert_arg(a, describe(fn, k), "", dev) for k, a in enumerate(args)]
            named = {}
            for name, value in kwargs.items():
                if is_torch_tensor(value) and value.requires_grad:
                    raise ValueError(
                        f"{label} with torch tensors: keyword argument {name!r} requires grad; "
                        "torch autograd gives gradients to positional arguments only: pass it "
                        "positionally"
                    )
                named[name] = _convert_arg(value, f"keyword argument {name!r}", "", dev)
            with Tape(reads_other_tapes=True) as tape:
                result = _run(fn, inputs, named, (*args, *kwargs.values()))
            outputs = list(result) if isinstance(result, (tuple, list)) else [result]
            for k, out in enumerate(outputs):
                if out is None:
                    raise TypeError(
                        f"{label} with torch tensors returned None: it must return its results "
                        "(pydiff does not write into torch tensors, so out/inout parameters "
                        "cannot hand results back); return them, e.g. a function result"
                    )
                if not isinstance(out, Tensor):
                    raise TypeError(
                        f"{label} with torch tensors returned {type(out).__name__} (output {k}); "
                        "it must return pydiff tensors"
                    )
                outputs[k] = on_tape(out, tape, inputs, closed=True)
            # The torch inputs are saved so that torch refuses a second backward without
            # retain_graph, as for its own functions; not inference tensors (data made under
            # torch.inference_mode, which torch refuses to save: the values were copied).
            saved = [a for a in (_anchor, *args) if is_torch_tensor(a) and not a.is_inference()]
            ctx.save_for_backward(*saved)
            ctx.tape, ctx.inputs, ctx.outputs = tape, inputs, outputs
            ctx.anchored, ctx.within = _anchor is not None, running_pass()
            ctx.from_torch = [is_torch_tensor(a) for a in args]
            ctx.torch_devices = [a.device if is_torch_tensor(a) else None for a in args]
            home = next((d for d in ctx.torch_devices if d is not None), None)
            torch_out = [_handed(out, home) for out in outputs]
            # (an output no gradient reaches: nothing the call read requires one)
            ctx.mark_non_differentiable(
                *[
                    t
                    for t, o in zip(torch_out, outputs)
                    if not t.is_floating_point() or not o.requires_grad
                ]
            )
            return tuple(torch_out) if isinstance(result, (tuple, list)) else torch_out[0]

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            # Grad mode is on in a create_graph=True backward: the gradients handed back
            # would carry no graph, so a gradient penalty would silently add nothing.
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "pydiff: double backward (create_graph=True) through pydiff is not "
                    "supported: its gradients carry no torch graph"
                )
            _ = ctx.saved_tensors  # raises if this graph was freed by an earlier backward
            leaves = [
                v
                for v, torch_made in zip(ctx.inputs, ctx.from_torch)
                if torch_made and isinstance(v, Tensor) and v.requires_grad
            ]
            for leaf in leaves:  # each backward hands torch this backward's gradient only
                leaf.zero_grad()
            # torch.autograd.grad and backward(inputs=...) write no .grad but their named
            # tensors': pydiff's leaves (on ctx.tape, never named) then get fresh buffers.
            if not ctx.anchored or accumulates_leaves(ctx.next_functions[0][0]):
                # The zeroing policy acts once per torch pass, not once per pydiff node in it.
                scope: Any = torch_pass(ctx.within)
            else:
                scope = pass_without_leaves(ctx.tape, leaves)
            with scope:
                for out, grad in zip(ctx.outputs, grads):
                    if grad is not None and out.requires_grad and out.producer is ctx.tape:
                        ctx.tape.backward(out, grad=_seed(grad.detach(), out))
            result = [None, None, None]  # (fn, kwargs, the anchor)
            for value, torch_made, where in zip(ctx.inputs, ctx.from_torch, ctx.torch_devices):
                wanted = torch_made and isinstance(value, Tensor) and value.requires_grad
                result.append(_handed(value.grad, where) if wanted else None)
            return tuple(result)

    return PydiffFunction


def _handed(x: Tensor, where: Any) -> Any:
    """``x`` as a torch tensor of its own (a copy: torch autograd may keep it as a ``.grad``
    that pydiff's buffer must not alias), on the torch device ``where`` when given."""
    t = _torch_of(x)
    t = t.clone() if t.is_cuda else t
    return t if where is None or t.device == where else t.to(where)


def _seed(grad: Any, out: Tensor) -> Any:
    """torch's upstream gradient for ``out`` as the tape takes it (on the device: both CUDA)."""
    exact = str(grad.dtype).removeprefix("torch.") in FROM_TORCH
    if grad.is_cuda and out.device.type == "cuda" and exact:
        return from_torch(grad, device=out.device, requires_grad=False)
    return grad.resolve_conj().resolve_neg().cpu().numpy()


def _call_with_torch(fn: Any, args: tuple, kwargs: dict) -> Any:
    """A call of ``fn`` with torch tensors among its arguments: through torch autograd
    (``torch_function``); on an active pydiff tape (a ``pydiff.Tape``, ``pydiff.grad``...),
    torch tensors without gradients as data of an ordinary pydiff call recorded there, and
    those that require grad refused (torch autograd cannot reach through a pydiff tape). The
    same inside ``pydiff.jvp``'s trace and a transform's ``foreign.data_calls`` block, whose
    results must be pydiff tensors (before, torch ones, refused with misleading messages)."""
    autograd = active_tape() is None and forward_trace.active() is None
    foreign.refuse_result(fn, kwargs, autograd and not foreign.taking_data())
    if autograd and not foreign.taking_data():
        return torch_function(fn)(*args, **kwargs)
    label = getattr(fn, "__name__", None) or repr(fn)
    places = [(describe(fn, k), a) for k, a in enumerate(args)]
    places += [(f"keyword argument {name!r}", v) for name, v in kwargs.items()]
    for where, value in places:
        if _needs_torch_grad(value):
            raise TypeError(
                f"{label}: {where} is a torch tensor that requires grad, in a call recorded on a "
                "pydiff tape or transform (pydiff.Tape, pydiff.grad, value_and_grad, vjp, jvp, "
                "jacfwd, jacrev, hvp, gradcheck, fixed_point): torch autograd cannot see "
                "pydiff's tape, so its gradient would be lost. Either convert it "
                "with pydiff.from_torch(t, requires_grad=True) and differentiate it on the "
                "pydiff tape, or run the pydiff code outside any pydiff tape through "
                "pydiff.torch_function(fn) (torch autograd)"
            )
    home = torch_args.home_device(fn, args, kwargs)
    inputs = [_convert_arg(a, where, "", home) for where, a in places[: len(args)]]
    named = {n: _convert_arg(v, w, "", home) for (w, v), n in zip(places[len(args) :], kwargs)}
    return _run(fn, inputs, named, (*args, *kwargs.values()))


def _run(fn: Any, inputs: list, named: dict, given: tuple) -> Any:
    """``fn(*inputs, **named)``; an op's refusal of a half tensor made from a torch.float16
    argument (in ``given``) says how to cast it in torch, which keeps the autograd link."""
    try:
        return fn(*inputs, **named)
    except OpDtypeError as exc:
        if exc.dtype != "half" or not any(
            str(getattr(t, "dtype", "")) == "torch.float16" for t in given
        ):
            raise
        why = (
            f"{exc.op}: {exc.argument} is a torch.float16 tensor (dtype half here); {exc.op} "
            f"computes in float32: pass {exc.argument}.float() (the cast stays on torch's graph)"
        )
        raise OpDtypeError(why, exc.op, exc.argument, exc.dtype) from None


def _needs_torch_grad(value: Any) -> bool:
    if isinstance(value, (list, tuple, dict)):
        return any(map(_needs_torch_grad, value.values() if isinstance(value, dict) else value))
    return is_torch_tensor(value) and bool(value.requires_grad)


def _torch_classes() -> tuple:
    torch = sys.modules.get("torch")
    return (torch.Tensor,) if torch is not None else ()


foreign.register(
    _torch_classes,
    _call_with_torch,
    "torch",
    "convert the torch tensor with pydiff.from_torch(t) for a pydiff result, or the pydiff "
    "tensor with pydiff.to_torch(x) for a torch one (pydiff.torch_function(fn) runs pydiff "
    "code inside torch autograd)",
    data=lambda value, where, device=None: _convert_arg(value, where, "", device),
    needs_grad=_needs_torch_grad,
)
