"""The persistent compile cache: never stale, never broken, bounded, and switchable.

Each case runs pydiff in fresh processes sharing one cache folder (the cache only matters
across processes), and checks values and gradients against closed forms."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pydiff import compile_cache

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("always")
    import numpy as np, pydiff
    m = pydiff.load_module(sys.argv[1])
    x = pydiff.tensor([2.0], requires_grad=True)
    y = m.f(x, _result="tensor")
    m.f.bwds(x, _result=y.with_grads(ones=True))
    print(json.dumps([float(y.numpy()[0]), float(x.grad.numpy()[0])]))
    """
)


def _run(
    code: str, cache: Path | str | None, *args: str, env: dict | None = None, device: str = "vulkan"
) -> tuple[object, str]:
    """Run ``code`` in a new process with the given cache folder; (its JSON output, stderr)."""
    full = {**os.environ, "PYDIFF_DEVICE": device, **(env or {})}
    if cache is not None:
        full["PYDIFF_CACHE_DIR"] = str(cache)
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
        cwd="/",  # not the checkout: `python -c` imports from the working folder first
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _keep_mtime(path: Path, text: str) -> None:
    """Rewrite a file, then give it back its old modification time (an edit the cache must
    see by content, not by time)."""
    st = path.stat()
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def backend(device):
    return device.type


def test_edits_of_a_module_its_imports_and_includes_take_effect(tmp_path, backend):
    cache = tmp_path / "cache"
    (tmp_path / "helper.slang").write_text("module helper;\npublic float scale() { return 1.0; }\n")
    (tmp_path / "inc.slang").write_text("#define OFFSET 10.0\n")
    main = tmp_path / "main.slang"
    main.write_text(
        'import helper;\n#include "inc.slang"\n'
        "[Differentiable] float f(float x) { return scale() * x * x + OFFSET; }\n"
    )
    assert _run(CHILD, cache, str(main), device=backend)[0] == [14.0, 4.0]  # cold
    assert _run(CHILD, cache, str(main), device=backend)[0] == [14.0, 4.0]  # warm
    _keep_mtime(tmp_path / "helper.slang", "module helper;\npublic float scale() { return 3.0; }\n")
    assert _run(CHILD, cache, str(main), device=backend)[0] == [22.0, 12.0]
    _keep_mtime(tmp_path / "inc.slang", "#define OFFSET 100.0\n")
    assert _run(CHILD, cache, str(main), device=backend)[0] == [112.0, 12.0]
    _keep_mtime(main, main.read_text().replace("x * x", "x * x * x"))
    assert _run(CHILD, cache, str(main), device=backend)[0] == [124.0, 36.0]


def test_an_upgrade_of_pydiffs_own_shaders_takes_effect(tmp_path, backend):
    """A copy of the package whose op_add changes between two runs on one cache."""
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "pydiff", pkg / "pydiff", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "shaders", pkg / "shaders")
    code = (
        "import json, pydiff\n"
        "assert pydiff.shader_dir().parent.name == 'pkg', pydiff.shader_dir()\n"
        "a, b = pydiff.tensor([1.0]), pydiff.tensor([2.0])\n"
        "print(json.dumps(float(pydiff.ops.add(a, b).numpy()[0])))\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(pkg), os.environ.get("PYTHONPATH", "")])}
    assert _run(code, tmp_path / "cache", env=env, device=backend)[0] == 3.0
    source = pkg / "shaders" / "ops" / "elementwise.slang"
    old = "op_add(float a, float b) { return a + b; }"
    assert old in source.read_text()
    _keep_mtime(source, source.read_text().replace(old, old.replace("a + b", "a + b + 100.0")))
    assert _run(code, tmp_path / "cache", env=env, device=backend)[0] == 103.0


def test_specialised_kernels_of_other_shapes_in_a_warm_cache(tmp_path, backend):
    code = textwrap.dedent(
        """
        import json, sys, numpy as np, pydiff
        n = int(sys.argv[1])
        rng = np.random.default_rng(n)
        X, W = rng.standard_normal((n, 8)), rng.standard_normal((4, 8))
        y = pydiff.ops.linear(pydiff.tensor(X), pydiff.tensor(W))
        print(json.dumps(float(np.abs(y.numpy() - X @ W.T).max())))
        """
    )
    for n in (8, 16, 8, 12):  # the same shapes again, and new ones, on one cache
        assert _run(code, tmp_path / "cache", str(n), device=backend)[0] < 1e-4


def test_damaged_cache_files_mean_a_recompile_and_one_warning(tmp_path, backend):
    main = tmp_path / "sq.slang"
    main.write_text("[Differentiable] float f(float x) { return x * x * x; }\n")
    cache = tmp_path / "cache"
    code = CHILD.replace(
        "m = pydiff", "pydiff.ops.add(pydiff.tensor([1.0]), pydiff.tensor([1.0]))\nm = pydiff"
    )
    assert _run(code, cache, str(main), device=backend)[0] == [8.0, 12.0]
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert any(p.suffix == ".slang-module" for p in files) and files
    for i, p in enumerate(files):  # garbage in some, truncation in the others
        p.write_bytes(os.urandom(100) if i % 2 == 0 else b"")
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    result, err = _run(code, cache, str(main), device=backend)
    assert result == [8.0, 12.0]
    assert err.count("CacheWarning") == 1 and "damaged" in err
    result, err = _run(code, cache, str(main), device=backend)  # repaired: quiet again
    assert result == [8.0, 12.0] and "CacheWarning" not in err


@pytest.mark.parametrize("kind", ["a file", "under /proc"])
def test_an_unusable_cache_folder_means_running_without_it(tmp_path, backend, kind):
    main = tmp_path / "sq.slang"
    main.write_text("[Differentiable] float f(float x) { return 3.0 * x; }\n")
    if kind == "a file":
        where = tmp_path / "not-a-folder"
        where.write_text("")
    else:
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc here")
        where = Path("/proc/pydiff-cache-test")
    result, err = _run(CHILD, where, str(main), device=backend)
    assert result == [6.0, 3.0]
    assert err.count("CacheWarning") == 1 and "running without it" in err


def test_switched_off_nothing_is_written(tmp_path, backend):
    main = tmp_path / "sq.slang"
    main.write_text("[Differentiable] float f(float x) { return x + 1.0; }\n")
    cache = tmp_path / "cache"
    result, err = _run(CHILD, cache, str(main), env={"PYDIFF_CACHE": "0"}, device=backend)
    assert result == [3.0, 1.0] and not cache.exists()
    info, _ = _run(
        "import json; from pydiff import compile_cache; print(json.dumps(compile_cache.usage()))",
        cache,
        env={"PYDIFF_CACHE": "0"},
        device=backend,
    )
    assert info["enabled"] is False


def test_two_processes_filling_one_cache_at_once(tmp_path, backend):
    cache = tmp_path / "cache"
    procs = []
    for k in (2.0, 5.0):
        src = tmp_path / f"m{int(k)}.slang"
        src.write_text(f"[Differentiable] float f(float x) {{ return {k} * x * x; }}\n")
        env = {**os.environ, "PYDIFF_DEVICE": backend, "PYDIFF_CACHE_DIR": str(cache)}
        procs.append(
            (
                k,
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, str(src)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        )
    for k, p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1]) == [4.0 * k, 4.0 * k]


