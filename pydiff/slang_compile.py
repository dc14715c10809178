"""Slang source compiled into a device's session, and SlangPy's compile errors made readable:
the file and line of the user's text (SlangPy names source modules by a hash, or pydiff by a
fresh alias for a reloaded file, and prepends a line), as a ``SlangCompileError``.

    native = load_source(dev.native, "sq", "[Differentiable] float sq(float x) { return x*x; }")
    raise compile_error(exc, "shaders/model.slang", None)
"""

from __future__ import annotations

import hashlib
from typing import Any

import slangpy as spy

from .errors import SlangCompileError


def compile_error(
    exc: Exception, display_name: str, hashed_name: str | None, alias: str = ""
) -> SlangCompileError:
    """SlangPy's compile error as a ``SlangCompileError`` naming ``display_name`` and the line
    (``alias``: the fresh name a reloaded file was compiled under)."""
    return SlangCompileError.from_slang(str(exc), display_name, bool(hashed_name), alias=alias)


#: Sources that failed to compile, by (device, name, source digest): the Slang session keeps
#: a module that failed, and loading the same name again returns it, half-built (a second
#: pydiff.hvp of a function whose wrapper failed crashed the interpreter).
_FAILED_SOURCES: dict[tuple[int, str, str], tuple[str, str | None, int | None]] = {}


def load_source(native_device: Any, name: str, source: str, link: list) -> Any:
    """SlangPy's module compiled from ``source`` under ``name``; a ``SlangCompileError``
    naming ``<name>`` and the line, again on every retry of a source that failed."""
    failed_key = (id(native_device), name, hashlib.sha1(source.encode()).hexdigest())
    if failed_key in _FAILED_SOURCES:  # SlangPy would hand back the broken module: a segfault
        message, file, line = _FAILED_SOURCES[failed_key]
        raise SlangCompileError(message, file=file, line=line)
    try:
        return spy.Module.load_from_source(native_device, name, source, link=link)
    except spy.SlangCompileError as exc:
        if "already loaded with different source" in str(exc):
            raise SlangCompileError(
                f"<{name}>: a module named {name!r} was already loaded in this process with "
                "different source; SlangPy cannot reload a module: give this version another "
                "name, or restart the process",
                file=f"<{name}>",
                line=None,
            ) from None
        error = compile_error(exc, f"<{name}>", name)
        _FAILED_SOURCES[failed_key] = (str(error), error.file, error.line)
        raise error from None
