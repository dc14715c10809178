"""The fast kernels' backend differences, tested without a GPU: pydiff's kernels read float4
buffers through typed views on Vulkan and through structured ones on CUDA/D3D12, and a GPU
takes other kernel shapes than lavapipe (one float4 per thread, small register blocks, no
one-kernel narrow backward: kernels.py) and stores a float4 at once (lavapipe: as two 64-bit
words). Running the fast-path tests (capture, ops, optimizers) on Vulkan with
``PYDIFF_FLOAT4_LOADS=structured``, ``PYDIFF_KERNEL_SHAPES=gpu``, ``PYDIFF_FLOAT4_CHUNK=1`` and
``PYDIFF_FLOAT4_STORES=float4`` runs the source, buffers and shapes a GPU gets, against the
same NumPy references."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pydiff
from pydiff.buffer_pool import typed_float4_loads

ROOT = Path(__file__).resolve().parents[1]


def test_the_load_kind_is_the_only_backend_choice(monkeypatch):
    assert typed_float4_loads("vulkan")
    for other in ("cuda", "d3d12", "metal"):
        assert not typed_float4_loads(other)
    monkeypatch.setenv("PYDIFF_FLOAT4_LOADS", "structured")
    assert not typed_float4_loads("vulkan")


def test_float_tensors_are_float4_ready_on_every_backend(device):
    from pydiff.tensor import float4_ready

    x = pydiff.zeros((7,), device=device)
    assert float4_ready(x)  # padded to whole float4s, at the start of its buffer


def test_fast_paths_as_a_gpu_runs_them(device):
    if device.type != "vulkan":
        pytest.skip("the structured variant is what this backend runs natively")
    env = {
        **os.environ,
        "PYDIFF_FLOAT4_LOADS": "structured",
        "PYDIFF_KERNEL_SHAPES": "gpu",
        "PYDIFF_FLOAT4_CHUNK": "1",
        "PYDIFF_FLOAT4_STORES": "float4",
        "PYDIFF_DEVICE_TYPES": "vulkan",
    }
    tests = [
        "tests/test_capture.py",
        "tests/test_optim.py",
        "tests/test_generated.py",
        "tests/test_float4_stores.py",
        "tests/test_ops.py::test_fast_product_kernels_match_numpy",
        "tests/test_ops.py::test_linear_relu_fused_matches_numpy",
        "tests/test_ops.py::test_cross_entropy_large_batch_matches_numpy_bit_for_bit_across_runs",
        "tests/test_ops.py::test_narrow_linear_backward_matches_the_two_products",
    ]
    probe = (
        "import pydiff, slangpy as spy; d = pydiff.create_device('vulkan'); "
        "x = pydiff.zeros((5,), device=d); from pydiff.tensor import float4_ready; "
        "assert not d.typed_loads and float4_ready(x); "
        "assert d.kernels.gpu and d.kernels.chunk == 1 and not d.kernels.paired_stores; "
        "assert x.native.storage.desc.format == spy.Format.undefined; print('structured')"
    )
    seen = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert seen.stdout.strip() == "structured", seen.stderr[-2000:]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
