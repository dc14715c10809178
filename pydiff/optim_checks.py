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
from typing import Any, Iterable, Mapping

import numpy as np

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


def check_state_dict(
    owner: str, state: Any, n_params: int, defaults: Hyperparameters, buffers: Iterable[str]
) -> dict[str, Any]:
    """The hyper-parameters of ``state`` (a pydiff ``state_dict()``) checked for ``owner``
    (an optimizer of ``n_params`` parameters and the state buffers named ``buffers``), or a
    TypeError/ValueError saying what the dict lacks or holds that this optimizer has not.
    Nothing is changed; the caller checks the buffers' shapes and loads."""
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
    _count(where, "step", state["step"])
    entries = state["state"]
    if not isinstance(entries, (list, tuple)) or len(entries) != n_params:
        got = len(entries) if isinstance(entries, (list, tuple)) else type(entries).__name__
        raise ValueError(f"{where}: {got} parameter states for {n_params} parameters")
    known = set(buffers)
    for k, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: state[{k}] is a {type(entry).__name__}, not a dict")
        for name in entry:
            if name == "step":
                _count(where, f"state[{k}]['step']", entry[name])
            elif name not in known:
                raise ValueError(
                    f"{where}: state[{k}] holds {name!r}, which {owner} has not (its state: "
                    f"{', '.join(sorted(known))}, step): not a state dict of {owner}"
                )
    return checked


def _count(where: str, what: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where}: {what}={value!r} is not a step count (an int >= 0)")
    if value < 0:
        raise ValueError(f"{where}: {what}={value!r} is not a step count (an int >= 0)")
    return int(value)
