"""Lead's small fixes of the twenty-fourth session, each checked against an independent
reference (closed forms in NumPy)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from test_s34_grid2d import SOURCE as GRID_SOURCE, _blur64  # (its clamped stencil)

# (test_s34_grid2d's source has vector-index helpers the scan warns of: not these tests' point)
pytestmark = pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")

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


STENCIL = (
    GRID_SOURCE
    + """
float s44_left(int i, Tensor<float, 1> v) { return v[max(i - 1, 0)] * 2.0; }
"""
)


@pytest.mark.parametrize("path", ["generated", "slangpy"])
def test_a_stencil_writing_the_image_it_reads_gives_the_math(device, forced, path):
    """``blur(grid, a, img, img)``: results stored while neighbours are read. Was a race
    (max error 0.69 against the float64 stencil); the read side now reads a copy."""
    import slangpy as spy

    forced.setenv("PYDIFF_GENERATED", "1" if path == "generated" else "0")
    m = pydiff.load_module_from_source("s44_lead_stencil", STENCIL, device=device)
    xs = np.random.default_rng(5).standard_normal((64, 48)).astype(np.float32)
    for _ in range(2):  # (a second call: any plan made by the first)
        img = pydiff.tensor(xs, device=device)
        m.blur(spy.grid((64, 48)), 1.5, img, img)
        np.testing.assert_allclose(img.numpy(), _blur64(xs, 1.5), rtol=1e-5, atol=1e-5)
    # A whole-tensor read of the storage _result writes: the same.
    v = np.arange(1, 301, dtype=np.float32)
    t = pydiff.tensor(v, device=device)
    m.s44_left(pydiff.arange(300, device=device).astype("int"), t, _result=t)
    np.testing.assert_array_equal(t.numpy(), 2.0 * np.concatenate([[1.0], v[:-1]]))


def test_a_racing_read_with_gradients_off_a_tape_is_refused(device):
    import slangpy as spy

    m = pydiff.load_module_from_source("s44_lead_stencil", STENCIL, device=device)
    img = pydiff.tensor(np.ones((8, 8), np.float32), device=device).requires_grad_()
    with pytest.raises(ValueError, match=r"parameter 'result'.*parameter 'img'.*race"):
        m.blur(spy.grid((8, 8)), 1.5, img, img)


def test_grad_of_an_integer_result_is_refused(device):
    """breakC44 found ``pydiff.grad`` of a function returning an int tensor gave zeros
    (torch refuses: an integer has no derivative)."""
    from pydiff import ops

    x = pydiff.tensor(np.array([1.0, -3.0], np.float32), device=device)
    with pytest.raises(TypeError, match="dtype int, which has no derivative"):
        pydiff.grad(lambda t: ops.sum(ops.mul(t, t)).astype("int"))(x)
    # the float result's gradient is the closed form 2x
    g = pydiff.grad(lambda t: ops.sum(ops.mul(t, t)))(x)
    np.testing.assert_array_equal(g.numpy(), [2.0, -6.0])
