"""Optimizers as fused Slang kernels (shaders/optim/): one pass updates parameter and state.

opt = pydiff.optim.AdamW([W, b], lr=1e-3)
opt.zero_grad(); tape.backward(loss); opt.step()
"""

from __future__ import annotations

from functools import partial
from operator import is_
from typing import Any, Iterable

from . import capturing
from .creation import zeros
from .device import Device
from .grad_zeroing import ZERO_GRADIENT as ZERO_GRADIENT  # (its home before grad_zeroing)
from .grad_zeroing import zero_grads
from .module import library
from .optim_checks import Hyperparameters, check_state_dict
from .optim_params import check_unchanged, checked_params
from .tensor import Tensor, float4_ready

# The fused optimizer kernels' shape (shaders/optim/*.slang): float4s per thread, and threads
# per group of the Adam/AdamW one. Measured on lavapipe (process CPU time): AdamW over 10M
# parameters 26.7 -> 22.1 ms with 4 float4s per thread instead of 1 (2: 24.0, 8: 28.3); a
# small model's 4.8K parameters alike; groups of 64-1024 threads alike.
OPTIM_CHUNK = 4  # lavapipe's; the kernels take device.kernels.chunk (1 on a GPU)
ADAM_GROUP = 256
_ADAM4 = ("optim/adamw.slang", "adamw_step4_multi")  # the four-parameter kernel
# The four-parameter Adam kernel's ratios of each slot's bias correction to slot 0's while
# their step counts agree.
_SAME_STEP = {f"{name}{slot}": 1.0 for name in ("step_ratio", "bias2_ratio") for slot in (1, 2, 3)}


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

    _buffers: tuple[str, ...] = ()  # the names of each parameter's state tensors

    def __init__(self, params: Iterable[Tensor], defaults: dict[str, Any]):
        self.params = checked_params(type(self).__name__, params)
        # (the list it was created with: opt.params is public, and changing it is refused)
        self._created_with = tuple(self.params)
        self._defaults = Hyperparameters(type(self).__name__, defaults)
        self.step_count = 0  # steps taken (step() calls and replays)
        # Each parameter's own count of the steps that updated it (torch's state['step']): a
        # step skips parameters without a gradient, and Adam's bias correction is per
        # parameter.
        self.param_steps = [0] * len(self.params)
        self.state: list[dict[str, Tensor]] = [{} for _ in self.params]
        # Each kernel dispatch site's bound object (kernels.dispatch(held=)): these buffers
        # are the optimizer's own, dispatched every step.
        self._held: dict[Any, list] = {}
        self._bindings: dict[Any, tuple] = {}  # per four-parameter site: _dispatch_four

    def __getstate__(self) -> dict[str, Any]:
        """``copy.deepcopy`` and ``pickle``: all but the kernels' bound objects (caches of
        this optimizer's buffers, made again by the next step; they cannot be copied)."""
        return {**self.__dict__, "_held": {}, "_bindings": {}}

    @property
    def defaults(self) -> Hyperparameters:
        """The hyper-parameters, read at each step and replay: a dict of fixed keys whose
        values are checked when set (``optim_checks.Hyperparameters``)."""
        return self._defaults

    @defaults.setter
    def defaults(self, values: Any) -> None:
        new = Hyperparameters(type(self).__name__, values)  # every value checked
        if set(new) != set(self._defaults):
            raise KeyError(
                f"{type(self).__name__}.defaults = {{{', '.join(map(repr, new))}}}: expected "
                f"the keys {', '.join(self._defaults)}"
            )
        self._defaults = new

    def _with_grads(self) -> list[int]:
        """The parameters this step updates: those whose gradient buffer was written (by a
        backward, the host, a copy) since it was allocated or last zeroed (``zero_grad``).
        The others are skipped, as torch.optim skips a ``.grad`` of None. A changed
        ``params`` list is refused first (``optim_params.check_unchanged``)."""
        check_unchanged(type(self).__name__, self.params, self._created_with)
        return [
            k
            for k, p in enumerate(self.params)
            if (g := p.grad) is not None and g.storage.written_since_zeroed()
        ]

    def _advance(self, updated: list[int]) -> None:
        self.step_count += 1
        for k in updated:
            self.param_steps[k] += 1

    def _on_replay(self, updated: list[int]) -> None:
        """What each replay of a captured step re-does (the step counts of the parameters the
        step updates, for bias correction) and re-checks: that the parameters, their
        gradients and the state are the tensors the capture recorded (a replaced one would
        leave the replay on the old buffers), and that no parameter the captured step skips
        (no gradient then) has one now (the replay would skip it still)."""
        if capturing.recording() is None:
            return
        capturing.on_replay(lambda: self._advance(updated))
        what = f"{type(self).__name__}.step"
        capturing.check_on_replay(what, capturing.same_objects(self._tensors(), self._tensors))
        skipped = [k for k in range(len(self.params)) if k not in set(updated)]
        if skipped:
            capturing.check_on_replay(
                what,
                lambda: self._gained_grads(skipped),
                advice="The captured step updates the parameters that had a gradient when it "
                "was captured, and only those: capture the step again (or zero that gradient).",
            )

    def _gained_grads(self, skipped: list[int]) -> str | None:
        for k in skipped:
            g = self.params[k].grad
            if g is not None and g.storage.written_since_zeroed():
                by = g.storage.holds_result_of or g.storage.last_writer
                return (
                    f"params[{k}] has a gradient (from {by}), but had none when "
                    "the step was captured, which so leaves it unchanged"
                )
        return None

    def _tensors(self) -> dict[str, Any]:
        named: dict[str, Any] = {}
        for k, p in enumerate(self.params):
            named[f"params[{k}]"] = p
            named[f"params[{k}].grad"] = p.grad
            # (a parameter appended to opt.params since has no state: the replay refuses it)
            for name, t in (self.state[k] if k < len(self.state) else {}).items():
                named[f"state[{k}][{name!r}]"] = t
        return named

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every parameter's gradient (submitted with the forward pass that follows).
        Both values zero the buffers (pydiff's gradients are never None); ``set_to_none``
        says what the next step does with a parameter no backward or write fills since:
        True (torch's default) skips it, as torch skips a ``.grad`` of None; False steps it
        with the zero gradient if it had a gradient (torch's ``.grad`` not None), as torch
        does: momentum, weight decay and Adam's moments move it, its step count grows
        (``grad_zeroing``; ``nn.Linear.zero_grad`` is the same).

        >>> opt.zero_grad(set_to_none=False)   # the next step: those with a gradient, used or not
        """
        zero_grads(self.params, set_to_none, type(self).__name__)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's class name, hyper-parameters, step count and per parameter its
        state buffers as NumPy arrays (a copy) and its own step count (``'step'``)."""
        check_unchanged(type(self).__name__, self.params, self._created_with)
        return {
            "optimizer": type(self).__name__,
            "defaults": dict(self.defaults),
            "step": self.step_count,
            "state": [
                {**{k: t.numpy().copy() for k, t in s.items()}, "step": n}
                for s, n in zip(self.state, self.param_steps)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned, or refuse (TypeError/ValueError, nothing
        changed) a dict this optimizer could not have saved (``optim_checks``). Existing
        state buffers are overwritten in place (a captured step replays on them). An older
        dict without per-parameter counts gives each parameter its ``'step'``.

        >>> opt.load_state_dict(saved)          # saved = opt.state_dict(), earlier
        """
        owner = type(self).__name__
        check_unchanged(owner, self.params, self._created_with)
        shapes = [p.expected_numpy_shape() for p in self.params]
        defaults, loaded = check_state_dict(owner, state, shapes, self.defaults, self._buffers)
        self.defaults.update(defaults)
        self.step_count = int(state["step"])
        for k, (p, saved) in enumerate(zip(self.params, loaded)):
            self.param_steps[k] = saved.pop("step")
            current = self.state[k]
            for name in [n for n in current if n not in saved]:
                del current[name]  # a fresh state: the next step creates it anew
            for name, arr in saved.items():
                if name not in current:
                    current[name] = zeros(p.shape, device=p.device)
                current[name].copy_from_numpy(arr)

    def _make_state(self) -> None:
        """Every parameter's state, made on the first step (also for parameters it skips: a
        captured step can then update any of them)."""
        names = self._buffers
        if all([name in st for st in self.state for name in names]):  # (a list: no generator)
            return  # (every later step: one pass, no call per buffer)
        for k in range(len(self.params)):
            for name in self._buffers:
                self._buffer(k, name)

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

    _buffers = ("momentum_buffer",)

    def __init__(
        self, params: Iterable[Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    def _hyper(self, k: int) -> dict:
        """Parameter ``k``'s kernel uniforms, read at each step (and at each replay of a
        captured one): its first update sets the momentum buffer to the gradient."""
        d = self.defaults
        return {
            "lr": d["lr"],
            "momentum": d["momentum"],
            "weight_decay": d["weight_decay"],
            "first": 1 if self.param_steps[k] == 0 else 0,
        }

    def step(self) -> None:
        """Update the parameters that have a gradient (see ``Optimizer._with_grads``)."""
        updated = self._with_grads()
        batch = _Batch()
        self._make_state()
        for k in updated:
            p, buf = self.params[k], self.state[k]["momentum_buffer"]
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
                    dynamic=partial(self._hyper, k),
                    held=self._held.setdefault(k, []),
                )
                p.storage.wrote("SGD.step")
                continue
            h = self._hyper(k)
            library(p.device).sgd_step(
                p.detach(), p.grad, buf, h["lr"], h["momentum"], h["weight_decay"], h["first"]
            )
        batch.submit()
        self._advance(updated)
        self._on_replay(updated)


class Adam(Optimizer):
    """Adam with bias correction; ``weight_decay`` is added to the gradient (L2), as in
    ``torch.optim.Adam``. One fused kernel updates p, m and v of up to four parameters.

    >>> opt = pydiff.optim.Adam([W, b], lr=1e-3)
    """

    _decoupled = False
    _buffers = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, hyper)

    def _hyper(self, k: int) -> dict:
        """Parameter ``k``'s kernel uniforms for its step count (bias correction, per
        parameter as in torch), read at each step and at each replay of a captured one."""
        d, t = self.defaults, self.param_steps[k]
        wd, (b1, b2) = d["weight_decay"], d["betas"]
        return {
            "decay": 1.0 - d["lr"] * wd if self._decoupled else 1.0,
            "l2": 0.0 if self._decoupled else wd,
            "one_minus_b1": 1.0 - b1,
            "beta2": b2,
            "one_minus_b2": 1.0 - b2,
            "step_size": d["lr"] / (1.0 - b1**t),
            "bias2_sqrt": (1.0 - b2**t) ** 0.5,
            "eps": d["eps"],
        }

    def _hyper_four(self, ks: tuple[int, ...]) -> dict:
        """The four-parameter kernel's uniforms: those of slot 0's parameter (``ks``: the
        slots' parameters), and for the others the ratio of their bias correction to it: 1
        while the step counts agree (the common case: no uniform changes)."""
        out = self._hyper(ks[0])
        steps = self.param_steps
        t0 = steps[ks[0]]
        if all([steps[k] == t0 for k in ks]):  # (a list: no generator frames)
            out.update(_SAME_STEP)
            return out
        b1, b2 = self.defaults["betas"]
        for slot in (1, 2, 3):
            t = steps[ks[slot]] if slot < len(ks) else t0
            # lr / (1 - b1^t) over lr / (1 - b1^t0); likewise sqrt(1 - b2^t)
            out[f"step_ratio{slot}"] = (1.0 - b1**t0) / (1.0 - b1**t)
            out[f"bias2_ratio{slot}"] = ((1.0 - b2**t) / (1.0 - b2**t0)) ** 0.5
        return out

    def step(self) -> None:
        """Update the parameters that have a gradient (see ``Optimizer._with_grads``)."""
        updated = self._with_grads()
        self._advance(updated)
        self._on_replay(updated)
        batch = _Batch()
        fast: dict[int, list] = {}  # per device: (k, p, m, v) for the four-parameter kernel
        # The pending work (a backward's kernels) is submitted first, to run while this step
        # records: a step that is waited for at once measured 3-10% faster (lavapipe; one
        # submission more: docs/benchmarks-history.md, training loop).
        for dev in {id(p.device): p.device for p in self.params}.values():
            dev.queue.flush_deferred()
        self._make_state()
        for k in updated:
            p, m, v = self.params[k], self.state[k]["exp_avg"], self.state[k]["exp_avg_sq"]
            if float4_ready(p, p.grad, m, v):
                fast.setdefault(id(p.device), []).append((k, p, m, v))
                continue
            h = self._hyper(k)
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
        dev = slots[0][1].device
        kernels = dev.kernels
        chunk = kernels.chunk
        # The bound buffers: (p, grad, m, v) of each slot (unused slots repeat the last one,
        # with an empty range). A step that binds the very buffers of the site's last one
        # reuses its binding lists (the names, ranges and order follow from the buffers), and
        # its kernel while the cache still holds it (``touch``: else built or found anew).
        bufs = []
        for k in range(4):
            _, p, m, v = slots[min(k, len(slots) - 1)]
            bufs += (p.buffer, p.grad.buffer, m.buffer, v.buffer)
        key = (id(dev), site)
        made = self._bindings.get(key)
        if made is None or made[0] != (chunk, len(slots)) or not _same(made[1], bufs):
            made = None
        if made is None or not kernels.touch(made[5]):
            found = kernels.get_keyed(_ADAM4[0], _ADAM4[1], CHUNK=chunk, TG=ADAM_GROUP)
            made = ((chunk, len(slots)), bufs, *_four_bindings(slots, bufs, chunk), *found)
            self._bindings[key] = made
        _, _, buffers, fixed, end, _, kernel = made
        writer = f"{type(self).__name__}.step"
        for slot in slots:
            slot[1].storage.wrote(writer)
        batch.join(slots[0][1])
        ks = tuple([slot[0] for slot in slots])
        scalars = fixed + list(self._hyper_four(ks).items())  # (as dispatch(dynamic=) binds)
        # A capture re-reads the uniforms at each replay (``dynamic``): only made for one.
        hyper = None if capturing.recording() is None else partial(self._hyper_four, ks)
        held = self._held.setdefault(key, [])
        kernels.dispatch_split(kernel, end, buffers, scalars, dynamic=hyper, held=held)


def _same(kept: list, bufs: list) -> bool:
    """``bufs`` are exactly the buffer objects ``kept``, in order."""
    return len(kept) == len(bufs) and all(map(is_, kept, bufs))  # (no generator frames)


def _four_bindings(slots: list, bufs: list, chunk: int) -> tuple[list, list, int]:
    """The four-parameter kernel's ``(name, buffer)`` and ``(name, range)`` bindings for
    ``slots`` (``bufs``: each slot's p, grad, m, v buffers) and its thread count."""
    buffers, fixed, end = [], [], 0
    for k in range(4):
        p, g, m, v = bufs[4 * k : 4 * k + 4]
        count = -(-slots[min(k, len(slots) - 1)][1].numel // 4)  # float4s
        if k < len(slots):
            end += -(-count // chunk)
        names = (f"p{k}", f"p{k}_in", f"g{k}", f"m{k}", f"m{k}_in", f"v{k}", f"v{k}_in")
        buffers += zip(names, (p, p, g, m, m, v, v))
        fixed += [(f"end{k}", end), (f"count{k}", count)]
    return buffers, fixed, end


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
