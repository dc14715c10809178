"""`pydiff check` on tensor functions: the second probe's size is not a multiple of 4, an
element's label names the Slang index a shader uses, and a trap warning is said once.

Before: every probe size was a multiple of 4 (4, 16 and the doublings), so a backward that
drops the tail of a 4-wide loop passed; labels were in NumPy order only (`w[6, 9]` for a
shader wrong at `int2(9, 6)`); and each ShaderTrapWarning printed twice in `pydiff check`
(at the load, then again when the forward-mode wrapper, which imports the module, loaded).
And a 1-D tensor's second probe was 15 elements, so a backward wrong only at index >= 16
(a second tile of 16) passed: it is 31 now (2-D stays 15, 3-D 7).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff
from pydiff.modcheck import check_module
from pydiff import tensorcheck_entries
from pydiff.tensorcheck_entries import larger_size
from test_s32_grid32 import BY_INDEX, WHOLE  # (x^2 by thread and summed, wrong by index)


def _check(tmp_path, device, name, source, **kw):
    path = tmp_path / f"{name}.slang"
    path.write_text(source)
    return check_module(path, device=device, **kw)


def _by_mode(rows):
    return {(r.function, r.parameter, r.mode): r for r in rows}


@pytest.mark.parametrize(
    "size, dims, expected",
    [
        *[(4, 1, 31), (8, 1, 31), (16, 1, 31)],  # 1-D: past a second tile of 16
        *[(4, 2, 15), (8, 2, 15), (4, 3, 7)],  # 15^2 and 7^3 within 1024, 31^2 and 15^3 not
        *[(32, 1, 39), (64, 1, 71), (16, 2, 23)],  # past LARGER_SIZES: the next 8k + 7
    ],
)
def test_the_larger_size_is_not_a_multiple_of_2_4_or_8(size, dims, expected):
    larger = larger_size(size, dims, 1024)
    assert larger == expected and larger > size and larger**dims <= 1024
    assert larger % 8 == 7  # a dropped tail of n % 2, n % 4 or n % 8 is as long as it gets


def test_no_larger_size_past_the_element_bound():
    assert larger_size(32, 2, 1024) is None  # 39^2 > 1024
    assert larger_size(4, 4, 1024) is None and larger_size(8, 3, 1024) is None
    assert larger_size(1024, 1, 1024) is None  # 1031 > 1024


#: sum of squares over the whole tensor plus x[LAST]^2, so that it needs LAST + 1 elements
#: (it reads past the end of any smaller size); the backward adds 4 elements a step and drops
#: the tail.
NEEDS_TAIL = """import slangpy;
[BackwardDerivative(tot_bwd)]
float tot_n(DiffTensor<float, 1> x)
{
    int n = x.shape[0];
    float s = 0.0;
    [MaxIters(1024)]
    for (int j = 0; j < n; j++) { float v = x.load(j); s += v * v; }
    float u = x.load(LAST);
    return s + u * u;
}
void tot_bwd(DiffTensor<float, 1> x, float dOut)
{
    int n = x._primal.shape[0];
    int m = n & ~3;
    [MaxIters(1024)]
    for (int j = 0; j < m; j++) { float v = x._primal.load(j); x._grad_out.add(j, 2.0 * v * dOut); }
    float u = x._primal.load(LAST);
    x._grad_out.add(LAST, 2.0 * u * dOut);
}
"""


@pytest.mark.parametrize(
    "needed, larger",
    [
        (16, 31),  # 1-D: LARGER_SIZES[1] is above 16, and 31 % 4 == 3
        (32, 39),  # past LARGER_SIZES[1]: the smallest size above 32 that is 8k + 7
    ],
)
def test_a_function_that_needs_16_still_gets_a_probe_past_multiples_of_4(
    tmp_path, device, needed, larger
):
    """Got: PASS (the first probe took 16, and no second probe ran)."""
    source = NEEDS_TAIL.replace("LAST", str(needed - 1))
    x = np.linspace(-1.0, 1.0, larger).astype(np.float32)
    t = pydiff.tensor(x, device=device).requires_grad_(True)
    module = pydiff.load_module_from_source(f"s33_tail{needed}_truth", source, device=device)
    module.tot_n.bwds(t, _result=1.0)
    truth = 2 * x.astype(np.float64)
    truth[needed - 1] *= 2
    assert not np.allclose(t.grad.numpy(), truth)  # the bug is real at the larger size
    backward = _by_mode(_check(tmp_path, device, f"tail{needed}", source))["tot_n", "x", "backward"]
    assert backward.status == "FAIL", backward
    assert f"{larger} per axis" in backward.why, backward.why


@pytest.mark.parametrize(
    "source, wrong_where, name",
    [(BY_INDEX, "i >= 16", "sq"), (WHOLE, "j >= 16", "total")],  # by thread; one loop
)
def test_a_1d_backward_wrong_only_in_a_second_tile_of_16_fails(
    tmp_path, device, source, wrong_where, name
):
    """Got: PASS at 15 per axis. A 1-D tensor's probes were 4 and 15 elements, so no index
    >= 16 existed in either: x[0..14] were all right, and so was every entry and the adjoint
    test. At 31 the 27 elements past the first 4 are all perturbed (``SAMPLED_ELEMENTS`` is
    32), x[16..30] among them."""
    x = np.linspace(0.5, 1.5, 31).astype(np.float32)
    module = pydiff.load_module_from_source(
        f"s33_tile16_{name}_truth", source.replace("WRONG_WHERE", wrong_where), device=device
    )
    t = pydiff.tensor(x, device=device).requires_grad_(True)
    if name == "sq":
        import slangpy as spy

        y = module.sq(spy.grid((31,)), t, _result="tensor")
        module.sq.bwds(spy.grid((31,)), t, _result=y.with_grads(ones=True))
    else:
        module.total.bwds(t, _result=1.0)
    wrong = np.flatnonzero(~np.isclose(t.grad.numpy(), 2 * x, rtol=1e-5))
    assert wrong.tolist() == list(range(16, 31))  # right below 16, wrong from 16 on
    path = tmp_path / f"tile16_{name}.slang"
    path.write_text(source.replace("WRONG_WHERE", wrong_where))
    backward = _by_mode(check_module(path, device=device))[name, "x", "backward"]
    assert backward.status == "FAIL", backward
    assert "31 per axis" in backward.why and "worst at x[" in backward.why, backward.why
    worst = int(backward.why.split("worst at x[")[1].split("]")[0])
    assert worst >= 16, backward.why


#: w[i]^2 over a 3-D grid; the backward handles the last axis 4 elements a step (vector x
#: is the last axis) and drops its tail.
TAIL_3D = """import slangpy;
[BackwardDerivative(c_bwd)]
float cube3(int3 i, DiffTensor<float, 3> w) { float v = w.load(i); return v * v; }
void c_bwd(int3 i, DiffTensor<float, 3> w, float dOut)
{
    float v = w._primal.load(i);
    int n = w._primal.shape[2];
    if (i.x < (n & ~3)) w._grad_out.add(i, 2.0 * v * dOut);
}
"""


def test_a_3d_backward_dropping_a_tail_fails(tmp_path, device):
    """Got: PASS at 4 and 8 per axis."""
    backward = _by_mode(_check(tmp_path, device, "tail3d", TAIL_3D))["cube3", "w", "backward"]
    assert backward.status == "FAIL", backward
    assert "7 per axis" in backward.why, backward.why


def test_element_labels_name_the_slang_vector_index():
    assert (
        tensorcheck_entries.element_label("x", (5,), "y", "4 per axis")
        == "x[5] (output y, 4 per axis)"
    )
    label = tensorcheck_entries.element_label("w", (1, 2, 3), "(result)", "7 per axis")
    assert label == "w[1, 2, 3] (Slang index int3(3, 2, 1); output (result), 7 per axis)"


#: w[i]^2 over a 2-D grid; the backward is 3 w instead of 2 w at the thread int2(2, 1) only.
ONE_WRONG_2D = """import slangpy;
[BackwardDerivative(s_bwd)]
float sq2(int2 i, DiffTensor<float, 2> w) { float v = w.load(i); return v * v; }
void s_bwd(int2 i, DiffTensor<float, 2> w, float dOut)
{
    float v = w._primal.load(i);
    w._grad_out.add(i, ((i.x == 2 && i.y == 1) ? 3.0 : 2.0) * v * dOut);
}
"""


def test_a_2d_element_is_named_as_the_shader_indexes_it(tmp_path, device):
    """Got: 'worst at w[1, 2] (output (result), ...)', NumPy order only: a reader of the
    shader looks for int2(2, 1)."""
    import slangpy as spy

    w = np.random.default_rng(0).uniform(0.5, 1.5, (4, 4)).astype(np.float32)
    t = pydiff.tensor(w, device=device).requires_grad_(True)
    m = pydiff.load_module_from_source("s33_one_wrong_truth", ONE_WRONG_2D, device=device)
    y = m.sq2(spy.grid((4, 4)), t, _result="tensor")
    m.sq2.bwds(spy.grid((4, 4)), t, _result=y.with_grads(ones=True))
    wrong = np.argwhere(~np.isclose(t.grad.numpy(), 2 * w, rtol=1e-5))
    assert wrong.tolist() == [[1, 2]]  # NumPy's w[1, 2] is the shader's int2(2, 1)
    backward = _by_mode(_check(tmp_path, device, "one_wrong", ONE_WRONG_2D))["sq2", "w", "backward"]
    assert backward.status == "FAIL", backward
    assert "worst at w[1, 2] (Slang index int2(2, 1);" in backward.why, backward.why


#: two functions with a pow of a base that may be negative: a load-time ShaderTrapWarning each.
TRAPS = """import slangpy;
[Differentiable]
float pw(float x, float n) { return pow(x, n) + x; }
[Differentiable]
float pw2(float x, float n) { return pow(x, n) * x; }
"""


def _trap_warnings(caught, function):
    return [
        w
        for w in caught
        if issubclass(w.category, pydiff.ShaderTrapWarning) and f"in {function}()" in str(w.message)
    ]


def test_pydiff_check_says_each_trap_warning_once(tmp_path, device):
    """Got: two of each (at the load, and again at the first forward-mode wrapper's)."""
    path = tmp_path / "s33_traps.slang"
    path.write_text(TRAPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_module(path, device=device)
    assert len(_trap_warnings(caught, "pw")) == 1, [str(w.message) for w in caught]
    assert len(_trap_warnings(caught, "pw2")) == 1, [str(w.message) for w in caught]


def test_loading_a_module_still_warns_about_its_traps(tmp_path, device):
    path = tmp_path / "s33_traps_load.slang"
    path.write_text(TRAPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = pydiff.load_module(path, device=device)
    assert len(_trap_warnings(caught, "pw")) == len(_trap_warnings(caught, "pw2")) == 1
    with warnings.catch_warnings(record=True) as caught:  # its forward mode: said already
        warnings.simplefilter("always")
        m.pw.fwds((0.5, 1.0), 2.0)  # x = 0.5 with tangent 1
    assert not _trap_warnings(caught, "pw"), [str(w.message) for w in caught]
