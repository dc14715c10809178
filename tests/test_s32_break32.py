"""What a user sees of the bound objects planned generated calls keep (planned_kernels'
``held``): ``pydiff.empty_cache()`` promises to release the buffers of freed tensors and the
bound shader objects kept for reuse (docs/tensors-and-gradients.md, docs/ops-and-optimizers.md
"Memory"); a call plan's held object must not keep a freed tensor's buffer past it."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_switch

SOURCE = """
[Differentiable] float s32b_affine(float a, float b, float x, float y) { return a * x * y + b * y; }
"""


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s32_break32", SOURCE, device=device)


@pytest.fixture
def soon(monkeypatch):
    """Plans switch to generated kernels at their second call."""
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER", 1)
    monkeypatch.setattr(generated_switch, "PLANNED_AFTER_ON_GPU", 1)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()


@pytest.mark.parametrize("n", [16, 8192])  # a small call, and a large one (planned at once)
def test_empty_cache_releases_buffers_of_freed_tensors_after_planned_calls(device, mod, soon, n):
    x = pydiff.tensor(np.linspace(-1, 1, n).astype(np.float32), device=device, requires_grad=True)
    y = pydiff.tensor(np.full(n, 2.0, np.float32), device=device, requires_grad=True)
    for _ in range(4):
        out = mod.s32b_affine(1.5, 0.5, x, y, _result="tensor").with_grads(ones=True)
        mod.s32b_affine.bwds(1.5, 0.5, x, y, _result=out)
    np.testing.assert_allclose(x.grad.numpy(), np.full(n, 4 * 1.5 * 2.0), rtol=1e-6)
    assert generated.stats().get("forward", 0) >= 2, "the planned generated kernel ran"
    assert generated.stats().get("backward", 0) >= 2
    control = pydiff.tensor(np.zeros(n, np.float32), device=device)  # never in a call
    kept = [x.buffer, y.buffer, out.buffer, x.grad.buffer, y.grad.buffer]
    unused = control.buffer
    del x, y, out, control
    gc.collect()
    pydiff.empty_cache(device)
    gc.collect()
    # A freed tensor's buffer we still refer to is referred to as an unused one is (ours,
    # the pool's); more references mean something pydiff keeps (a call plan's held object)
    # still pins its device memory past empty_cache.
    refs = [sys.getrefcount(b) for b in [*kept, unused]]
    assert refs[:-1] == refs[-1:] * len(kept), f"references (the unused one last): {refs}"
