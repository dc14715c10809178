"""Slang modules loaded from files (``pydiff.load_module``): the file found as given, on the
device's include paths or in pydiff's shader folder; its imports checked against what the
device's session compiled; the same text loaded again the same ``Module``; a file edited
since the session compiled it loaded under a fresh name beside it (Slang keeps the first).

    m = pydiff.load_module("polynomial.slang")           # samples/, include paths, shaders/
"""

from __future__ import annotations

from pathlib import Path

import slangpy as spy

from . import kernel_sources, module_session, slang_compile
from .device import Device, resolve_device, shader_dir
from .module import Module, links


def find_file(path: str | Path, device: Device) -> Path:
    """The file ``path`` names: as given (relative to the working folder), else on the
    device's include paths, then in pydiff's shader folder; FileNotFoundError listing where
    it looked."""
    p = Path(path)
    searched = []
    candidates = [p] if p.is_absolute() else [Path.cwd() / p]
    if not p.is_absolute():
        candidates += [Path(d) / p for d in device.native.desc.compiler_options.include_paths]
        candidates.append(shader_dir() / p)
    for c in candidates:
        searched.append(str(c))
        if c.is_file():
            return c.resolve()
    raise FileNotFoundError(
        f"Slang module '{path}' not found; searched:\n  " + "\n  ".join(dict.fromkeys(searched))
    )


def load_module(
    path: str | Path, device: Device | str | None = None, *, lint: bool = True
) -> Module:
    """Load a ``.slang`` file: a path, or a name on the device's include paths. Loading it
    again after an edit compiles the new text (under a fresh module name); an edited file it
    imports is refused (Slang keeps the first copy of an imported module).

    >>> m = pydiff.load_module("samples/polynomial.slang")
    >>> y = m.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
    """
    dev = resolve_device(device)
    file = find_file(path, dev)
    if file.parent != shader_dir():
        module_session.check_name(file.stem, f"pydiff.load_module({str(path)!r})")
    source = file.read_text(encoding="utf-8", errors="replace")
    module_session.check_imports(source, str(file), dev)
    now = module_session.digest(source)
    held = module_session.compiled_digest(dev, str(file))
    # The same text loaded again is the same module (each new one held ~1 MB of kernels and
    # reflection: a loop that reloads an unchanged file grew without bound).
    loaded = dev.cached(("pydiff.load_module", str(file), now, bool(lint)), list)
    if loaded:
        return loaded[0]
    if held is None or held == now:
        try:
            native = spy.Module.load_from_file(dev.native, str(file), link=links(source, dev))
        except spy.SlangCompileError as exc:
            raise slang_compile.compile_error(exc, str(file), None, source=source) from None
        module_session.record(dev, str(file), now)
        spec = '"' + str(file).replace("\\", "/") + '"'
        loaded[:] = [Module(native, dev, file.stem, source, str(file), spec, lint)]
        return loaded[0]
    # Edited since the session compiled it: the session keeps that copy under the file's path
    # and name, so the new text gets its own (a neighbouring path: its imports resolve alike).
    fresh = f"{file.stem}__pydiff_v{now[:12]}"
    alias = str(file.with_name(fresh + ".slang"))
    try:
        slang_module = kernel_sources.load_source_module(dev.native, fresh, source, path=alias)
    except spy.SlangCompileError as exc:
        raise slang_compile.compile_error(exc, str(file), None, alias, source) from None
    native = spy.Module.load_from_module(dev.native, slang_module, link=links(source, dev))
    loaded[:] = [Module(native, dev, file.stem, source, str(file), fresh, lint, slang_module)]
    return loaded[0]
