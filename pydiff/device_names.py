"""Which backend a device name means: the names pydiff takes, the ones it refuses and why,
and ``PYDIFF_DEVICE``, the setting that picks the backend ``type="auto"`` opens.

    normalise_type("Vulkan")     # 'vulkan'
    auto_override()              # 'cuda' with PYDIFF_DEVICE=cuda; None when unset or 'auto'
"""

from __future__ import annotations

import os

import slangpy as spy

from .errors import DeviceUnavailableError, EnvironmentSettingError

#: Order in which ``type="auto"`` tries backends: fastest first.
AUTO_ORDER = ("cuda", "d3d12", "vulkan")

#: Every backend pydiff opens where it exists (Metal: macOS only).
TYPES = ("cuda", "d3d12", "metal", "vulkan")

# SlangPy 0.43's CPU device opens but cannot dispatch a vectorised call ("zero compute
# dispatch groups") and has no float atomics for bwds, so pydiff refuses it up front.
UNSUPPORTED = {
    "cpu": "SlangPy 0.43's CPU device cannot dispatch vectorised calls nor run bwds; "
    "use 'vulkan' (on a machine without a GPU, Mesa's lavapipe: run `make setup`)",
}


def normalise_type(type: str | spy.DeviceType) -> str:
    """The backend's lower-case name, or ``"auto"``; an unknown name is a ``ValueError``, a
    refused one (``cpu``) a ``DeviceUnavailableError`` saying why.

    >>> normalise_type(spy.DeviceType.vulkan), normalise_type(" CUDA ")
    ('vulkan', 'cuda')
    """
    if isinstance(type, spy.DeviceType):
        type = str(type).split(".")[-1]
    name = str(type).strip().lower()
    if name in UNSUPPORTED:
        raise DeviceUnavailableError(f"device type '{name}': {UNSUPPORTED[name]}")
    if name != "auto" and name not in TYPES:
        raise ValueError(
            f"type={type!r}: unknown device type; expected 'auto' or one of {sorted(TYPES)}"
        )
    return name


def auto_override() -> str | None:
    """The backend ``PYDIFF_DEVICE`` makes ``"auto"`` open: None when unset, empty or
    ``auto``. Any other value it does not take is an ``EnvironmentSettingError`` naming the
    variable and the values it takes (a typo must not silently fall back to trying every
    backend), read by ``create_device("auto")`` and ``pydiff info``.

    >>> os.environ["PYDIFF_DEVICE"] = "Vulkan"; auto_override()
    'vulkan'
    """
    raw = os.environ.get("PYDIFF_DEVICE", "")
    name = raw.strip().lower()
    if name in ("", "auto"):
        return None
    if name in UNSUPPORTED:
        raise EnvironmentSettingError(f"PYDIFF_DEVICE={raw!r}: {UNSUPPORTED[name]}")
    if name not in TYPES:
        raise EnvironmentSettingError(
            f"PYDIFF_DEVICE={raw!r}: unknown device type; expected one of "
            f"{', '.join(('auto', *TYPES))} (or unset)"
        )
    return name
