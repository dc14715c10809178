"""What the optimizers check: their hyper-parameters (``Hyperparameters``, the mapping behind
``opt.defaults``, validated whenever a value is set) and a state dict before it is loaded.

    opt.defaults["lr"] = 1e-4            # checked here, as the constructor's values are
    opt.defaults["betas"] = (0.8, 0.99)  # Adam/AdamW: the constructor's (and torch's) key
    opt.defaults["lrr"] = 1.0            # KeyError: AdamW.defaults has no key 'lrr' ...
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .ops_args import FLOAT32_MAX
from .tensor import Tensor

# Each hyper-parameter's rule, as torch.optim checks it (its NaN slips through `not 0 <= x`
# only where torch's does not: every value here must be finite as well).
_RULES = {
    "lr": "a finite number >= 0",
    "momentum": "a finite number >= 0",
    "weight_decay": "a finite number >= 0",
    "eps": "a finite number >= 0",
    "betas": "a pair (beta1, beta2) of numbers in [0, 1)",
}


def _host_values(value: Any) -> np.ndarray | None:
    """The values of an array or tensor (NumPy, pydiff, torch) as a NumPy array, read once
    (a device tensor's through a read-back); None for anything else."""
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    if isinstance(value, Tensor):
        return value.numpy()
    torch = sys.modules.get("torch")  # (never imported here: a torch tensor implies it)
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return None


def _number(owner: str, key: str, value: Any) -> float:
    """``value`` as a float, or a TypeError naming ``owner`` and ``key``: a real number, a
    0-d NumPy array or scalar, or a pydiff or torch tensor of one element (torch.optim takes
    a tensor lr of one element, any shape), its value read once, now; a bool, a string,
    None, a sequence or a tensor of other sizes is none."""
    values = _host_values(value)
    expected = f"expected {_RULES[key]}"
    if values is not None:
        one = values.ndim == 0 if isinstance(value, (np.ndarray, np.generic)) else values.size == 1
        if not one:
            raise TypeError(
                f"{owner}: {key}={value!r} is a {type(value).__name__} of shape "
                f"{values.shape}; {expected} (a 0-d array, or a tensor of one element)"
            )
        if values.dtype.kind not in "iuf":  # bool, complex, strings, objects
            raise TypeError(f"{owner}: {key}={value!r} holds {values.dtype} values; {expected}")
        return float(values.reshape(()))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {key}={value!r} is a {type(value).__name__}; {expected}")
    return float(value)


def check_hyper(owner: str, key: str, value: Any) -> Any:
    """The value stored for hyper-parameter ``key`` (a float; ``betas`` a tuple of two), or a
    TypeError/ValueError naming ``owner`` (e.g. ``"AdamW"``), the key and the rule."""
    if key == "betas":
        values = _host_values(value)
        if values is not None and values.ndim == 1:  # betas=torch.tensor([0.9, 0.999])
            value = tuple(values)
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, np.ndarray)):
            raise TypeError(f"{owner}: betas={value!r}; expected {_RULES[key]}")
        if len(value) != 2:
            raise ValueError(f"{owner}: betas={value!r}; expected {_RULES[key]}")
        pair = tuple(_number(owner, key, b) for b in value)
        if not all(0.0 <= b < 1.0 for b in pair):  # (NaN fails too)
            raise ValueError(f"{owner}: betas={value!r}; expected {_RULES[key]}")
        return pair
    number = _number(owner, key, value)
    if not (math.isfinite(number) and number >= 0.0):
        raise ValueError(f"{owner}: {key}={value!r}; expected {_RULES[key]}")
    if number > FLOAT32_MAX:  # the step kernels take it as a float32: inf, and p with it
        raise ValueError(
            f"{owner}: {key}={value!r} is beyond the largest float32 ({FLOAT32_MAX:.8g}); the "
            "step computes in float32, where it would be inf: give a smaller value"
        )
    return number


