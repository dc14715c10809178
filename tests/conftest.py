"""pydiff's own tests use its pytest plugin (pydiff.testing): one `device` fixture over every
backend that opens here (CUDA/D3D12 skipped when absent); `--pydiff-device=vulkan,cuda` or
PYDIFF_DEVICE_TYPES selects backends.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import pydiff

SHADERS = Path(__file__).parent / "shaders"


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
