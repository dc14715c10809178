"""Optimizers as fused Slang kernels (shaders/optim/): one pass updates parameter and state.

opt = pydiff.optim.AdamW([W, b], lr=1e-3)
opt.zero_grad(); tape.backward(loss); opt.step()
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from . import capturing
from .creation import zeros
from .device import Device
from .module import library
from .tensor import Tensor, float4_ready

# The fused optimizer kernels' shape (shaders/optim/*.slang): float4s per thread, and threads
# per group of the Adam/AdamW one. Measured on lavapipe (process CPU time): AdamW over 10M
# parameters 26.7 -> 22.1 ms with 4 float4s per thread instead of 1 (2: 24.0, 8: 28.3); a
# small model's 4.8K parameters alike; groups of 64-1024 threads alike.
OPTIM_CHUNK = 4  # lavapipe's; the kernels take device.kernels.chunk (1 on a GPU)
ADAM_GROUP = 256


class _Batch:
    """The devices of one step's kernels, each submitted once at the end (the kernels wait in
    the device's deferred list, or in the batch of a backward this runs inside): one
    submission per device instead of one per parameter, with the forward pass's kernels."""

    def __init__(self) -> None:
        self._open: dict[int, Device] = {}

    def join(self, p: Tensor) -> None:
        self._open.setdefault(id(p.device), p.device)

    def submit(self) -> None:
        for dev in self._open.values():
            dev.flush()  # the step's work runs now (a later device wait sees it done)
        self._open.clear()