def test_cli_reports_and_clears_the_cache(tmp_path, backend):
    main = tmp_path / "sq.slang"
    main.write_text("[Differentiable] float f(float x) { return x * x; }\n")
    cache = tmp_path / "cache"
    _run(CHILD, cache, str(main), device=backend)
    env = {**os.environ, "PYDIFF_CACHE_DIR": str(cache)}
    shown = subprocess.run(
        [sys.executable, "-m", "pydiff", "cache"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert str(cache) in shown.stdout and " MB" in shown.stdout
    cleared = subprocess.run(
        [sys.executable, "-m", "pydiff", "cache", "clear"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert cleared.returncode == 0 and "removed" in cleared.stdout
    assert compile_cache.size_of(cache) == 0


# --- no device needed ---------------------------------------------------------------------


def test_root_follows_argument_then_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("PYDIFF_CACHE", raising=False)
    monkeypatch.setenv("PYDIFF_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache.root() == tmp_path / "env"
    assert compile_cache.root(tmp_path / "arg") == tmp_path / "arg"
    assert compile_cache.root(False) is None
    monkeypatch.setenv("PYDIFF_CACHE", "off")
    assert compile_cache.root() is None
    assert compile_cache.root(tmp_path / "arg") == tmp_path / "arg"  # an explicit folder wins
    monkeypatch.delenv("PYDIFF_CACHE")
    monkeypatch.delenv("PYDIFF_CACHE_DIR")
    assert compile_cache.root() == compile_cache.default_root()


def test_bound_removes_least_recently_used_first(tmp_path):
    for i in range(5):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
    assert compile_cache.bound(tmp_path, limit=2500) == 3000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f3", "f4"]


def test_damaged_finds_bad_modules_and_databases(tmp_path):
    modules, shaders = tmp_path / "m", tmp_path / "s" / "rhi"
    modules.mkdir()
    shaders.mkdir(parents=True)
    good = b"RIFF" + (8).to_bytes(4, "little") + b"smod" + b"\0" * 4
    (modules / "good.slang-module").write_bytes(good)
    (modules / "short.slang-module").write_bytes(good[:-2])
    (modules / "junk.slang-module").write_bytes(b"junk" * 8)
    (shaders / "data.mdb").write_bytes(b"\0" * 64)  # no LMDB magic at offset 16
    (shaders / "lock.mdb").write_bytes(b"\0" * 64)
    removed = compile_cache.damaged(modules, tmp_path / "s")
    assert sorted(Path(p).name for p in removed) == [
        "data.mdb",
        "junk.slang-module",
        "short.slang-module",
    ]
    assert (modules / "good.slang-module").exists() and not (shaders / "lock.mdb").exists()


def test_a_module_importing_pydiff_shares_its_types(tmp_path, backend):
    """With a module cache, pydiff's library loaded by path was a second copy whose
    FwdDiffTensor<N> did not match the one a user's `import pydiff;` sees."""
    code = textwrap.dedent(
        """
        import json, numpy as np, slangpy as spy, pydiff
        m = pydiff.load_module(%r)
        rng = np.random.default_rng(0)
        W, X = rng.standard_normal((4, 6)), rng.standard_normal(6)
        w = pydiff.tensor(W, requires_grad=True).with_tangent(np.zeros((4, 6)))
        x = pydiff.tensor(X, requires_grad=True).with_tangent(np.ones(6))
        y = pydiff.zeros((4,))
        m.dense_tanh.fwds(spy.grid((4,)), w, x, y)
        z = W @ X
        want = (1 - np.tanh(z) ** 2) * W.sum(axis=1)
        print(json.dumps(float(np.abs(y.tangent.numpy() - want).max())))
        """
        % str(ROOT / "tests" / "shaders" / "forward.slang")
    )
    for _ in range(2):  # cold, then warm
        assert _run(code, tmp_path / "cache", device=backend)[0] < 1e-4
