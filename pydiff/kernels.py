"""Compute kernels from pydiff's ``shaders/kernels/``, specialised per shape and dispatched
directly: the fast path of a few ops and the optimizers, where SlangPy's generated
per-element kernels leave too much speed behind (typed float4 loads, register blocking).

    k = kernels.get(device, "matmul.slang", "mm_nt", M=256, N=64, K=64, RB=4, CB=8, TG=32, HAS_BIAS=0)
    kernels.dispatch(k, threads=512, a=x_buffer, b=w_buffer, bias=b_buffer, c=out_buffer, beta=0.0)
"""

from __future__ import annotations

import hashlib
from typing import Any

import slangpy as spy

from ._errors import PydiffError
from .device import Device, shader_dir
from .policy import _active_scope
from .tensor import Tensor

_kernels: dict[tuple, Any] = {}


def get(device: Device, file: str, entry: str, **defines: int) -> Any:
    """The compute kernel ``entry`` of shaders/kernels/``file`` with ``defines``, built once."""
    key = (id(device.native), file, entry, tuple(sorted(defines.items())))
    kernel = _kernels.get(key)
    if kernel is None:
        path = shader_dir() / "kernels" / file
        # ENTRY_<name> lets a file compile only the entry point asked for (no warnings
        # from the others' loops that run zero times for these shapes).
        macros = {**defines, f"ENTRY_{entry}": 1}
        source = "".join(f"#define {k} {int(v)}\n" for k, v in sorted(macros.items())) + path.read_text()
        name = f"pydiff_kernel_{entry}_{hashlib.sha1(source.encode()).hexdigest()[:12]}"
        try:
            module = device.native.load_module_from_source(name, source)
            program = device.native.link_program([module], [module.entry_point(entry)])
        except Exception as exc:  # a bug in pydiff's own shaders, not the user's
            raise PydiffError(f"pydiff kernel {file}:{entry} {defines} failed to build:\n{exc}") from None
        kernel = _kernels[key] = device.native.create_compute_kernel(program)
    return kernel


def dispatch(kernel: Any, threads: int, *, encoder: Any = None, **bindings: Any) -> None:
    """Run ``threads`` threads now, or append them to ``encoder`` or to the running batched
    backward's command encoder (submitted together: about 30 us a kernel on lavapipe instead
    of 60-200). Anything that must see their results first flushes the backward (pydiff's
    calls and host reads do)."""
    if encoder is None:
        scope = _active_scope.get()
        if scope is not None and scope._device is not None:
            if scope._encoder is None:
                scope._encoder = scope._device.native.create_command_encoder()
            encoder = scope._encoder
    if encoder is not None:
        kernel.dispatch([threads, 1, 1], command_encoder=encoder, **bindings)
    else:
        kernel.dispatch([threads, 1, 1], **bindings)


def flush_pending() -> None:
    """Submit the running backward's queued kernels (before a host read or an unbatched call)."""
    scope = _active_scope.get()
    if scope is not None and scope._encoder is not None:
        scope.flush()


def float4_ready(*tensors: Tensor) -> bool:
    """All tensors are contiguous Vulkan float tensors at the start of a float4-typed buffer."""
    for t in tensors:
        n = t._native
        if (t._device.type != "vulkan" or n.dtype.full_name != "float" or n.offset != 0
                or not n.is_contiguous() or n.storage.desc.format != spy.Format.rgba32_float):
            return False
    return True
