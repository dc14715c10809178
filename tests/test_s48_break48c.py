"""Session 48 (break48c): in-place methods return ``self``, so a temporary copy whose result
the caller keeps (``t = x[1:3].fill(3.0)``, ``f(x[1:3].zero_())``) is written where it is seen
and must not be refused; a dropped one still is. References: NumPy on the same values."""

import numpy as np
import pytest

import pydiff
from pydiff import temporary_copies


def _t(a, device):
    return pydiff.tensor(np.asarray(a, np.float32), device=device)


def test_fill_result_kept_is_not_refused(device):
    if not temporary_copies.ENABLED:
        pytest.skip("reference counts do not tell temporaries apart here")
    ref = np.arange(6.0, dtype=np.float32)
    x = _t(ref, device)
    t = x[1:3].fill(3.0)
    np.testing.assert_array_equal(t.numpy(), np.full(2, 3.0))
    np.testing.assert_array_equal(x[2:5].zero_().numpy(), np.zeros(3))
    u = x.T.copy_(_t(np.ones(6), device))
    np.testing.assert_array_equal(u.numpy(), np.ones(6))
    v = x[0:2].copy_from_numpy(np.array([7.0, 8.0], np.float32))
    np.testing.assert_array_equal(v.numpy(), [7.0, 8.0])
    np.testing.assert_array_equal(x.numpy(), ref)  # (copies: x unchanged)


def test_fill_result_dropped_still_refused(device):
    if not temporary_copies.ENABLED:
        pytest.skip("reference counts do not tell temporaries apart here")
    x = _t(np.arange(6.0), device)
    with pytest.raises(TypeError, match="temporary copy"):
        x[1:3].fill(3.0)
    with pytest.raises(TypeError, match="temporary copy"):
        _ = x[1:3].zero_()
    with pytest.raises(TypeError, match="temporary copy"):
        x.T.zero_()
    with pytest.raises(TypeError, match="temporary copy"):
        x[1:3][0] = 1.0


SOURCE = """
void scale(inout float x) { x = 2 * x; }
"""


def _scale_named(m, x, star):
    y = x[1:3]
    if star:
        m.scale(*[y])
    else:
        m.scale(y)
    return y.numpy()


def test_named_copy_through_star_call_not_refused(device):
    m = pydiff.load_module_from_source("s48_break48c", SOURCE, device=device)
    x = _t(np.arange(6.0), device)
    np.testing.assert_array_equal(_scale_named(m, x, star=True), 2 * np.arange(1.0, 3.0))


def test_named_copy_under_tracer_not_refused(device):
    import sys

    m = pydiff.load_module_from_source("s48_break48c", SOURCE, device=device)
    x = _t(np.arange(6.0), device)

    def tracer(frame, event, arg):
        frame.f_locals  # (as a debugger does)
        return None

    sys.settrace(tracer)
    try:
        got = _scale_named(m, x, star=False)
    finally:
        sys.settrace(None)
    np.testing.assert_array_equal(got, 2 * np.arange(1.0, 3.0))
    np.testing.assert_array_equal(x.numpy(), np.arange(6.0))
