"""Just enough of a layer library for the samples: a Linear layer holding W and b.

layer = pydiff.nn.Linear(64, 10)
y = layer(x)                       # x @ W.T + b
opt = pydiff.optim.AdamW(layer.parameters())
layer.zero_grad()                  # as opt.zero_grad(): before the next backward
"""

from __future__ import annotations

import numpy as np

from . import capturing, ops
from .device import Device, resolve_device
from .creation import tensor
from .grad_zeroing import zero_grads
from .tensor import Tensor


class Linear:
    """y = x W^T + b, W of shape (out, in); PyTorch's default init U(-1/sqrt(in), 1/sqrt(in)).
    ``activation="relu"`` applies relu in the same kernels (see ``ops.linear``).

    >>> layer = pydiff.nn.Linear(4, 3, seed=0)
    >>> layer(x).shape        # x of shape (batch, 4) -> (batch, 3)
    >>> hidden = pydiff.nn.Linear(4, 16, activation="relu")
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Device | str | None = None,
        seed: int | None = None,
        activation: str | None = None,
    ):
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
                raise TypeError(
                    f"Linear: {name}={n!r} is a {type(n).__name__}; pass a whole number (int)"
                )
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"Linear: in_features={in_features}, out_features={out_features} must be positive"
            )
        if activation not in ops.ACTIVATIONS:
            raise ValueError(
                f"Linear: activation={activation!r}; expected one of {ops.ACTIVATIONS}"
            )
        self.activation = activation
        dev = resolve_device(device)
        try:
            rng = np.random.default_rng(seed)
        except (TypeError, ValueError) as e:
            raise type(e)(
                f"Linear: seed={seed!r}: pass None (fresh randomness) or an int >= 0 ({e})"
            ) from None
        bound = 1.0 / np.sqrt(in_features)
        self.weight = tensor(
            rng.uniform(-bound, bound, (out_features, in_features)), device=dev, requires_grad=True
        )
        self.bias = (
            tensor(rng.uniform(-bound, bound, out_features), device=dev, requires_grad=True)
            if bias
            else None
        )

    def __call__(self, x: Tensor) -> Tensor:
        if capturing.recording() is not None:  # a replay must not run on a replaced W or b
            capturing.check_on_replay(
                f"nn.Linear({self.weight.shape[1]}, {self.weight.shape[0]})",
                capturing.same_objects(self._tensors(), self._tensors),
            )
        return ops.linear(x, self.weight, self.bias, self.activation)

    def _tensors(self) -> dict:
        return {"weight": self.weight, "bias": self.bias, "activation": self.activation}

    def parameters(self) -> list[Tensor]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients of ``weight`` and ``bias``, exactly as an optimizer's
        ``zero_grad`` over them (``grad_zeroing``): both values zero the buffers (pydiff's
        gradients are never None); with ``set_to_none=True`` (torch's default) the next
        optimizer step skips a parameter nothing writes a gradient for before it, with
        False a parameter that had a gradient keeps a zero one, which the step applies
        (momentum, weight decay, moments), as torch's ``Module.zero_grad``.

        >>> layer.zero_grad()          # then tape.backward(loss): this step's gradient alone
        """
        zero_grads(self.parameters(), set_to_none, "Linear")
