"""MDB_BAD_RSLOT: two processes sharing one compile cache (pytest-xdist workers, ranks), one
of which opens a second device on that cache (other include paths).

The second device's cache check used to open and close the shader database's ``lock.mdb``
that the first device held: closing any descriptor of it drops the process's LMDB locks, the
other process then took the first for gone and freed its reader slot, and every later lookup
and store of the first process failed (``Failed to query cache ... MDB_BAD_RSLOT``): noise on
stderr, and each kernel compiled again, in that run and the next. (In the suite: a worker ran
tests/test_s40_percall.py, whose second device compiles nothing, so nothing took the locks
again, while the other worker opened devices.) Now each device
of a process has its own shader database, and only one no device of the process holds is
checked. Gradients are checked against closed forms (d/dx k*x^2 = 2*k*x)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pydiff import compile_cache

# argv: cache folder, role ("A" opens two devices and starts "B" between its kernels).
SCRIPT = textwrap.dedent(
    """
    import json, subprocess, sys, tempfile
    import numpy as np, pydiff
    cache, role, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    SRC = "[Differentiable] float f%d(float x) { return x * x * %d.0; }"
    grads = []
    def use(dev, i):
        m = pydiff.load_module_from_source(f"rslot_{role}_{i}", SRC % (i, i + 1), device=dev)
        x = pydiff.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True, device=dev)
        y = getattr(m, f"f{i}")(x=x, _result="tensor")
        getattr(m, f"f{i}").bwds(x=x, _result=y.with_grads(ones=True))
        grads.append([i, x.grad.numpy().tolist()])
    if role == "B":
        use(pydiff.create_device(kind, cache_dir=cache), 7)
    else:
        first = pydiff.create_device(kind, cache_dir=cache)
        use(first, 0)
        pydiff.create_device(kind, include_paths=[tempfile.mkdtemp()], cache_dir=cache)
        out = subprocess.run([sys.executable, __file__, cache, "B", kind], capture_output=True,
                             text=True, timeout=300)
        sys.stderr.write(out.stderr)
        assert out.returncode == 0, out.stderr[-2000:]
        grads += json.loads(out.stdout.strip().splitlines()[-1])
        use(first, 1)
        use(first, 2)
    print(json.dumps(grads))
    """
)


@pytest.fixture
def backend(device):
    return device.type


def _run(script: Path, cache: Path, kind: str) -> tuple[list, str]:
    out = subprocess.run(
        [sys.executable, str(script), str(cache), "A", kind],
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",  # not the checkout: pydiff comes from PYTHONPATH / the installed package
        env={k: v for k, v in os.environ.items() if not k.startswith("PYDIFF_CACHE")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout + out.stderr


def _databases(cache: Path) -> list[str]:
    return [str(p.relative_to(cache)) for p in sorted(cache.rglob("data.mdb"))]


def test_a_second_device_keeps_the_shader_cache_of_both_processes(tmp_path, backend):
    script = tmp_path / "rslot.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "cache"
    grads, output = _run(script, cache, backend)
    assert "MDB_" not in output and "Failed to" not in output, output[-3000:]
    x = [1.0, 2.0, 3.0]
    assert sorted(grads) == sorted([i, [2.0 * (i + 1) * v for v in x]] for i in (0, 1, 2, 7))
    stored = _databases(cache)
    assert len(stored) == 2, stored  # the first device's database and the second's
    # The second run opens the same databases (each device its own again), without errors.
    again, output = _run(script, cache, backend)
    assert "MDB_" not in output and "Failed to" not in output, output[-3000:]
    assert sorted(again) == sorted(grads)
    assert _databases(cache) == stored


def test_each_device_of_a_process_gets_its_own_shader_database(tmp_path):
    cache, link = tmp_path / "cache", tmp_path / "link"
    link.symlink_to(cache)
    first = compile_cache.prepare(cache, "vulkan")
    second = compile_cache.prepare(cache, "vulkan")
    third = compile_cache.prepare(link, "vulkan")  # the same folder by another name
    assert first is not None and second is not None and third is not None
    assert first[0] == second[0]  # compiled modules are files: shared
    shaders = [Path(p[1]).name for p in (first, second, third)]
    assert shaders == ["shaders", "shaders-2", "shaders-3"]
    Path(first[1], "rhi").mkdir()
    (Path(first[1]) / "rhi" / "data.mdb").write_bytes(b"held by the first device")
    # A device that failed to open gives its database back, and removes only that one.
    compile_cache.discard_new(third)
    assert not Path(third[1]).exists()
    assert (Path(first[1]) / "rhi" / "data.mdb").exists() and Path(second[1]).is_dir()
    assert Path(compile_cache.prepare(cache, "vulkan")[1]).name == "shaders-3"
