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
