"""The Slang sources pydiff compiles itself, built here and recorded on request: compute
kernels (pydiff's shader library's entry points, the kernels it generates) and the modules
they import that exist only as text (generated helpers and wrappers, modules loaded from
source). With ``PYDIFF_KERNEL_SOURCES`` naming a file, each is appended to it as one JSON
line ``{"kind": "kernel" | "module", "name", "entry", "source"}``: what
``scripts/cuda_compile_check.py`` compiles for CUDA without a GPU. Unset (the default),
recording costs one environment lookup per compile.

    kernel = build_kernel(dev.native, dev.native, "pydiff_gen_f_ab12", source, "main")
    module = load_source_module(dev.native, "pydiff_gen_helpers", text)
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import slangpy as spy

#: The environment variable naming the file the sources are appended to.
ENV = "PYDIFF_KERNEL_SOURCES"

_lock = threading.Lock()


def record(kind: str, name: str, source: str, entry: str | None = None) -> None:
    """Append one compiled source to ``$PYDIFF_KERNEL_SOURCES`` (nothing when unset)."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "name": name, "entry": entry, "source": source})
    with _lock, open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")


def build_kernel(session: Any, native_device: Any, name: str, source: str, entry: str) -> Any:
    """The compute kernel of ``entry`` in ``source``, compiled as module ``name`` in
    ``session`` (a Slang session, or the device's own) for ``native_device``."""
    record("kernel", name, source, entry)
    module = session.load_module_from_source(name, source)
    program = session.link_program([module], [module.entry_point(entry)])
    return native_device.create_compute_kernel(program)


def load_source_module(session: Any, name: str, source: str, **kwargs: Any) -> Any:
    """``session.load_module_from_source(name, source, **kwargs)``, recorded: a module that
    a kernel may import by ``name``."""
    record("module", name, source)
    return session.load_module_from_source(name, source, **kwargs)


def spy_module(native_device: Any, name: str, source: str, **kwargs: Any) -> spy.Module:
    """``spy.Module.load_from_source``, recorded like ``load_source_module``."""
    record("module", name, source)
    return spy.Module.load_from_source(native_device, name, source, **kwargs)
