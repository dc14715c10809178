"""The CUDA compile check (scripts/cuda_compile_check.py) and the kernel-source recording it
rests on (pydiff/kernel_sources.py, ``PYDIFF_KERNEL_SOURCES``).

The compile tests need ``nvcc`` and a ``slangc`` (``$PYDIFF_SLANGC``, or the one the script
fetches into its cache: ``pip download slangtorch``); without them they are skipped, saying
which is missing. Each
kernel is checked against what nvcc itself produces: a PTX file whose ``.entry`` is the
kernel's entry point, and a deliberately Vulkan-only kernel must fail.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

import pydiff
from pydiff import generated_helpers, kernel_sources
from pydiff.device import shader_dir
from pydiff.generated_source import backward_source, forward_source
from pydiff.kernels import KernelCache

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "cuda_compile_check", ROOT / "scripts/cuda_compile_check.py"
)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def _tools():
    # (where nvcc is, slangc is fetched once into the script's cache: pip download, 15 MB)
    slangc, nvcc, why = check.tools(download=True)
    if slangc is None or nvcc is None:
        pytest.skip(f"CUDA compile check unavailable: {why}")
    return slangc, nvcc


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_recording_is_off_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(kernel_sources.ENV, raising=False)
    kernel_sources.record("kernel", "k", "void f() {}", "f")
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "k.jsonl"
    monkeypatch.setenv(kernel_sources.ENV, str(out))
    kernel_sources.record("module", "m", "int g() { return 1; }")
    kernel_sources.record("kernel", "k", "void f() {}", "f")
    assert _records(out) == [
        {"kind": "module", "name": "m", "entry": None, "source": "int g() { return 1; }"},
        {"kind": "kernel", "name": "k", "entry": "f", "source": "void f() {}"},
    ]


def _cuda_form_kernels(tmp_path, monkeypatch) -> list[dict]:
    """Kernels in the forms a CUDA device compiles, recorded as pydiff builds them: two
    shader-library entry points and a generated forward and backward of the polynomial."""
    out = tmp_path / "k.jsonl"
    monkeypatch.setenv(kernel_sources.ENV, str(out))
    monkeypatch.setenv("PYDIFF_FLOAT4_STORES", "float4")
    monkeypatch.setenv("PYDIFF_KERNEL_SHAPES", "gpu")
    dev = pydiff.default_device()
    cache = KernelCache(dev.native, shader_dir(), dev.queue, typed_loads=False)
    cache.get("tensor_helpers.slang", "accumulate4")
    cache.get("optim/sgd.slang", "sgd_step4", CHUNK=1)
    recorded = _records(out)
    assert [r["entry"] for r in recorded] == ["accumulate4", "sgd_step4"]
    assert all("StructuredBuffer<float4>" in r["source"] for r in recorded)
    fn = pydiff.load_module(str(ROOT / "samples/polynomial.slang")).polynomial
    kinds = ("n", "n", "n", "t")
    for entry, source in (
        ("pydiff_gen_fwd", forward_source(fn, kinds, False, 256, False)),
        ("pydiff_gen_bwd", backward_source(fn, kinds, ((3,),), (), False, 256, False)),
    ):
        recorded.append({"kind": "kernel", "name": f"t_{entry}", "entry": entry, "source": source})
    return recorded


def test_library_and_generated_kernels_compile_for_cuda(tmp_path, monkeypatch):
    slangc, nvcc = _tools()
    kernels = _cuda_form_kernels(tmp_path, monkeypatch)
    modules = dict(generated_helpers.SOURCES)
    results = check.run_check(kernels, modules, slangc, nvcc, jobs=4)
    failed = [(r["name"], error) for r, ok, error, _ in results if not ok]
    assert failed == []
    assert len(results) == 4
    assert all(re.fullmatch(r"\d+ registers", note) for _, _, note, _ in results)


def test_a_vulkan_only_kernel_fails_with_its_error(tmp_path):
    slangc, nvcc = _tools()
    spirv_only = (
        '[shader("compute")][numthreads(32, 1, 1)]\n'
        "void only_spirv(uint3 t: SV_DispatchThreadID, uniform RWStructuredBuffer<uint> b)\n"
        "{ b[t.x] = spirv_asm { result:$$uint = OpBitReverse $(t.x) }; }\n"
    )
    fine = (
        '[shader("compute")][numthreads(32, 1, 1)]\n'
        "void fine(uint3 t: SV_DispatchThreadID, uniform RWStructuredBuffer<uint> b)\n"
        "{ b[t.x] = reversebits(t.x); }\n"
    )
    kernels = [
        {"kind": "kernel", "name": "spirv", "entry": "only_spirv", "source": spirv_only},
        {"kind": "kernel", "name": "fine", "entry": "fine", "source": fine},
    ]
    (bad, ok_bad, error, _), (_, ok_fine, _, _) = check.run_check(kernels, {}, slangc, nvcc, 2)
    assert not ok_bad and error.startswith("slangc:") and "error" in error
    assert ok_fine


def test_every_shader_entry_point_is_found():
    entries = {e for _, e in check.shader_entries()}
    # (an independent count: the attribute's occurrences in the files)
    count = sum(f.read_text().count('[shader("compute")]') for f in shader_dir().rglob("*.slang"))
    assert len(entries) == count
    assert {"accumulate4", "sgd_step4", "adamw_step4_multi", "mm_nt"} <= entries


def test_generated_calls_record_their_kernel_and_imports(tmp_path, monkeypatch):
    import numpy as np

    out = tmp_path / "k.jsonl"
    monkeypatch.setenv(kernel_sources.ENV, str(out))
    src = "[Differentiable]\nfloat cc51_cube(float x) { return x * x * x; }\n"
    m = pydiff.load_module_from_source("cc51_recorded", src)
    xs = np.linspace(-1, 1, 8192, dtype=np.float32)
    y = m.cc51_cube(pydiff.tensor(xs), _result="tensor")
    np.testing.assert_allclose(y.numpy(), xs.astype(np.float64) ** 3, rtol=1e-6, atol=1e-7)
    recorded = _records(out)
    modules = {r["name"]: r["source"] for r in recorded if r["kind"] == "module"}
    assert modules["cc51_recorded"] == src
    kernels = [r for r in recorded if r["kind"] == "kernel"]
    assert [r["entry"] for r in kernels] == ["pydiff_gen_fwd"]
    imported = set(re.findall(r"^import (\w+);", kernels[0]["source"], re.M))
    # every module the kernel imports is recorded, or is a file on the device's include paths
    assert "cc51_recorded" in imported
    for name in imported - {"cc51_recorded"}:
        assert name in modules or name in generated_helpers.SOURCES
