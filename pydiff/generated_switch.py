"""The switch of pydiff's generated kernels: ``PYDIFF_GENERATED`` (unset or 1: on; 0, off,
false or no: off), read as cheaply as each kind of call allows, and refused loudly when
mistyped whatever the call's size.

    generated_switch.enabled()               # the full path: read at every call
    generated_switch.check_switch_planned()  # a call plan: read when the environment changed
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from .errors import env_flag, env_int

SWITCH = "PYDIFF_GENERATED"
_switch_read = ("", True)  # the switch's last raw value and what it means (unset: on)
_environ_size = -1  # os.environ's size when a call plan last read the switch
_unset_size = -1  # os.environ's size when enabled_planned last found the switch unset
_quiet = threading.local()  # .on: this thread runs calls for one already counted (uncounted)


def enabled() -> bool:
    """Whether generated kernels may be used (``PYDIFF_GENERATED=0`` turns them off). Read at
    each call (tests switch it); a value it does not take raises ``EnvironmentSettingError``.

        generated_switch.enabled()   # True unless PYDIFF_GENERATED is 0, off, false or no
    """
    global _switch_read
    raw = os.environ.get(SWITCH, "")
    if raw != _switch_read[0]:  # parsed once per value: every call of a function reads it
        _switch_read = (raw, env_flag(SWITCH, True))
    return _switch_read[1]


def check_switch() -> None:
    """Raise ``EnvironmentSettingError`` if ``PYDIFF_GENERATED`` holds a value it does not take.
    Every call of a user's function runs this, whatever its size: calls too small for the
    generated kernels would otherwise never read the switch, and a typo would pass silently.

        generated_switch.check_switch()     # PYDIFF_GENERATED=of: EnvironmentSettingError
    """
    enabled()


def check_switch_planned() -> None:
    """``check_switch`` for a call plan's repeated calls: reading ``os.environ`` cost about 5
    us a call there (a sixth of a 16-element call: bench_core), so the switch is read again
    only when the environment's size changed (setting or unsetting a variable) or its last
    value was refused; a set value changed in place is read by the next call a plan does not
    take (a new shape, a tape, a large call).

        generated_switch.check_switch_planned()   # PYDIFF_GENERATED=of set since: raises
    """
    global _environ_size
    size = len(os.environ)
    if size != _environ_size:
        enabled()  # (raises on a refused value, leaving the size unseen: read again next call)
        _environ_size = size


def enabled_planned() -> bool:
    """``enabled`` for a call plan's repeated small calls. ``os.environ.get`` of an unset
    variable cost 1.4 us here (the missing key raises inside it; a set one 0.6 us), a tenth
    of a planned 16-element call; an unset switch stays unset until a variable is added, so
    while the environment keeps the size it had when the switch was last found unset, it is
    not read again. (A variable removed and the switch set between two calls would go unseen
    until the next call a plan does not take, or a large one.)

        generated_switch.enabled_planned()   # as enabled()
    """
    global _unset_size
    size = len(os.environ)
    if size == _unset_size:
        return True
    on = enabled()  # (raises on a refused value)
    _unset_size = size if SWITCH not in os.environ else -1
    return on


#: A call plan (call_plan) of a smaller layout takes it once it has run this many times: its
#: dispatch, deferred with the device's other work, is cheaper than SlangPy's call (16
#: elements ~18 against ~25 us), which pays back the kernel's build (~40 ms) in a hot loop.
#: On a GPU it was slower than SlangPy's call (an H200, CUDA, 16 elements: 17.4 against
#: 12.2 us forward, 25.0 against 14.0 us ``.bwds``, 2026-11-27): there small calls keep
#: SlangPy's unless ``PYDIFF_GENERATED_PLANNED_AFTER`` is set (``planned_after``).
PLANNED_AFTER = env_int("PYDIFF_GENERATED_PLANNED_AFTER", 1000)
NEVER = 1 << 62  # (a count no call plan reaches)
_PLANNED_AFTER_SET = "PYDIFF_GENERATED_PLANNED_AFTER" in os.environ
PLANNED_AFTER_ON_GPU = PLANNED_AFTER if _PLANNED_AFTER_SET else NEVER


def planned_after(device: Any) -> int:
    """After how many runs a call plan of a small layout on ``device`` takes the generated
    kernel: ``PLANNED_AFTER`` on lavapipe, ``PLANNED_AFTER_ON_GPU`` elsewhere (never, unless
    the variable is set).

        generated_switch.planned_after(dev)   # 1000 on lavapipe, NEVER on a GPU
    """
    return PLANNED_AFTER if "llvmpipe" in device.adapter_name else PLANNED_AFTER_ON_GPU


def counted() -> bool:
    """Whether this thread's declined calls count in ``generated.stats()`` (not inside
    ``uncounted``)."""
    return not getattr(_quiet, "on", False)


@contextmanager
def uncounted() -> Iterator[None]:
    """The calls pydiff makes to run one call already counted (``.fwds``' wrapper, called on
    SlangPy's path) are not counted again in ``generated.stats()``: before, one ``.fwds`` gave
    ``fwds_fallback`` and ``forward_fallback`` (``declined: returns void``) both.

        with generated_switch.uncounted():
            forward_call(wrapper, args, {})
    """
    was = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = was
