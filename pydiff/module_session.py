"""What a device's Slang session already holds: the module names pydiff and SlangPy need for
themselves, and the version of each ``.slang`` file compiled into it.

A Slang session keeps the first module it compiled under a name or a path for good: loading
the path again returns that copy, even after the file changed on disk, and there is no way
to replace it (SlangPy's hot reload rebuilds every program of the device, under caches pydiff
keeps). pydiff's trap scan reads the file as it is now, so running the old copy under a scan
of the new text could lift a refusal that guarded the old code. pydiff records what it
compiled; an edited top file is compiled again under a fresh name, and an edited file that
the session holds as an import is refused.

    names.check_name("slangpy", "load_module_from_source")   # ValueError
    record = session_files(dev); stale = changed(dev, files)
"""

from __future__ import annotations

import hashlib
import re
import weakref
from pathlib import Path
from typing import Any

from . import lint_macros, lint_sources

#: Modules a session holds under these names for SlangPy's and pydiff's own code: Slang's core
#: module, SlangPy's (every generated kernel imports it), pydiff's shader library and its
#: written-mask module (shaders/), the generated kernels' helpers (generated_helpers.SOURCES).
#: A user module under one of them hides or replaces it.
RESERVED_NAMES = frozenset({"core", "slangpy", "pydiff", "pydiff_written_mask"}) | {
    f"pydiff_gen_helpers{form}" for form in ("", "_w64", "_t0p0", "_t1p0", "_t0p1", "_t1p1")
}

_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_name(name: str, where: str) -> None:
    """Refuse a module name that would shadow one of SlangPy's or pydiff's own modules."""
    if name in RESERVED_NAMES:
        raise ValueError(
            f"{where}: a module named {name!r} would shadow "
            + (
                "Slang's core module"
                if name == "core"
                else f"the '{name}' module SlangPy and pydiff import into their generated kernels"
            )
            + " and break later calls in this process; rename it (or its file)"
        )


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()


def _file_digest(path: str) -> str | None:
    try:
        return digest(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


def compiled_digest(device: object, path: str) -> str | None:
    """The digest of ``path`` as the device's session compiled it under its own path."""
    return _compiled.get(device, {}).get(path)


def record(device: object, path: str, text_digest: str | None) -> None:
    """Note that the session now holds ``path`` with this content (the first copy stays)."""
    if text_digest is not None:
        _compiled.setdefault(device, {}).setdefault(path, text_digest)


def changed_imports(device: object, files: list[str]) -> list[str]:
    """Those of ``files`` (a module's imports and includes) that the session holds in an older
    version; the others are recorded as they are now."""
    stale = []
    for path in files:
        now = _file_digest(path)
        held = compiled_digest(device, path)
        if held is not None and now is not None and held != now:
            stale.append(path)
        else:
            record(device, path, now)
    return stale


def stale_import_error(stale: list[str], file: str) -> RuntimeError:
    listing = ", ".join(stale)
    return RuntimeError(
        f"{file}: {listing} changed since it was loaded in this process, and {file} imports "
        "or includes it; Slang keeps the first compiled copy of an imported module for the "
        "whole process, so the new text would not run. Restart the process (SlangPy cannot "
        "reload an imported module); only the file given to pydiff.load_module itself is "
        "compiled again when it changes"
    )


def check_imports(source: str, file: str, device: Any) -> None:
    """Refuse a module whose imports the session holds in a version older than the disk's."""
    options = device.native.desc.compiler_options
    scan = lint_sources.scan_module(source, file, options.include_paths, options.defines)
    stale = changed_imports(device, scan.files)
    if stale:
        raise stale_import_error(stale, file)


_PLAIN_IMPORT = re.compile(r'^[ \t]*import\s+([\w.]+|"[^"\n]+")\s*;', re.MULTILINE)


def reachable(device: Any, import_spec: str, name: str) -> bool:
    """Whether ``name`` is visible to code that imports the module (as SlangPy's generated
    kernels do): not when it comes from a module the module imports without ``__exported``,
    which its reflection lists all the same."""
    probe = f"import {import_spec};\nvoid pydiff_probe() {{ {name}; }}\n"
    label = hashlib.sha1(probe.encode()).hexdigest()[:12]
    try:
        device.native.load_module_from_source(f"pydiff_probe_{label}", probe)
    except Exception as exc:  # other errors (generic, overloaded names): let the call decide
        return "undefined identifier" not in str(exc)
    return True


def unreachable_error(module_name: str, file: str, source: str, name: str) -> AttributeError:
    plain = [m.group(1) for m in _PLAIN_IMPORT.finditer(lint_macros.blank_comments(source))]
    which = " or ".join(f"`__exported import {p};`" for p in plain) or "`__exported import`"
    return AttributeError(
        f"module '{module_name}' ({file}) cannot call '{name}': it comes from a module "
        f"'{module_name}' imports with a plain `import`, which code importing "
        f"'{module_name}' (the kernels a call generates) does not see. Write {which} in "
        f"{file} for the module that declares '{name}', or load that module and call it there"
    )
