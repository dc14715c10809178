"""Lead's small fixes of the twenty-fourth session, each checked against an independent
reference (closed forms in NumPy)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

DEFAULTS = """
[Differentiable] float s44_scaled(float x, float k = 2.0) { return k * x; }
"""


def test_missing_argument_with_a_slang_default_says_defaults_are_not_applied(device):
    m = pydiff.load_module_from_source("s44_lead_defaults", DEFAULTS, device=device)
    x = pydiff.tensor(np.arange(4, dtype=np.float32), device=device)
    with pytest.raises(TypeError, match=r"missing argument\(s\): k .*default values"):
        m.s44_scaled(x)
    # Passed explicitly, the value is the closed form's.
    np.testing.assert_array_equal(m.s44_scaled(x, 3.0).numpy(), 3.0 * np.arange(4))


def test_int_tensor_sums_are_exact_or_refused(device):
    rng = np.random.default_rng(4)
    small = rng.integers(-1000, 1000, size=(37, 5)).astype(np.int32)
    x = pydiff.tensor(small, device=device)
    # Within 2**24 every partial sum is an exact float32: equal to NumPy's int64 sums.
    assert float(x.sum().numpy()) == small.astype(np.int64).sum()
    np.testing.assert_array_equal(x.sum(axis=0).numpy(), small.astype(np.int64).sum(axis=0))
    np.testing.assert_allclose(x.mean().numpy(), small.mean(), rtol=1e-6)
    # 3 * (2**24 + 1) rounds to 3 * 2**24 in float32: refused, naming the shape and the way out.
    big = pydiff.tensor(np.full(3, 2**24 + 1, dtype=np.int32), device=device)
    with pytest.raises(ValueError, match=r"x\.sum\(\).*shape \(3,\).*past 2\*\*24"):
        big.sum()
    with pytest.raises(ValueError, match=r"x\.mean\(\)"):
        big.mean(axis=0)
    unsigned = pydiff.tensor(np.array([2**31, 2**31], dtype=np.uint32), device=device)
    with pytest.raises(ValueError, match="uint tensor"):
        unsigned.sum()
