"""The open-file limit: on lavapipe every device buffer holds a file descriptor, so many live
tensors reach RLIMIT_NOFILE. An allocation that fails there says so (OpenFileLimitError,
not "out of memory"), and opening a Vulkan device raises the soft limit towards the hard one.
Each case runs in a child process, whose limits it may lower for good."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOCATE = """
import errno, resource
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
import pydiff
dev = pydiff.create_device("vulkan")
m = pydiff.load_module_from_source("open_files", "int twice(int a) { return a * 2; }", device=dev)
x = pydiff.tensor([1, 2], dtype="int", device=dev)
keep = []
try:
    while len(keep) < 5000:
        keep.append(m.twice(x))  # a result buffer of SlangPy's each
    print("no error")
except pydiff.OpenFileLimitError as exc:
    assert exc.errno == errno.EMFILE and isinstance(exc, OSError)
    print(len(keep), exc)
keep.clear()  # the descriptors come back with the tensors, once the work binding them ran
pydiff.empty_cache()
print("then", m.twice(x).numpy().tolist())
"""

LIMIT = """
import resource
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
import pydiff
pydiff.create_device("vulkan")
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _linux_vulkan(device) -> None:
    if device.type != "vulkan" or not os.path.isdir("/proc/self/fd"):
        pytest.skip("the open-file limit of lavapipe's buffers: Vulkan on Linux")


def test_allocation_at_the_open_file_limit_says_so(device):
    _linux_vulkan(device)
    # (SlangPy's path making each result: an int result, which SlangPy's call makes; new
    # float results come from pydiff's pool, whose buffers hold no descriptor, and would not
    # reach the limit; PYDIFF_DEFER=0 keeps SlangPy's own call)
    out = _run(ALLOCATE, PYDIFF_RAISE_NOFILE="off", PYDIFF_GENERATED="0", PYDIFF_DEFER="0")
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout + out.stderr[-2000:]
    count, message = lines[0].split(" ", 1)
    assert 100 < int(count) < 300
    assert "[Errno 24]" in message and "could not allocate a buffer" in message
    assert "open files of its limit of 300 (RLIMIT_NOFILE)" in message
    assert "each device buffer on lavapipe holds one" in message
    assert "ulimit -n" in message and "retain_graph=False" in message
    assert "pydiff.empty_cache()" in message
    assert "out of memory" not in message
    assert lines[1] == "then [2, 4]"


def test_opening_a_vulkan_device_raises_the_soft_limit(device):
    _linux_vulkan(device)
    with open("/proc/sys/vm/max_map_count") as f:
        cap = int(f.read()) // 2  # lavapipe's mappings crash past max_map_count: kept below
    soft, hard = (int(v) for v in _run(LIMIT).stdout.split())
    import resource

    want = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    assert soft == max(300, want)
    soft, _ = (int(v) for v in _run(LIMIT, PYDIFF_RAISE_NOFILE="no").stdout.split())
    assert soft == 300
