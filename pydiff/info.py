"""What ``pydiff info`` reports: versions, the devices that open here, the features pydiff
uses on each, and the shader search path.

    data = pydiff.info.collect()
    print(pydiff.info.format_info(data))
"""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np
import slangpy as spy

from . import compile_cache
from .device import AUTO_ORDER, lavapipe_threads_text, open_device, shader_dir
from .device_names import auto_override
from .errors import DeviceUnavailableError

# The device features pydiff relies on, by the name SlangPy reports.
_FEATURES = {
    "atomic_float": "float atomics (gradient accumulation of .bwds)",
    "atomic_int64": "int64 atomics (fixed-point deterministic accumulation)",
    "atomic_half": "half atomics (half-precision gradients)",
}


def collect() -> dict[str, Any]:
    from . import __version__

    # First: a PYDIFF_DEVICE pydiff does not take stops info as it stops every command that
    # opens the "auto" device (EnvironmentSettingError), rather than list backends as if unset.
    auto_device = auto_override()
    devices = []
    for name in AUTO_ORDER:
        try:
            dev = open_device(name)
        except DeviceUnavailableError as exc:
            devices.append({"type": name, "opens": False, "why": str(exc).splitlines()[0]})
            continue
        features = {str(f).split(".")[-1] for f in dev.native.features}
        devices.append(
            {
                "type": name,
                "opens": True,
                "adapter": dev.adapter_name,
                "features": {
                    k: (k in features or (k == "atomic_float" and name == "cuda"))
                    for k in _FEATURES
                },
                "include_paths": [str(p) for p in dev.native.desc.compiler_options.include_paths],
                "fast_kernels": {
                    "loads": "typed" if dev.typed_loads else "structured",
                    "stores": "paired 64-bit" if dev.kernels.paired_stores else "float4",
                    "float4s_per_thread": dev.kernels.chunk,
                    "shapes": "GPU" if dev.kernels.gpu else "lavapipe",
                },
            }
        )
    return {
        "pydiff": __version__,
        "slangpy": spy.__version__,
        "slang": getattr(spy, "SLANG_BUILD_TAG", "unknown"),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "shader_dir": str(shader_dir()),
        "devices": devices,
        "pydiff_device": auto_device,
        "lavapipe_threads": os.environ.get("LP_NUM_THREADS"),
        "compile_cache": compile_cache.usage(),
    }


def format_cache(cache: dict[str, Any]) -> str:
    """One line on the persistent compile cache (where, how big, the bound)."""
    if not cache["enabled"]:
        return "compile cache: off (PYDIFF_CACHE=0)"
    if cache.get("problem"):
        return f"compile cache: {cache['path']}: {cache['problem']}"
    mb = cache["bytes"] / (1 << 20)
    bound = cache["max_bytes"] / (1 << 20)
    return f"compile cache: {cache['path']} ({mb:.1f} MB; each cache bounded at {bound:.0f} MB)"


def format_info(data: dict[str, Any]) -> str:
    lines = [
        f"pydiff   {data['pydiff']}",
        f"slangpy  {data['slangpy']} (Slang {data['slang']})",
        f"numpy    {data['numpy']}; Python {data['python']} on {data['platform']}",
        f"pydiff's shader library: {data['shader_dir']}",
        format_cache(data["compile_cache"]),
    ]
    gen = data.get("generated_kernels")
    if gen is not None:
        lines.append(
            f"generated kernels: on for covered calls of {gen['min_elements']}+ elements, "
            f"and smaller ones repeated {gen.get('planned_after', '?')} times"
            f"{'' if gen.get('planned_on_gpu', True) else ' on lavapipe'} "
            "(PYDIFF_GENERATED=0 turns them off; pydiff.generated.stats() counts each path)"
            if gen["enabled"]
            else "generated kernels: off (PYDIFF_GENERATED=0)"
        )
    if data.get("pydiff_device"):
        lines.append(f'PYDIFF_DEVICE={data["pydiff_device"]}: the device "auto" opens')
    lines.append("devices:")
    for d in data["devices"]:
        if not d["opens"]:
            lines.append(f"  {d['type']:7s} not available: {d['why']}")
            continue
        lines.append(f"  {d['type']:7s} {d['adapter']}")
        if "llvmpipe" in d["adapter"]:
            lines.append(
                "          compute: " + lavapipe_threads_text(data.get("lavapipe_threads") or "")
            )
        for key, what in _FEATURES.items():
            lines.append(f"          {'yes' if d['features'][key] else 'no ':3s}  {what}")
        fast = d.get("fast_kernels")
        if fast:
            lines.append(
                f"          fast kernels: {fast['loads']} float4 loads, {fast['stores']} stores, "
                f"{fast['float4s_per_thread']} float4(s) per thread, {fast['shapes']} shapes "
                "(PYDIFF_FLOAT4_LOADS, _STORES, _CHUNK, PYDIFF_KERNEL_SHAPES)"
            )
        lines.append(f"          shader search path: {', '.join(d['include_paths']) or '(none)'}")
    return "\n".join(lines)