class Optimizer:
    """Base class: holds parameters (tensors with gradients) and per-parameter state."""

    def __init__(self, params: Iterable[Tensor], defaults: dict[str, Any]):
        self.params = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__}: params is empty")
        for k, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise TypeError(
                    f"{type(self).__name__}: params[{k}] is a {type(p).__name__}, not a "
                    "pydiff.Tensor"
                )
            if not p.requires_grad or p.dtype != "float":
                raise ValueError(
                    f"{type(self).__name__}: params[{k}] must be a float tensor with "
                    "requires_grad=True"
                )
        seen: dict[int, int] = {}  # storage -> index: one buffer twice would step twice
        for k, p in enumerate(self.params):
            j = seen.setdefault(id(p.storage), k)
            if j != k:
                raise ValueError(
                    f"{type(self).__name__}: params[{j}] and params[{k}] are the same tensor "
                    "(or views of one); list each parameter once"
                )
        for key, value in defaults.items():
            if isinstance(value, float) and value < 0:
                raise ValueError(f"{type(self).__name__}: {key}={value} must be >= 0")
        self.defaults = dict(defaults)
        self.step_count = 0
        self.state: list[dict[str, Tensor]] = [{} for _ in self.params]
        # Each kernel dispatch site's bound object (kernels.dispatch(held=)): these buffers
        # are the optimizer's own, dispatched every step.
        self._held: dict[Any, list] = {}

    def _advance(self) -> None:
        self.step_count += 1

    def _on_replay(self) -> None:
        """What each replay of a captured step re-does (the step count, for bias correction)
        and re-checks: that the parameters, their gradients and the state are the tensors
        the capture recorded (a replaced one would leave the replay on the old buffers)."""
        if capturing.recording() is None:
            return
        capturing.on_replay(self._advance)
        capturing.check_on_replay(
            f"{type(self).__name__}.step",
            capturing.same_objects(self._tensors(), self._tensors),
        )

    def _tensors(self) -> dict[str, Any]:
        named: dict[str, Any] = {}
        for k, p in enumerate(self.params):
            named[f"params[{k}]"] = p
            named[f"params[{k}].grad"] = p.grad
            for name, t in self.state[k].items():
                named[f"state[{k}][{name!r}]"] = t
        return named

    def zero_grad(self) -> None:
        """Zero every parameter's gradient (in order with the device's pending work: the
        zeroing is submitted with the forward pass that follows)."""
        for p in self.params:
            p.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters, step count and state buffers as NumPy arrays (a copy)."""
        return {
            "defaults": dict(self.defaults),
            "step": self.step_count,
            "state": [{k: t.numpy().copy() for k, t in s.items()} for s in self.state],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned (shapes are checked first). State buffers that
        exist are overwritten in place, so a captured step replays on the loaded state."""
        if len(state["state"]) != len(self.params):
            raise ValueError(
                f"load_state_dict: {len(state['state'])} parameter states for {len(self.params)} "
                "parameters"
            )
        for k, (p, saved) in enumerate(zip(self.params, state["state"])):
            for name, arr in saved.items():
                if np.shape(arr) != p.expected_numpy_shape():
                    raise ValueError(
                        f"load_state_dict: state '{name}' of param {k} has shape "
                        f"{np.shape(arr)}, param {p.shape}"
                    )
        self.defaults.update(state["defaults"])
        self.step_count = int(state["step"])
        for k, (p, saved) in enumerate(zip(self.params, state["state"])):
            current = self.state[k]
            for name in [n for n in current if n not in saved]:
                del current[name]  # a fresh state: the next step creates it anew
            for name, arr in saved.items():
                if name not in current:
                    current[name] = zeros(p.shape, device=p.device)
                current[name].copy_from_numpy(arr)

    def _buffer(self, k: int, name: str) -> Tensor:
        if name not in self.state[k]:
            capturing.refuse(
                f"{type(self).__name__} creating its state on its first step (run one "
                "step before capturing)"
            )
            p = self.params[k]
            self.state[k][name] = zeros(p.shape, device=p.device)
        return self.state[k][name]


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum and weight decay (PyTorch's rule).

    >>> opt = pydiff.optim.SGD([W], lr=0.1, momentum=0.9)
    >>> opt.step()
    """

    def __init__(
        self, params: Iterable[Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ):
        super().__init__(
            params,
            {"lr": float(lr), "momentum": float(momentum), "weight_decay": float(weight_decay)},
        )

    def _hyper(self) -> dict:
        """The kernel's uniforms, read at each step (and at each replay of a captured one)."""
        d = self.defaults
        return {
            "lr": d["lr"],
            "momentum": d["momentum"],
            "weight_decay": d["weight_decay"],
            "first": 1 if self.step_count == 0 else 0,
        }

    def step(self) -> None:
        d = self.defaults
        first = 1 if self.step_count == 0 else 0
        batch = _Batch()
        for k, p in enumerate(self.params):
            buf = self._buffer(k, "momentum_buffer")
            if float4_ready(p, p.grad, buf):
                batch.join(p)
                chunk = p.device.kernels.chunk
                kernel = p.device.kernels.get("optim/sgd.slang", "sgd_step4", CHUNK=chunk)
                count = -(-p.numel // 4)
                p.device.kernels.dispatch(
                    kernel,
                    -(-count // chunk),
                    p=p.buffer,
                    p_in=p.buffer,
                    grad=p.grad.buffer,
                    buf=buf.buffer,
                    buf_in=buf.buffer,
                    count=count,
                    dynamic=self._hyper,
                    held=self._held.setdefault(k, []),
                )
                p.storage.wrote("SGD.step")
                continue
            library(p.device).sgd_step(
                p.detach(), p.grad, buf, d["lr"], d["momentum"], d["weight_decay"], first
            )
        batch.submit()
        self._advance()
        self._on_replay()


class Adam(Optimizer):
    """Adam with bias correction; ``weight_decay`` is added to the gradient (L2), as in
    ``torch.optim.Adam``. One fused kernel updates p, m and v of up to four parameters.

    >>> opt = pydiff.optim.Adam([W, b], lr=1e-3)
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{type(self).__name__}: betas={betas} must lie in [0, 1)")
        super().__init__(
            params,
            {
                "lr": float(lr),
                "beta1": float(b1),
                "beta2": float(b2),
                "eps": float(eps),
                "weight_decay": float(weight_decay),
            },
        )

    def _hyper(self) -> dict:
        """The kernel's uniforms for the current step count (bias correction), read at each
        step and at each replay of a captured one."""
        d, t = self.defaults, self.step_count
        wd = d["weight_decay"]
        return {
            "decay": 1.0 - d["lr"] * wd if self._decoupled else 1.0,
            "l2": 0.0 if self._decoupled else wd,
            "one_minus_b1": 1.0 - d["beta1"],
            "beta2": d["beta2"],
            "one_minus_b2": 1.0 - d["beta2"],
            "step_size": d["lr"] / (1.0 - d["beta1"] ** t),
            "bias2_sqrt": (1.0 - d["beta2"] ** t) ** 0.5,
            "eps": d["eps"],
        }

    def step(self) -> None:
        self._advance()
        self._on_replay()
        h = self._hyper()
        batch = _Batch()
        fast: dict[int, list] = {}  # per device: (p, m, v) for the four-parameter kernel
        # The pending work (a backward's kernels) is submitted first, to run while this step
        # records: a step that is waited for at once measured 3-10% faster (lavapipe; one
        # submission more: docs/benchmarks.md, training loop).
        for dev in {id(p.device): p.device for p in self.params}.values():
            dev.queue.flush_deferred()
        for k, p in enumerate(self.params):
            m, v = self._buffer(k, "exp_avg"), self._buffer(k, "exp_avg_sq")
            if float4_ready(p, p.grad, m, v):
                fast.setdefault(id(p.device), []).append((p, m, v))
                continue
            library(p.device).adamw_step(
                p.detach(),
                p.grad,
                m,
                v,
                h["decay"],
                h["l2"],
                h["one_minus_b1"],
                h["beta2"],
                h["one_minus_b2"],
                h["step_size"],
                h["bias2_sqrt"],
                h["eps"],
            )
        for group in fast.values():
            for first in range(0, len(group), 4):
                self._dispatch_four(group[first : first + 4], batch, first)
        batch.submit()

    def _dispatch_four(self, slots: list, batch: _Batch, site: int) -> None:
        """One kernel updating up to four parameters (threads split by float4 ranges)."""
        bindings, end = {}, 0
        chunk = slots[0][0].device.kernels.chunk
        for k in range(4):
            p, m, v = slots[min(k, len(slots) - 1)]
            count = -(-p.numel // 4)  # float4s
            if k < len(slots):
                end += -(-count // chunk)
                p.storage.wrote(f"{type(self).__name__}.step")
            bindings.update(
                {
                    f"p{k}": p.buffer,
                    f"p{k}_in": p.buffer,
                    f"g{k}": p.grad.buffer,
                    f"m{k}": m.buffer,
                    f"m{k}_in": m.buffer,
                    f"v{k}": v.buffer,
                    f"v{k}_in": v.buffer,
                    f"end{k}": end,
                    f"count{k}": count,
                }
            )
        dev = slots[0][0].device
        batch.join(slots[0][0])
        kernel = dev.kernels.get(
            "optim/adamw.slang", "adamw_step4_multi", CHUNK=chunk, TG=ADAM_GROUP
        )
        held = self._held.setdefault((id(dev), site), [])
        dev.kernels.dispatch(kernel, end, dynamic=self._hyper, held=held, **bindings)


class AdamW(Adam):
    """Adam with decoupled weight decay and bias correction (``torch.optim.AdamW``'s rule).

    >>> opt = pydiff.optim.AdamW([W, b], lr=1e-3, weight_decay=0.01)
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(params, lr, betas, eps, weight_decay)
