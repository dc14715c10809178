"""Calls of a user's function refused inside ``pydiff.capture``, each naming why: where SlangPy's
kernel would run (a call plan declined, a layout no plan covers, a grid, 0-d tensors, numbers
only), a STRICT zeroing policy, and, for a planned ``.bwds``, the reads and gradient buffers
each replay checks again. Outside a capture each is a no-op. ``capture_calls`` records the
calls that pass; ``capturing`` holds the capture itself.

    capture_refusals.refuse_planned(fn.label, plan, None, result)   # before SlangPy's kernel
    capture_refusals.refuse_full_path(fn.label, plan is not None, "no call plan covers it")
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from .capturing import recording
from .errors import CaptureError
from .policy import ZeroPolicy, get_zero_policy

NO_PLAN = (
    "Capturable: calls of a user's function that its call plan runs on pydiff's generated "
    "kernel (elementwise float functions, float32 tensors of the call's shape, all-positional "
    "arguments, _result a tensor or 'tensor'; see docs/capture.md)"
)


FIRST_BWDS = (
    "no call plan covers it (a plan needs all arguments positional, _result= a tensor with "
    "gradient buffers, and every tensor argument an `in` parameter of its own type and the "
    "result's shape, with a gradient buffer); inside Tape.backward a layout's first .bwds "
    "runs the full path, which makes the plan: run the step once eagerly before capturing it"
)


def refuse_call(label: str, why: str) -> None:
    """In a capture: refuse the call ``label`` of a user's function, saying ``why``."""
    if recording() is not None:
        raise CaptureError(
            f"pydiff.capture: {label} cannot be recorded for replay: {why}. {NO_PLAN}."
        )


def refuse_planned(label: str, plan: Any, launch: Any = None, result: Any = "") -> None:
    """In a capture: a call plan (call_plan) about to run SlangPy's kernel instead of its
    generated one (``launch``: the one it tried, if any), refused, naming why from the plan's
    public fields. ``result``: a forward call's ``_result`` (MISSING: none)."""
    if recording() is None:
        return
    made = plan.launch  # a forward plan's: None (not tried), False (not covered), a launch
    if getattr(plan, "grid", False):
        why = "a call over a grid runs SlangPy's kernel"
    elif getattr(plan, "zero_d", False):
        why = "a call on 0-d tensors runs SlangPy's kernel"
    elif getattr(plan, "options", None):
        why = "a whole vector tensor passed for a vector parameter runs SlangPy's kernel"
    elif not plan.tensors and not getattr(plan, "result_tensor", True) and type(result) is not str:
        why = "a call on numbers only returns a host number, which a replay cannot update"
    elif made is False or getattr(made, "covered", True) is False:
        why = (
            "pydiff's kernel generator does not cover this function or argument layout "
            "(pydiff.generated.stats() says why), so SlangPy's kernel would run it"
        )
    elif made is None:
        why = "generated kernels are off (PYDIFF_GENERATED=0), so SlangPy's kernel would run it"
    else:
        why = (
            "a tensor or gradient buffer of this call is not float32 storage pydiff's kernel "
            "reads (a view, another dtype), a gradient buffer is shared with an input, or "
            "generated kernels are off, so SlangPy's kernel would run it"
        )
    refuse_call(label, why)


def planned_bwds(label: str, plan: Any, launch: Any, args: tuple, result: Any) -> None:
    """In a capture: a ``.bwds`` call plan about to run; refused where it would take SlangPy's
    kernel (``launch`` None) or a gradient buffer of ``args`` has the STRICT policy (a data
    tensor's own policy, left from buffers it dropped, acts on nothing). A replay refuses
    where the gradient buffers it binds are no longer the tensors' (_same_grads)."""
    if (rec := recording()) is None:
        return
    if launch is None:
        refuse_planned(label, plan)
    refuse_strict(label, [args[i].zero_policy or get_zero_policy() for i in plan.with_grads])
    named = [(plan.descs[i], args[i], "grad_out") for i in plan.tensors]
    named.append((f"{label}: _result", result, "grad_in"))
    reads = [(plan.descs[i], args[i]) for i in plan.tensors]
    rec.record_reads(label, [*reads, (f"{label}: upstream", result.grad_in)])
    advice = "The replay adds into (and zeroes) the gradient buffers as at the capture: "
    rec.record_check(label, _same_grads(named, rec.policy), advice + "restore it or capture again.")


_NONE = lambda: None  # noqa: E731  (a data tensor's gradient: none, as at the capture)


def _same_grads(named: list, outer: Any) -> Callable[[], str | None]:
    """A ``still_same`` for check_on_replay: each ``(description, tensor, attribute)``'s
    tensor, while alive (weak references), still has the gradient buffer ``attribute`` and
    its own zeroing policy it has now, and the policy around replay() is ``outer``, the one
    around the capture (a replay zeroes as recorded: ACCUMULATE none, RESET clears; a
    policy the step sets itself, ``with zero_policy(...)``, is the same at every replay)."""
    refs = [
        (desc, weakref.ref(t), _NONE if (g := getattr(t, attr)) is None else weakref.ref(g))
        + (attr, t.zero_policy)
        for desc, t, attr in named
    ]

    def still_same() -> str | None:
        if (now := get_zero_policy()) is not outer:
            return f"the zeroing policy is {now.name}, not {outer.name} as at the capture"
        for desc, tensor, grad, attr, policy in refs:
            t = tensor()
            if t is None:
                continue
            if getattr(t, attr) is not grad():
                return f"{desc}: its gradient buffer ({attr}) was replaced, attached or dropped"
            if t.zero_policy is not policy and grad() is not None:
                return f"{desc}: the zeroing policy of its gradient changed since the capture"
        return None

    return still_same


def refuse_strict(label: str, policies: list) -> None:
    """In a capture: a ``.bwds`` whose gradient buffers have the STRICT policy is refused
    (its check of a stale gradient runs on the host at each call; a replay cannot)."""
    if recording() is not None and ZeroPolicy.STRICT in policies:
        refuse_call(
            label,
            "a gradient buffer has the STRICT zeroing policy, whose check runs on the host at "
            "each call and cannot run on replay (capture under ACCUMULATE with zero_grad in "
            "the step, or RESET)",
        )


def refuse_full_path(label: str, planned: bool, first: str) -> None:
    """In a capture: a call of a user's function about to take the full path (SlangPy's
    kernel, or checks only it makes). ``planned``: whether its layout has a call plan (which
    declined this call); ``first``: what to say when it has none."""
    if recording() is None:
        return
    if planned:
        why = (
            "its call plan declined this call (on a tape where the plan cannot record it, "
            "aliased or in-place tensors, a tensor on another device, a zeroing policy other "
            "than ACCUMULATE outside Tape.backward, deterministic mode, an input written "
            "since the forward call, a large call pydiff's generator does not cover, or "
            "generated kernels are off: PYDIFF_GENERATED=0), so the full path would run "
            "SlangPy's kernel"
        )
    else:
        why = first
    refuse_call(label, why)
