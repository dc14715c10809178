"""Compute kernels from pydiff's ``shaders/kernels/``, specialised per shape and dispatched
directly: the fast path of a few ops and the optimizers, where SlangPy's generated
per-element kernels leave too much speed behind (typed float4 loads, register blocking).

    k = kernels.get(device, "matmul.slang", "mm_nt", M=256, N=64, K=64, RB=4, CB=8, TG=32, HAS_BIAS=0)
    kernels.dispatch(k, threads=512, a=x_buffer, b=w_buffer, bias=b_buffer, c=out_buffer, beta=0.0)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable

import slangpy as spy

from . import capturing
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


# Root shader objects with the buffers of recent dispatches bound, for reuse: binding by
# keyword builds a new object each time (about half of a dispatch's 30-45 us on the CPU). An
# object keeps its buffers' device memory alive, so a key of buffer handles cannot match a
# different, newer buffer; only small buffers are kept this way, and only so many bytes.
_objects: OrderedDict = OrderedDict()
_objects_bytes = 0
_OBJECTS_MAX_BYTES = 64 << 20
_OBJECT_MAX_BUFFER = 4 << 20


def _bound_object(kernel: Any, buffers: list, scalars: list) -> Any:
    global _objects_bytes
    key = (id(kernel), *(b.native_handle.value for _, b in buffers))
    entry = _objects.get(key)
    if entry is None:
        size = sum(b.size for _, b in buffers)
        if any(b.size > _OBJECT_MAX_BUFFER for _, b in buffers):
            return None
        root = kernel.device.create_root_shader_object(kernel.program)
        cursor = spy.ShaderCursor(root).find_entry_point(0)
        for name, buffer in buffers:
            cursor[name] = buffer
        entry = _objects[key] = (root, cursor, size)
        _objects_bytes += size
        while _objects_bytes > _OBJECTS_MAX_BYTES:
            _objects_bytes -= _objects.popitem(last=False)[1][2]
    else:
        _objects.move_to_end(key)
    root, cursor, _ = entry
    for name, value in scalars:  # uniforms are copied when the dispatch is recorded
        cursor[name] = value
    return root


def release_objects() -> None:
    """Drop the cached shader objects (and the device memory they keep alive)."""
    global _objects_bytes
    _objects.clear()
    _objects_bytes = 0


def dispatch(kernel: Any, threads: int, *, encoder: Any = None,
             dynamic: Callable[[], dict] | None = None, **bindings: Any) -> None:
    """Run ``threads`` threads now, or append them to ``encoder`` or to the running batched
    backward's command encoder (submitted together: about 30 us a kernel on lavapipe instead
    of 60-200). Anything that must see their results first flushes the backward (pydiff's
    calls and host reads do). ``dynamic`` returns uniforms that may change from step to step
    (a captured step re-reads them on replay); they are bound now too."""
    if dynamic is not None:
        bindings.update(dynamic())
    if encoder is None:
        scope = _active_scope.get()
        if scope is not None and scope._device is not None:
            encoder = scope.encoder()
    buffers, scalars = [], []
    for item in bindings.items():
        (buffers if isinstance(item[1], spy.Buffer) else scalars).append(item)
    rec = capturing.recording()
    if rec is not None:
        rec.record_dispatch(kernel, threads, buffers, scalars, dynamic)
    root = _bound_object(kernel, buffers, scalars)
    if root is None:
        if encoder is not None:
            kernel.dispatch([threads, 1, 1], command_encoder=encoder, **bindings)
        else:
            kernel.dispatch([threads, 1, 1], **bindings)
        return
    own = encoder is None
    if own:
        encoder = kernel.device.create_command_encoder()
    compute = encoder.begin_compute_pass()
    compute.bind_pipeline(kernel.pipeline, root)
    compute.dispatch([threads, 1, 1])
    compute.end()
    if own:
        kernel.device.submit_command_buffer(encoder.finish())


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
