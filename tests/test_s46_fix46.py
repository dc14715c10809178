"""Session 46 (fix46): eviction of kernels keeps the plans of the others; races of grid
calls reading neighbours of a tensor they write; captured inputs re-bound while a retained
tape keeps the old ones; forward-mode tangents of Python-number primals. References: float64
NumPy, closed forms and central differences, never pydiff's own output."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import kernels as kernels_module
from pydiff import ops


def _matmul_checked(device, m, k, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = ops.matmul(pydiff.tensor(a, device=device), pydiff.tensor(b, device=device)).numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def _plans_of(device, n):
    """The product plans of (40, 12, n) products (their kernel's N define is n)."""
    return {
        key: plan
        for key, plan in device.kernels.plans.items()
        if plan and key[:5] == ("product", "mm_nn", 40, n, 12)
    }


def test_eviction_drops_only_the_evicted_kernels_plans(device, monkeypatch):
    monkeypatch.setattr(kernels_module, "KERNELS_MAX", 3)
    kernels = device.kernels
    kernels.plans.clear()
    built: list = []
    real = kernels._build  # noqa: SLF001 (counting the cache's own builds)

    def build(file, entry, defines):
        built.append(defines.get("N"))
        return real(file, entry, defines)

    monkeypatch.setattr(kernels, "_build", build)
    _matmul_checked(device, 40, 12, 4, 0)
    first = _plans_of(device, 4)
    assert first
    for seed, n in enumerate((8, 12)):  # two more kernels: the cache is full, none evicted
        _matmul_checked(device, 40, 12, n, 1 + seed)
    _matmul_checked(device, 40, 12, 4, 3)  # the first one used again: the most recent
    kept = _plans_of(device, 4)
    assert kept == first and all(kept[k] is first[k] for k in kept)
    before = len(built)
    _matmul_checked(device, 40, 12, 16, 4)  # a new kernel evicts N=8's (the oldest), only it
    assert len(built) == before + 1
    survivors = _plans_of(device, 4)
    assert survivors and all(survivors[k] is first[k] for k in survivors)  # (not planned again)
    assert _plans_of(device, 12) and not _plans_of(device, 8)
    held = {plan[0] for plan in kernels.plans.values() if plan}
    assert held <= set(kernels._kernels)  # noqa: SLF001 (no plan outlives its kernel)
    _matmul_checked(device, 40, 12, 8, 5)  # planned and built again, still right
    assert built[-1] == 8 and _plans_of(device, 8)
    _matmul_checked(device, 40, 12, 4, 6)
    assert kernels.sizes()["kernels"] <= 3
