"""What a call plan (call_plan) is keyed by: a call's layout, and the per-function dict of
plans, bounded.

    key = layout_key(args, kwargs)      # None: a call no plan covers
    remember(fn, fn.plans, key, plan)   # the oldest dropped past PLANS_MAX; empty_cache: all
"""

from __future__ import annotations

from typing import Any

from .grid_args import GRID  # (in a layout by shape, stride, offset)
from .tensor import Tensor

PLANS_MAX = 64  # layouts remembered per function and direction (the oldest dropped first)


def layout_key(args: tuple, kwargs: dict) -> tuple | None:
    """The layout of an all-positional call (see the module docstring); None for a call no
    plan covers (keywords, other options, struct, array or other arguments)."""
    key = []
    for v in args:  # (one pass, no comprehension: this runs on every call)
        t = type(v)
        if t is Tensor:
            key.append(v.layout)
        elif t is float or t is int or t is bool:  # PLAIN
            key.append(t)
        elif t is GRID:
            key.append((t, v.shape.as_tuple(), v.stride.as_tuple(), v.offset.as_tuple()))
        else:
            return None
    if kwargs:
        if len(kwargs) != 1:
            return None
        r = kwargs.get("_result")
        if type(r) is Tensor:
            key += ("_result", r.layout)  # (marked: f(x, y) is not f(x, _result=y))
        elif type(r) is str and r == "tensor":
            key += ("_result", r)
        else:
            return None
    return tuple(key)


def remember(fn: Any, plans: dict, key: tuple | None, plan: Any) -> None:
    """Keep ``plan`` for ``key`` (a layout the full path just ran) in ``plans`` (``fn.plans``
    or ``fn.bwds_plans``), dropping the oldest; ``empty_cache`` of ``fn``'s device drops all
    of ``fn``'s plans (``forget_plans``: they hold compiled kernels)."""
    if key is None or plan is None:
        return
    fn.module.device.on_empty_cache(fn, forget_plans)
    if len(plans) >= PLANS_MAX:
        try:
            plans.pop(next(iter(plans)), None)
        except (RuntimeError, StopIteration):  # another thread changed it meanwhile
            pass
    plans[key] = plan


def forget_plans(fn: Any) -> None:
    """Drop ``fn``'s call plans (``Device.empty_cache``): made again by the full path."""
    fn.plans.clear()
    fn.bwds_plans.clear()
