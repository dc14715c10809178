"""pydiff's own tests use its pytest plugin (pydiff.testing): one `device` fixture over every
backend that opens here (CUDA/D3D12 skipped when absent); `--pydiff-device=vulkan,cuda` or
PYDIFF_DEVICE_TYPES selects backends. `--pydiff-generated=force` sends every call the generated
kernels cover through them, whatever its size (`make test-generated`); `off` none.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import pydiff
from pydiff import generated

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


def pytest_addoption(parser):
    parser.addoption(
        "--pydiff-generated",
        choices=("auto", "force", "off"),
        default="auto",
        help="generated kernels: for large covered calls (auto), for every covered call "
        "(force: PYDIFF_GENERATED_MIN_ELEMENTS=1), or never (off: PYDIFF_GENERATED=0)",
    )


def pytest_configure(config):
    mode = config.getoption("--pydiff-generated")
    if mode == "force":  # the environment too: tests that start other processes
        os.environ["PYDIFF_GENERATED_MIN_ELEMENTS"] = "1"
        generated.MIN_ELEMENTS = 1
    elif mode == "off":
        os.environ["PYDIFF_GENERATED"] = "0"


@pytest.fixture
def forced(monkeypatch):
    """Every covered call through a generated kernel, whatever its size (the monkeypatch that
    did it, for ``generated_paths.run_both_paths``). Test files may define their own."""
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    generated.reset_stats()
    return monkeypatch


#: ``generated.MIN_ELEMENTS`` when ``PYDIFF_GENERATED_MIN_ELEMENTS`` is unset.
AUTO_MIN_ELEMENTS = 4096


@pytest.fixture
def auto_sizes(monkeypatch):
    """Calls under 4,096 elements take call plans (SlangPy's kernels), as by default, even under
    ``--pydiff-generated=force``: for tests of the plans of small calls, which force mode would
    otherwise send to generated kernels before any plan formed."""
    monkeypatch.setattr(generated, "MIN_ELEMENTS", AUTO_MIN_ELEMENTS)
    return monkeypatch


@pytest.fixture
def second_call_generated(monkeypatch):
    """Call plans switch to generated kernels at their second call, whatever the call's size
    (``MIN_ELEMENTS`` raised: no call counts as large). Returns ``pydiff.generated``."""
    from pydiff import generated_switch

    monkeypatch.setattr(generated_switch, "PLANNED_AFTER", 1)
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER_ON_GPU", 1)
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1 << 20)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()
    return generated


@pytest.fixture(params=["slangpy", "generated"])
def plan_path(request, monkeypatch):
    """Call plans on SlangPy's kernel (small calls' default for a while), or switched to
    pydiff's generated kernel at their second call; returns which."""
    if request.param == "generated":
        request.getfixturevalue("second_call_generated")
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()
    return request.param


@pytest.fixture
def soon(monkeypatch):
    """Call plans of small layouts switch to generated kernels at their fourth call (1000 by
    default on lavapipe, never on a GPU); calls of 4096 elements and more are large. Returns
    ``pydiff.generated`` (its stats reset). Test files may define their own."""
    from pydiff import generated_switch

    monkeypatch.setattr(generated_switch, "PLANNED_AFTER", 3)
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER_ON_GPU", 3)
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 4096)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()
    return generated
