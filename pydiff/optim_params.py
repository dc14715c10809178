"""The parameter list an optimizer is given, checked when it is created and before each use.

pydiff.optim.SGD(w, lr=0.1)      # TypeError: params must be an iterable of tensors: [w]
opt.params.append(q); opt.step() # ValueError naming params[1], before anything changes
"""

from __future__ import annotations

from operator import is_
from typing import Any, Sequence

from . import foreign
from .tensor import Tensor


def checked_params(owner: str, params: Any) -> list[Tensor]:
    """``params`` as a list of distinct float tensors with ``requires_grad=True``, or a
    TypeError/ValueError naming the entry at fault.

    >>> checked_params("SGD", [w, b])
    [w, b]
    """
    if isinstance(params, Tensor):
        # A tensor is iterable (its rows): torch refuses it the same way.
        raise TypeError(
            f"{owner}: params must be an iterable of pydiff.Tensor, got a single pydiff.Tensor "
            f"of shape {tuple(params.shape)}: pass a list, e.g. {owner}([w], ...)"
        )
    try:
        listed = list(params)
    except TypeError:
        raise TypeError(
            f"{owner}: params must be an iterable of pydiff.Tensor, got "
            f"{type(params).__name__} {params!r:.60}"
        ) from None
    if not listed:
        raise ValueError(f"{owner}: params is empty")
    for k, p in enumerate(listed):
        if not isinstance(p, Tensor):
            raise TypeError(f"{owner}: params[{k}] is a {_kind(p)}, not a pydiff.Tensor{_fix(p)}")
        if p.dtype != "float":  # (half, float3, int: said only "must be a float tensor")
            raise ValueError(
                f"{owner}: params[{k}] has dtype {p.dtype!r}; the optimizers step tensors of "
                "dtype 'float' with requires_grad=True (keep a float copy as the parameter)"
            )
        if not p.requires_grad:
            raise ValueError(f"{owner}: params[{k}] must be a float tensor with requires_grad=True")
    seen: dict[int, int] = {}  # storage -> index: one buffer twice would step twice
    for k, p in enumerate(listed):
        j = seen.setdefault(id(p.storage), k)
        if j != k:
            raise ValueError(
                f"{owner}: params[{j}] and params[{k}] are the same tensor (or views of one); "
                "list each parameter once"
            )
    return listed


def check_unchanged(owner: str, params: Sequence[Any], created_with: tuple[Tensor, ...]) -> None:
    """Refuse (ValueError) a public ``opt.params`` list changed since the optimizer was
    created: its state (momentum, Adam's moments, step counts) is one entry per parameter of
    that list, so a step over another list would update some parameters and then fail."""
    if len(params) == len(created_with) and all(map(is_, params, created_with)):
        return
    n, now = len(created_with), len(params)
    k = next((i for i in range(min(now, n)) if params[i] is not created_with[i]), None)
    if k is not None:
        change = f"params[{k}] was replaced by another object"
    else:
        first, count, verb = (n, now - n, "added") if now > n else (now, n - now, "removed")
        more = f" (and {count - 1} more after it)" if count > 1 else ""
        change = f"params[{first}] was {verb}{more}"
    raise ValueError(
        f"{owner}: {change} since the optimizer was created over {n} parameter(s) (its state is "
        "per parameter of that list); nothing was updated. To train another list "
        f"of parameters, create a new optimizer over it, e.g. {owner}([w, b, q], ...) (its state "
        f"starts anew); or put {owner}.params back as it was."
    )


def _kind(p: Any) -> str:
    name = foreign.framework(p)
    return f"{name} tensor" if name else type(p).__name__


def _fix(p: Any) -> str:
    """How to go on with an entry that is no pydiff tensor (torch's, torch's param groups)."""
    if foreign.framework(p) is not None:
        return f": step {foreign.framework(p)} parameters with {foreign.framework(p)}.optim"
    if isinstance(p, dict):
        return ": parameter groups (dicts) are not supported; one optimizer per group"
    return ""
