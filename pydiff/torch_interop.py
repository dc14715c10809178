"""PyTorch interop: tensors both ways, and pydiff code inside torch autograd.

On Vulkan (lavapipe) a torch CPU tensor and a pydiff tensor cannot share memory (SlangPy's
own torch bridge needs CUDA: docs/interop.md), so values cross through NumPy, one copy each
way; round trips are bit-exact. torch is imported only when one of these is used.

    x = pydiff.from_torch(torch.randn(4), requires_grad=True)
    t = pydiff.to_torch(x)                              # a torch.Tensor with x's values
    layer = pydiff.torch_function(m.my_layer)           # callable of torch tensors, autograd
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import numpy as np

from . import foreign
from .creation import tensor as make_tensor
from .device import Device
from .grad_transforms import on_tape
from .tape import Tape
from .tensor import Tensor

#: torch dtype name -> pydiff dtype, for the dtypes that convert exactly.
_FROM_TORCH = {"float32": "float", "float16": "half", "int32": "int", "uint32": "uint"}
#: pydiff scalar type -> torch dtype name.
_TO_TORCH = {"float": "float32", "half": "float16", "int": "int32", "uint": "uint32"}
#: torch dtypes converted only when asked for by ``dtype=`` (a narrowing copy).
_ON_REQUEST = {"float64": ("float", np.float32), "int64": ("int", np.int32)}


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(
            "pydiff's PyTorch interop needs torch: pip install 'pydiff[torch]' (or any torch)"
        ) from None
    return torch


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch.Tensor (False without importing torch when it is not
    loaded: nothing could be one then)."""
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
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch: t must be a torch.Tensor, not {type(t).__name__}")
    name = str(t.dtype).removeprefix("torch.")
    if t.numel() == 0:
        raise ValueError(
            f"from_torch: t has shape {tuple(t.shape)}: no elements (a pydiff tensor has one "
            "at least)"
        )
    if name in _FROM_TORCH and dtype in (None, _FROM_TORCH[name]):
        target = _FROM_TORCH[name]
        arr = t.detach().cpu().contiguous().numpy()
    elif name in _ON_REQUEST and dtype == _ON_REQUEST[name][0]:
        target, np_type = _ON_REQUEST[name]
        arr = t.detach().cpu().contiguous().numpy()
        if np_type is np.int32 and arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
            raise ValueError(
                f"from_torch: int64 values from {arr.min()} to {arr.max()} do not fit dtype 'int'"
            )
        narrowed = arr.astype(np_type)
        if np_type is np.float32 and np.any(np.isinf(narrowed) & np.isfinite(arr)):
            raise ValueError(
                f"from_torch: float64 values up to {np.abs(arr[np.isfinite(arr)]).max():.3g} "
                "overflow dtype 'float' (largest 3.4e38)"
            )
        arr = narrowed
    else:
        accepted = ", ".join(f"torch.{n}" for n in _FROM_TORCH)
        asked = f" as dtype={dtype!r}" if dtype is not None else ""
        hint = (
            f'; pass dtype="{_ON_REQUEST[name][0]}" for a narrowing copy'
            if name in _ON_REQUEST and dtype is None
            else ""
        )
        raise TypeError(
            f"from_torch: a tensor of dtype torch.{name} cannot be converted{asked} (accepted: "
            f"{accepted}; torch.float64 and torch.int64 with dtype=){hint}"
        )
    wants_grad = t.requires_grad if requires_grad is None else requires_grad
    if wants_grad and target not in ("float", "half"):
        raise ValueError(f"from_torch: requires_grad=True needs a floating dtype, not {target!r}")
    return make_tensor(arr, dtype=target, device=device, requires_grad=bool(wants_grad))


