"""``fn.bwds``: the callable a ShaderFunction's ``.bwds`` is. A call that no capture and no
``pydiff.jvp`` sees goes to its layout's plan first (backward_plan: the per-call checks only,
nothing else before them); every other call, and one its plan declines, takes the checks
below and backward_call's full path.

    m.f.bwds(x, 2.0, _result=y)       # BackwardFunction(m.f)(x, 2.0, _result=y)
"""

from __future__ import annotations

from typing import Any

from . import capture_calls, capturing, foreign, forward_trace
from .arguments import MISSING
from .backward_call import backward_call
from .call_plan import DECLINED
from .plan_layout import layout_key
from .signature import FunctionTarget


class BackwardFunction:
    """``fn.bwds``: run the backward kernel with the same arguments as the forward call.

    Gradients of read values are added into their tensors' ``grad_out`` (per the zeroing
    policy); the upstream gradients of written values and of the result (``_result``) are
    read from ``grad_in``. A plain number as ``_result`` is the upstream gradient of every
    output element.
    """

    def __init__(self, fn: FunctionTarget):
        self._fn = fn
        self._refusal = f"{fn.label}.bwds (SlangPy)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn
        tried = False
        if capturing.recording() is None and forward_trace.active() is None:
            # (a layout with a plan holds pydiff tensors and numbers only: nothing foreign)
            plan = fn.bwds_plans.get(layout_key(args, kwargs))
            if plan is not None:
                if plan.run(fn, args, kwargs.get("_result", MISSING)) is not DECLINED:
                    return None
                tried = True  # (declined: the full path, without running the plan again)
        capture_calls.check_bwds(fn, self._refusal, args, kwargs)  # (in a capture)
        if forward_trace.active() is not None and any(
            t is not None for t in forward_trace.tangents_of([*args, *kwargs.values()])
        ):
            raise NotImplementedError(
                f"{fn.label}.bwds inside pydiff.jvp on values with tangents (forward over "
                "reverse): its gradients would carry no tangent; use pydiff.hvp/hessian"
            )
        args, kwargs = foreign.as_data(fn, args, kwargs, fn.bwds_label)
        return backward_call(fn, args, kwargs, tried=tried)  # (flushes before SlangPy's call)

    def __repr__(self) -> str:
        return f"<pydiff bwds of {self._fn!r}>"
