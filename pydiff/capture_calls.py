"""Calls of a user's Slang function inside ``pydiff.capture``: recorded where the call's
plan (call_plan) runs pydiff's generated kernel, refused (``CaptureError`` naming the function
and why) where SlangPy's kernel would run it.

A layout's first forward call runs the full path unrecorded (``capturing.paused``; its
results are overwritten by the recorded call, which reads the same inputs: a plan never has
a tensor both read and written; they are put back where the call is then refused, so that
an in-place call has not run twice when the step is run again), which makes the plan; the
recorded call then takes it. A layout's first ``.bwds`` outside a tape's backward runs the
full path unrecorded too, its gradient buffers put back afterwards (it adds into them).
Inside ``Tape.backward`` a layout without a plan is refused (run the step once eagerly
first). A replay() inside a recording tape is refused (``_on_tape``).

    out = capture_calls.forward(fn, args, kwargs)   # inside a capture (module.ShaderFunction)
"""

from __future__ import annotations

from typing import Any

from . import capture_refusals, capturing, forward_trace
from .backward_call import backward_call
from .errors import CaptureError
from .backward_scope import active_scope
from .forward_call import forward_call
from .plan_layout import layout_key
from .signature import FunctionTarget
from .tape import active_tape, suspend_recording
from .tensor import Tensor

NOT_PLANNED = (
    "its arguments are not all positional tensors and numbers (keyword arguments, structs, "
    "arrays, NumPy values), or its _result is not a tensor or 'tensor', so SlangPy's path "
    "runs it"
)


def library_call(fn: FunctionTarget) -> bool:
    """Whether ``fn`` is one of pydiff's own library functions (the ops built on SlangPy),
    which stay refused in a capture."""
    return fn.module.native is fn.module.device.library


def check_bwds(fn: FunctionTarget, refusal: str, args: tuple, kwargs: dict) -> None:
    """Before ``fn.bwds(*args, **kwargs)``, in a capture: a library function's refused
    (``refusal``); a user's layout seen for the first time outside a tape's backward runs the
    full path unrecorded (``probe_bwds``), which makes its plan. The call then goes on to its
    plan, which runs pydiff's kernel or refuses (capture_refusals.planned_bwds)."""
    if capturing.recording() is None:
        return
    if library_call(fn):
        capturing.refuse(refusal)
    key = layout_key(args, kwargs)
    if key is not None and key not in fn.bwds_plans and active_scope() is None:
        probe_bwds(fn, args, kwargs)


def probe_bwds(fn: FunctionTarget, args: tuple, kwargs: dict) -> None:
    """The full path of ``fn.bwds``, unrecorded and off any tape, to make its plan, with the
    gradient buffers it adds into put back as they were (copies on the device): the recorded
    call that follows adds the gradients once."""
    grads, seen = [], set()
    for v in args:
        g = v.grad_out if type(v) is Tensor else None
        if g is not None and id(g.storage) not in seen:
            seen.add(id(g.storage))
            grads.append(g)
    with capturing.paused(), suspend_recording():
        kept = [(g, g.copy_values()) for g in grads]
        backward_call(fn, args, kwargs)
        for g, before in kept:
            g.copy_(before)


def _written(fn: FunctionTarget, args: tuple, kwargs: dict) -> list:
    """The tensors ``fn(*args, **kwargs)`` writes (``inout``/``out`` parameters, a ``_result``
    given), one per storage: the values a first call's full path would leave changed where
    the call is then refused."""
    written = [args[i] for i in fn.signature.written if i < len(args)]
    written.append(kwargs.get("_result"))
    out, seen = [], set()
    for t in written:
        if type(t) is Tensor and id(t.storage) not in seen:
            seen.add(id(t.storage))
            out.append(t)
    return out


def forward(fn: FunctionTarget, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` inside a capture: the plan's generated kernel, recorded."""
    if library_call(fn):
        capturing.refuse(f"calling {fn.label} through SlangPy")
    if forward_trace.active() is not None:
        capture_refusals.refuse_call(
            fn.label, "inside pydiff.jvp (its tangents run SlangPy's kernels)"
        )
    key = layout_key(args, kwargs)
    if key is None:
        capture_refusals.refuse_call(fn.label, NOT_PLANNED)
    kept: list = []
    if key not in fn.plans:
        # The full path, unrecorded and off any tape: it checks the call and makes the plan.
        with capturing.paused(), suspend_recording():
            kept = [(t, t.copy_values()) for t in _written(fn, args, kwargs)]
            forward_call(fn, args, kwargs)
    try:
        if key not in fn.plans:
            capture_refusals.refuse_call(
                fn.label,
                "no call plan covers it (in-place or inout parameters, aliased tensors, "
                "struct or host arguments, overloads, a trap finding, a 0-d call, a large "
                "grid), so SlangPy's path runs it",
            )
        out = forward_call(fn, args, kwargs)
    except CaptureError:  # refused: the first call's full path must not have run either
        with capturing.paused(), suspend_recording():
            for t, before in kept:
                t.copy_(before)
        raise
    reads = [
        (f"{fn.label}: parameter '{p.name}'", v)
        for p, v in zip(fn.signature.params, args)
        if type(v) is Tensor and p.reads_value
    ]
    capturing.recording().record_reads(fn.label, reads)  # (the step's inputs: kept)
    return out


def _on_tape() -> str | None:
    if active_tape() is None:
        return None
    return (
        "inside a recording pydiff.Tape: the replayed kernels are on no tape, so a backward "
        "through what they wrote would treat it as a constant (no gradient to the step's "
        "inputs). Replay outside the tape, or run the step eagerly on it"
    )


capturing.guard_replays(_on_tape)  # (capturing is below tape: it cannot ask itself)
