"""Every exception and warning pydiff raises, in one place so users can catch them.

try:
    m = pydiff.load_module("broken.slang")
except pydiff.SlangCompileError as exc:
    print(exc.file, exc.line)
"""

from __future__ import annotations


class PydiffError(Exception):
    """Base class of pydiff's own exceptions."""


class SlangCompileError(PydiffError):
    """A Slang module failed to compile; the message starts with ``file:line``."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None):
        super().__init__(message)
        self.file = file
        self.line = line


class StaleGradientError(PydiffError, RuntimeError):
    """A STRICT-policy backward would add into a gradient that already holds a result."""


class ShaderTrapError(PydiffError, RuntimeError):
    """A shader uses a pattern SlangPy 0.43 mis-differentiates or crashes on."""


class DeviceUnavailableError(PydiffError, RuntimeError):
    """No device of the requested type could be opened on this machine."""


class CaptureError(PydiffError, RuntimeError):
    """Something inside ``pydiff.capture`` cannot be recorded for replay."""


class GradcheckError(PydiffError, AssertionError):
    """gradcheck found a gradient that disagrees with finite differences."""


class GradientOverflowError(PydiffError, OverflowError):
    """A fixed-point gradient left its range, or a contribution was NaN/inf."""


class ShaderTrapWarning(UserWarning):
    """Raised at load time for shader patterns that will fail in ``.bwds``."""


class CacheWarning(UserWarning):
    """pydiff's persistent compile cache cannot be used (the run goes on without it)."""


class NondeterminismWarning(UserWarning):
    """Deterministic mode is on, but a function's gradients may differ from run to run."""
