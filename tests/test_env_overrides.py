"""pydiff's debugging and tuning switches (environment variables) refuse values they do not
know, naming the variable: a typo must not silently leave the default it was meant to change.
Read at import (each case in a child process) or when a device opens."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    ("PYDIFF_DEFER", "maybe", "import pydiff"),
    ("PYDIFF_TAPE_BATCH", "2", "import pydiff"),
    ("PYDIFF_GENERATED_MIN_ELEMENTS", "4k", "import pydiff"),
    ("PYDIFF_GENERATED_PLANNED_AFTER", "bogus", "import pydiff"),
    ("PYDIFF_SWEEP_BATCHES", "always", "import pydiff; pydiff.create_device('vulkan')"),
    ("PYDIFF_RHI_VALIDATION", "enable", "import pydiff; pydiff.create_device('vulkan')"),
    ("PYDIFF_RAISE_NOFILE", "max", "import pydiff; pydiff.create_device('vulkan')"),
    ("PYDIFF_FLOAT4_STORES", "off", "import pydiff; pydiff.create_device('vulkan')"),
    ("PYDIFF_CACHE", "sometimes", "import pydiff; pydiff.compile_cache.root()"),
    ("PYDIFF_SLANGPY_TORCH", "perhaps", "import pydiff"),
    ("PYDIFF_GENERATED", "none", "import pydiff; pydiff.generated.enabled()"),
    (
        "PYDIFF_CACHE_MAX_MB",
        "1GB",
        "import pydiff, tempfile; pydiff.create_device('vulkan', cache_dir=tempfile.mkdtemp())",
    ),
    ("PYDIFF_CACHE_MAX_MB", "-5", "import pydiff; pydiff.compile_cache.max_bytes()"),
    ("PYDIFF_CACHE_MAX_MB", "nan", "import pydiff; pydiff.compile_cache.max_bytes()"),
]


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("name, value, code", CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_an_unknown_value_is_refused_naming_the_variable(device, name, value, code):
    if device.type != "vulkan":
        pytest.skip("the parsing is the same on every backend; checked once, on Vulkan")
    out = _run(code, {name: value})
    assert out.returncode != 0
    assert f"EnvironmentSettingError: {name}={value!r}: expected" in out.stderr, out.stderr[-2000:]


def test_the_documented_values_are_taken(device):
    if device.type != "vulkan":
        pytest.skip("checked once, on Vulkan")
    env = {
        "PYDIFF_DEFER": "off",
        "PYDIFF_TAPE_BATCH": "No",
        "PYDIFF_GENERATED": "true",
        "PYDIFF_GENERATED_MIN_ELEMENTS": "1_000",
        "PYDIFF_SWEEP_BATCHES": "yes",
        "PYDIFF_FLOAT4_STORES": "Float4",
        "PYDIFF_CACHE": "FALSE",
        "PYDIFF_CACHE_MAX_MB": " 2.5 ",
    }
    code = (
        "import pydiff; from pydiff import command_queue, compile_cache, generated, tape; "
        "d = pydiff.create_device('vulkan'); "
        "assert not command_queue.DEFER and not tape._BATCH and generated.enabled(); "
        "assert generated.MIN_ELEMENTS == 1000 and compile_cache.root() is None; "
        "assert compile_cache.max_bytes() == int(2.5 * 2**20); "
        "assert d.queue.sweep_batches and not d.kernels.paired_stores; print('taken')"
    )
    out = _run(code, env)
    assert out.stdout.strip() == "taken", out.stderr[-2000:]
