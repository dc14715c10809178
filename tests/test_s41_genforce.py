"""With generated kernels off (``PYDIFF_GENERATED=0``), a capture refusing a large call of a
user's function says so: its call plan declines a large call then, and the message named
every other reason but the switch (found running the whole suite under
``--pydiff-generated=force``, where every call counts as large)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from test_s39_capuser import SOURCE


@pytest.mark.usefixtures("auto_sizes")
def test_large_call_with_generated_kernels_off_names_the_switch(device, monkeypatch):
    mod = pydiff.load_module_from_source("s41_genforce", SOURCE, device=device)
    n = 5000  # past the default MIN_ELEMENTS (4096): a large call
    rng = np.random.default_rng(41)
    x = pydiff.tensor(rng.standard_normal(n).astype(np.float32), device=device)
    monkeypatch.setenv("PYDIFF_GENERATED", "0")
    y = mod.cu_sq(2.0, x, x, x, _result="tensor")  # a plan forms; SlangPy's kernel runs
    xs = x.numpy().astype(np.float64)
    np.testing.assert_allclose(y.numpy(), 2.0 * (xs * xs - xs) ** 2, rtol=1e-5, atol=1e-6)
    with pytest.raises(pydiff.CaptureError, match=r"cu_sq .*generated kernels are off"):
        pydiff.capture(lambda: mod.cu_sq(2.0, x, x, x, _result="tensor"))