def to_torch(x: Tensor) -> Any:
    """A torch CPU tensor with the values, shape and dtype of ``x`` (a copy; vector dtypes
    such as float3 keep their components as a last axis). It has no autograd link to ``x``:
    use ``torch_function`` for that.

    >>> t = pydiff.to_torch(pydiff.tensor([1.0, 2.0]))      # tensor([1., 2.])
    >>> g = pydiff.to_torch(x.grad)
    """
    torch = _torch()
    if not isinstance(x, Tensor):
        raise TypeError(f"to_torch: x must be a pydiff.Tensor, not {type(x).__name__}")
    if x.scalar_type not in _TO_TORCH:
        raise TypeError(
            f"to_torch: a tensor of dtype {x.dtype!r} has no torch dtype (accepted scalar types: "
            f"{', '.join(_TO_TORCH)})"
        )
    return torch.from_numpy(np.ascontiguousarray(x.numpy()))


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
        return _bridge().apply(fn, kwargs, *args)

    return call


def _describe(fn: Any, k: int) -> str:
    params = getattr(getattr(fn, "signature", None), "params", None)
    if params is not None and k < len(params):
        return f"argument {k} (parameter {params[k].name!r})"
    return f"argument {k}"


def _convert_arg(value: Any, where: str, nested: bool = False) -> Any:
    """A torch tensor argument as a pydiff tensor (int64 narrowed where it fits: torch's
    labels), and torch tensors inside lists, tuples and dicts (they cannot need gradients)."""
    if is_torch_tensor(value):
        if nested and value.requires_grad:
            raise ValueError(
                f"{where} holds a torch tensor that requires grad inside a "
                f"{type(value).__name__}: torch autograd reaches direct positional arguments "
                "only; pass it as one"
            )
        name = str(value.dtype).removeprefix("torch.")
        if name == "float64":
            raise TypeError(
                f"{where} is a torch.float64 tensor; pydiff computes in float32: pass t.float()"
            )
        narrow = "int" if name == "int64" else None
        try:
            return from_torch(
                value, requires_grad=value.is_floating_point() and value.requires_grad, dtype=narrow
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
    if isinstance(value, (list, tuple)):
        return type(value)(_convert_arg(v, where, True) for v in value)
    if isinstance(value, dict):
        return {k: _convert_arg(v, where, True) for k, v in value.items()}
    return value


@functools.cache
def _bridge() -> Any:
    torch = _torch()

    class PydiffFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, fn: Any, kwargs: dict, *args: Any) -> Any:
            label = getattr(fn, "__name__", None) or repr(fn)
            inputs = [_convert_arg(a, _describe(fn, k)) for k, a in enumerate(args)]
            named = {}
            for name, value in kwargs.items():
                if is_torch_tensor(value) and value.requires_grad:
                    raise ValueError(
                        f"{label} with torch tensors: keyword argument {name!r} requires grad; "
                        "torch autograd gives gradients to positional arguments only: pass it "
                        "positionally"
                    )
                named[name] = _convert_arg(value, f"keyword argument {name!r}")
            with Tape() as tape:
                result = fn(*inputs, **named)
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
                outputs[k] = on_tape(out, tape, inputs)
            # The torch inputs are saved so that torch refuses a second backward without
            # retain_graph, as for its own functions.
            ctx.save_for_backward(*[a for a in args if is_torch_tensor(a)])
            ctx.tape, ctx.inputs, ctx.outputs = tape, inputs, outputs
            ctx.from_torch = [is_torch_tensor(a) for a in args]
            torch_out = [to_torch(out) for out in outputs]
            ctx.mark_non_differentiable(*[t for t in torch_out if not t.is_floating_point()])
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
            for out, grad in zip(ctx.outputs, grads):
                if grad is not None and out.requires_grad and out.producer is ctx.tape:
                    ctx.tape.backward(out, grad=grad.detach().cpu().numpy())
            result = [None, None]
            for value, torch_made in zip(ctx.inputs, ctx.from_torch):
                wanted = torch_made and isinstance(value, Tensor) and value.requires_grad
                result.append(to_torch(value.grad) if wanted else None)
            return tuple(result)

    return PydiffFunction


def _call_with_torch(fn: Any, args: tuple, kwargs: dict) -> Any:
    return torch_function(fn)(*args, **kwargs)


def _torch_classes() -> tuple:
    torch = sys.modules.get("torch")
    return (torch.Tensor,) if torch is not None else ()


foreign.register(_torch_classes, _call_with_torch)