class Hyperparameters(dict):
    """``opt.defaults``: a dict of the optimizer's hyper-parameters whose keys are fixed (a
    misspelled key is a KeyError naming the keys it has) and whose values are checked when
    set (``check_hyper``), so that a step (or a captured step's replay, which re-reads them)
    never meets a value its kernel cannot take."""

    def __init__(self, owner: str, values: Mapping[str, Any]):
        super().__init__()
        self.owner = owner
        for key, value in values.items():
            super().__setitem__(key, check_hyper(owner, key, value))

    def _key(self, key: Any) -> Any:
        if key not in self:
            hint = " (Adam's betas are one key: betas=(beta1, beta2))" if key in _BETAS else ""
            raise KeyError(
                f"{self.owner}.defaults has no key {key!r}{hint}; its keys: {', '.join(self)}"
            )
        return key

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(self._key(key), check_hyper(f"{self.owner}.defaults", key, value))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        new = dict(*args, **kwargs)
        where = f"{self.owner}.defaults"
        checked = {self._key(k): check_hyper(where, k, v) for k, v in new.items()}
        super().update(checked)  # all or nothing: every value was checked first

    def __ior__(self, other: Any) -> "Hyperparameters":  # type: ignore[override]
        self.update(other)
        return self

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self[self._key(key)]

    def _fixed(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.owner}.defaults: its keys are fixed; set a value instead")

    __delitem__ = pop = popitem = clear = _fixed  # type: ignore[assignment]

    def __reduce__(self) -> Any:  # a copy or pickle is a plain dict of the values
        return (dict, (dict(self),))


_BETAS = ("beta1", "beta2")


#: The keys of a pydiff ``state_dict()``: any other key is from something else.
STATE_DICT_KEYS = ("optimizer", "defaults", "step", "state")
#: State buffers no step makes negative (a sum of squares): a negative one is no saved state.
_NON_NEGATIVE = ("exp_avg_sq",)


