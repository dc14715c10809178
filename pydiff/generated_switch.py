"""The switch of pydiff's generated kernels: ``PYDIFF_GENERATED`` (unset or 1: on; 0, off,
false or no: off), read as cheaply as each kind of call allows, and refused loudly when
mistyped whatever the call's size.

    generated_switch.enabled()               # the full path: read at every call
    generated_switch.check_switch_planned()  # a call plan: read when the environment changed
"""

from __future__ import annotations

import os

from .errors import env_flag

SWITCH = "PYDIFF_GENERATED"
_switch_read = ("", True)  # the switch's last raw value and what it means (unset: on)
_environ_size = -1  # os.environ's size when a call plan last read the switch


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
