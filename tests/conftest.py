"""One `device` fixture over every backend that opens here (CUDA/D3D12 skipped when absent).

PYDIFF_DEVICE_TYPES=vulkan,cuda selects backends; the default tries all three.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import pydiff

SHADERS = Path(__file__).parent / "shaders"
_TYPES = [t.strip() for t in os.environ.get("PYDIFF_DEVICE_TYPES", "cuda,d3d12,vulkan").split(",") if t.strip()]


@pytest.fixture(params=_TYPES, scope="session")
def device(request) -> pydiff.Device:
    try:
        return pydiff.create_device(request.param)
    except pydiff.DeviceUnavailableError as exc:
        pytest.skip(f"{request.param} not available here: {str(exc).splitlines()[0][:120]}")


@pytest.fixture(scope="session")
def load():
    """load(name, device) -> the module tests/shaders/<name>.slang, cached per device."""
    cache: dict = {}

    def _load(name: str, device: pydiff.Device) -> pydiff.Module:
        key = (name, id(device))
        if key not in cache:
            cache[key] = pydiff.load_module(SHADERS / f"{name}.slang", device=device)
        return cache[key]

    return _load


@pytest.fixture(autouse=True)
def _default_policy():
    pydiff.set_zero_policy("accumulate")
    yield
    pydiff.set_zero_policy("accumulate")