def check_state_dict(
    owner: str,
    state: Any,
    shapes: Sequence[tuple[int, ...]],
    defaults: Hyperparameters,
    buffers: Iterable[str],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``state`` (a pydiff ``state_dict()``) checked for ``owner``, an optimizer whose
    parameters' NumPy shapes are ``shapes`` and whose state buffers are named ``buffers``:
    its hyper-parameters, and per parameter its step count (``'step'``, the optimizer's
    where an older dict has none) and its buffers as float32 arrays, ready to load. Else a
    TypeError/ValueError saying what the dict lacks or holds that this optimizer could not
    have saved: another class, other keys, another number of parameters or shapes, a
    parameter stepped more often than the optimizer, part of a parameter's buffers. Nothing
    is changed: the caller loads what this returns, which cannot fail half-way."""
    where = f"{owner}.load_state_dict"
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{where}: expected a dict from {owner}.state_dict(), not a {type(state).__name__}"
        )
    missing = [k for k in ("defaults", "step", "state") if k not in state]
    if missing:
        what = " (it is torch.optim's: it has 'param_groups')" if "param_groups" in state else ""
        raise ValueError(
            f"{where}: not a state dict of pydiff's {owner}{what}: it lacks "
            f"{', '.join(repr(k) for k in missing)} (expected the keys of {owner}.state_dict(): "
            "'optimizer', 'defaults', 'step', 'state')"
        )
    extra = [k for k in state if k not in STATE_DICT_KEYS]
    if extra:
        raise ValueError(
            f"{where}: the state dict holds {', '.join(map(repr, extra))}, which "
            f"{owner}.state_dict() never saves (its keys: "
            f"{', '.join(map(repr, STATE_DICT_KEYS))}): not a state dict of pydiff's {owner}"
        )
    saved_by = state.get("optimizer", owner)  # (dicts saved before the name was recorded)
    if saved_by != owner:
        raise ValueError(
            f"{where}: the state dict was saved by {saved_by}, not {owner}: their state and "
            "hyper-parameters differ; load it into the optimizer class it was saved from"
        )
    saved = state["defaults"]
    if not isinstance(saved, Mapping):
        raise ValueError(f"{where}: state['defaults'] is a {type(saved).__name__}, not a dict")
    saved = dict(saved)
    if "beta1" in saved and "beta2" in saved and "betas" not in saved:  # older pydiff's
        saved["betas"] = (saved.pop("beta1"), saved.pop("beta2"))
    if set(saved) != set(defaults):
        raise ValueError(
            f"{where}: the state dict's hyper-parameters ({', '.join(saved)}) are not "
            f"{owner}'s ({', '.join(defaults)}): not a state dict of {owner}"
        )
    checked = {k: check_hyper(f"{where}: defaults", k, v) for k, v in saved.items()}
    total = _count(where, "step", state["step"])
    entries = _entries(where, owner, state["state"], len(shapes))
    known = tuple(buffers)
    loaded = []
    for k, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: state[{k}] is a {type(entry).__name__}, not a dict")
        for name in entry:
            if name != "step" and name not in known:
                raise ValueError(
                    f"{where}: state[{k}] holds {name!r}, which {owner} has not (its state: "
                    f"{', '.join(sorted(known))}, step): not a state dict of {owner}"
                )
        steps = _count(where, f"state[{k}]['step']", entry.get("step", total))
        if steps > total:
            raise ValueError(
                f"{where}: state[{k}]['step']={steps}, more than the optimizer's "
                f"'step'={total}: a parameter is updated at most once per step"
            )
        held = [name for name in known if name in entry]
        if held and len(held) != len(known):
            raise ValueError(
                f"{where}: state[{k}] holds {', '.join(map(repr, held))} without "
                f"{', '.join(repr(n) for n in known if n not in held)}: {owner} makes all its "
                "state buffers together (or none, before its first step)"
            )
        if steps and not held:
            raise ValueError(
                f"{where}: state[{k}] has 'step'={steps} but no state buffers "
                f"({', '.join(known)}): {owner} makes them on its first step"
            )
        arrays = {name: _buffer(where, k, name, entry[name], shapes[k]) for name in held}
        loaded.append({"step": steps, **arrays})
    return checked, loaded


def _entries(where: str, owner: str, entries: Any, n_params: int) -> Sequence[Any]:
    """``state['state']``, a list of one dict per parameter, checked to have ``n_params``."""
    if isinstance(entries, Mapping):  # torch.optim's layout, keyed by parameter index
        keys = list(entries)
        beyond = [i for i in keys if not (isinstance(i, int) and 0 <= i < n_params)]
        unknown = f" ({beyond[:8]}: no index of its {n_params} parameters)" if beyond else ""
        raise ValueError(
            f"{where}: state['state'] is a dict keyed by {keys[:8]}{unknown}, torch.optim's "
            f"layout; expected a list of {n_params} per-parameter dicts, as {owner}.state_dict() "
            "saves"
        )
    if not isinstance(entries, (list, tuple)):
        raise ValueError(
            f"{where}: state['state'] is a {type(entries).__name__}; expected a list of "
            f"{n_params} per-parameter dicts"
        )
    if len(entries) != n_params:
        raise ValueError(
            f"{where}: state['state'] has {len(entries)} per-parameter entries (saved by an "
            f"optimizer of {len(entries)} parameters), {owner} here has {n_params}: load it "
            "into an optimizer over the same parameters, in the same order"
        )
    return entries


def _buffer(where: str, k: int, name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """State buffer ``name`` of parameter ``k`` as a float32 array of ``shape``, checked."""
    arr = _host_values(value)
    if arr is None:
        try:
            arr = np.asarray(value)
        except ValueError:  # a ragged list
            arr = np.asarray(None)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{where}: state[{k}][{name!r}] holds {arr.dtype} values; expected floats")
    if arr.shape != tuple(shape):
        raise ValueError(
            f"{where}: state[{k}][{name!r}] of param {k} has shape {arr.shape}; param {k} "
            f"has {tuple(shape)}"
        )
    if name in _NON_NEGATIVE and bool(np.any(arr < 0)):
        raise ValueError(
            f"{where}: state[{k}][{name!r}] has negative values: a mean of squared "
            "gradients is never negative, so this is no saved state"
        )
    return np.ascontiguousarray(arr, dtype=np.float32)


def _count(where: str, what: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where}: {what}={value!r} is not a step count (an int >= 0)")
    if value < 0:
        raise ValueError(f"{where}: {what}={value!r} is not a step count (an int >= 0)")
    return int(value)
