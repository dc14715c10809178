"""A grid `.bwds` skips the store counts only where the text shows the grid index unchanged
(pydiff.single_store). An index changed through a subscript (``px[1] = 0``), a swizzle other
than one ``.x``/``.y``/``.z`` (``px.g = 0``, ``px.yx = ...``), an argument in parentheses
(``zero_it((idx))``) or a generic helper (``bump<int>(idx)``) made every thread store one
element: the race went unrefused and the gradient came out several times too large. So did a
macro from an ``#include`` (``RESET;`` with ``#define RESET idx = 0`` in a header), one defined
differently in ``#ifdef`` branches, and a local declared without a value that shadows the
index in a nested block (``{ int idx; y[idx] = a; }``)."""

from __future__ import annotations

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff.single_store import stores_once

SOURCE = """import slangpy;
void zero_it(inout int i) { i = 0; }
void bump<T>(inout int i) { i = 0; }
[Differentiable]
void sub2(int2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y)
{ px[1] = 0; y[px.y, px.x] = x[px.y, px.x]; }
[Differentiable]
void swzg(int2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y)
{ px.g = 0; y[px.y, px.x] = x[px.y, px.x]; }
[Differentiable]
void gen1(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ bump<int>(idx); y[idx] = x[idx]; }
[Differentiable]
void par1(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ zero_it((idx)); y[idx] = x[idx]; }
[Differentiable]
void shadow(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float a = x[idx]; { int idx; y[idx] = a; } }
[Differentiable]
void fine(int2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y)
{ int r = px.y; y[r, px.x] = 3.0 * x[min(r, 2), px.x]; }
"""


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s37_brk37b", SOURCE, device=device)


@pytest.mark.parametrize(
    "name,shape",
    [("sub2", (3, 4)), ("swzg", (3, 4)), ("gen1", (5,)), ("par1", (5,)), ("shadow", (5,))],
)
def test_an_index_changed_through_a_subscript_swizzle_or_helper_keeps_the_counts(
    device, mod, name, shape
):
    x = pydiff.tensor(np.ones(shape, np.float32), device=device, requires_grad=True)
    y = pydiff.zeros(shape, device=device).with_grads()
    y.grad.copy_from_numpy(np.ones(shape, np.float32))
    getattr(mod, name)(spy.grid(shape), x, y)
    with pytest.raises(ValueError, match="stored [0-9]+ times"):
        getattr(mod, name).bwds(spy.grid(shape), x, y)


def test_the_plain_pattern_is_still_skipped_and_right(device, mod):
    xs = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    up = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    assert stores_once(SOURCE, "fine", "px", 2, ["y"]) == {"y"}
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((3, 4), device=device).with_grads()
    y.grad.copy_from_numpy(up)
    mod.fine(spy.grid((3, 4)), x, y)
    np.testing.assert_allclose(y.numpy(), 3.0 * xs.astype(np.float64), rtol=1e-6)
    mod.fine.bwds(spy.grid((3, 4)), x, y)
    np.testing.assert_allclose(x.grad.numpy(), 3.0 * up.astype(np.float64), rtol=1e-6)


@pytest.mark.parametrize(
    "statement",
    ["px[0] = 0;", "px.r = 0;", "px.yx = px.xy;", "(px).y = 0;", "++(px.x);", "zero_it(px[1]);"],
)
def test_the_scan_sees_every_write_to_the_index(statement):
    src = SOURCE + (
        "void max(inout int a, int b) { a = b; }\n"
        "[Differentiable] void w(int2 px, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y)"
        f"{{ {statement} y[px.y, px.x] = x[px.y, px.x]; }}"
    )
    assert stores_once(src, "w", "px", 2, ["y"]) == frozenset()
    shadowed = SOURCE + (
        "void max(inout int a, int b) { a = b; }\n"
        "[Differentiable] void v(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)"
        "{ max(idx, 0); y[idx] = x[idx]; }"
    )
    assert stores_once(shadowed, "v", "idx", 1, ["y"]) == frozenset()


def test_a_macro_from_an_include_keeps_the_counts(device, tmp_path):
    (tmp_path / "h.slangh").write_text("#define RESET idx = 0\n")
    (tmp_path / "m.slang").write_text(
        'import slangpy;\n#include "h.slangh"\n[Differentiable]\n'
        "void inc1(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)\n"
        "{ RESET; y[idx] = x[idx]; }\n"
    )
    mod = pydiff.load_module(str(tmp_path / "m.slang"), device=device)
    x = pydiff.tensor(np.ones(5, np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((5,), device=device).with_grads()
    y.grad.copy_from_numpy(np.ones(5, np.float32))
    mod.inc1(spy.grid((5,)), x, y)
    np.testing.assert_allclose(y.numpy(), [1, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="stored 5 times"):
        mod.inc1.bwds(spy.grid((5,)), x, y)


def test_a_macro_defined_in_undecided_branches_keeps_the_counts():
    src = (
        "#ifdef FOO\n#define RESET idx = 0\n#else\n#define RESET\n#endif\n"
        "[Differentiable] void f(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)"
        "{ RESET; y[idx] = x[idx]; }"
    )
    assert stores_once(src, "f", "idx", 1, ["y"]) == frozenset()


STRIDED = """import slangpy;
[Differentiable]
void sq(int idx, float a, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[idx]; y[idx] = a * v * v; }
[Differentiable]
void sq_v(int1 i, float a, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ float v = x[i.x]; y[i.x] = a * v * v; }
"""


def test_a_strided_grid_at_a_scalar_index_is_refused_not_ignored(device):
    """SlangPy's grid loads a scalar index as the thread's id, dropping stride and offset:
    ``spy.grid((4,), stride=(2,), offset=(1,))`` wrote y[0..3] instead of y[1, 3, 5, 7]."""
    mod = pydiff.load_module_from_source("s37_brk37b_strided", STRIDED, device=device)
    xs = np.arange(1, 9, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    grid = spy.grid((4,), stride=(2,), offset=(1,))
    for _ in range(3):  # the full path, then where a plan could take it
        y = pydiff.zeros((8,), device=device)
        with pytest.raises(ValueError, match="'idx'.*ignoring stride and offset.*int1"):
            mod.sq(grid, 1.0, x, y)
        np.testing.assert_array_equal(y.numpy(), np.zeros(8))
    with pytest.raises(ValueError, match="ignoring stride"):
        mod.sq.bwds(grid, 1.0, x, pydiff.zeros((8,), device=device).with_grads())
    want = np.zeros(8)
    want[1::2] = xs[1::2].astype(np.float64) ** 2
    for _ in range(3):
        y = pydiff.zeros((8,), device=device)
        mod.sq_v(grid, 1.0, x, y)  # an int1 index takes them
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)
    y = pydiff.zeros((4,), device=device)
    mod.sq(spy.grid((4,)), 1.0, x, y)  # a plain grid is fine
    np.testing.assert_allclose(y.numpy(), xs[:4].astype(np.float64) ** 2, rtol=1e-6)


def test_a_namespaced_function_of_the_same_name_is_not_the_one_called(device, tmp_path):
    """``m.f`` is the imported module's racing ``f``; the scan read ``other::f``'s text."""
    (tmp_path / "brk37bhelp.slang").write_text(
        "import slangpy;\n[Differentiable]\n"
        "public void f(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)\n"
        "{ y[0] = x[idx]; }\n"
    )
    (tmp_path / "main.slang").write_text(
        "import slangpy;\n__exported import brk37bhelp;\nnamespace other {\n[Differentiable]\n"
        "void f(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)\n"
        "{ y[idx] = x[idx]; }\n}\n"
    )
    mod = pydiff.load_module(str(tmp_path / "main.slang"), device=device)
    x = pydiff.tensor(np.ones(5, np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((5,), device=device).with_grads()
    y.grad.copy_from_numpy(np.ones(5, np.float32))
    mod.f(spy.grid((5,)), x, y)
    np.testing.assert_allclose(y.numpy(), [1, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="stored 5 times"):
        mod.f.bwds(spy.grid((5,)), x, y)


def test_an_imported_overload_of_the_same_name_is_not_the_text_read(device, tmp_path):
    """``m.f(grid, x, y, 2.0)`` calls the imported racing overload; the scan read the
    module's own one-store ``f(idx, x, y)``."""
    (tmp_path / "brk37bhelp2.slang").write_text(
        "import slangpy;\n[Differentiable]\n"
        "public void f(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y, float a)\n"
        "{ y[0] = a * x[idx]; }\n"
    )
    (tmp_path / "main2.slang").write_text(
        "import slangpy;\n__exported import brk37bhelp2;\n[Differentiable]\n"
        "void f(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)\n"
        "{ y[idx] = x[idx]; }\n"
    )
    mod = pydiff.load_module(str(tmp_path / "main2.slang"), device=device)
    x = pydiff.tensor(np.ones(5, np.float32), device=device, requires_grad=True)
    y = pydiff.zeros((5,), device=device).with_grads()
    y.grad.copy_from_numpy(np.ones(5, np.float32))
    mod.f(spy.grid((5,)), x, y, 2.0)
    np.testing.assert_allclose(y.numpy(), [2, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="stored 5 times"):
        mod.f.bwds(spy.grid((5,)), x, y, 2.0)


UNSIZED = """import slangpy;
[Differentiable]
void s37_cp(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y) { y[idx] = 2.0 * x[idx]; }
void s37_sc(int idx, float s, IWTensor<float, 1> y) { y[idx] = s; }
"""


def test_a_grid_of_unknown_size_with_nothing_to_size_it_is_refused(device):
    """spy.grid((-1,)) takes the call's shape from vectorised arguments; with only whole
    tensors there is none, and SlangPy ran one thread (y = [2x0, 0, 0, ...]) silently."""
    m = pydiff.load_module_from_source("s37_unsized", UNSIZED, device=device)
    xs = np.arange(1, 9, dtype=np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((8,), device=device).with_grads(ones=True)
    for call in (m.s37_cp, m.s37_cp.bwds):
        with pytest.raises(ValueError, match=r"parameter 'idx'.*-1 size.*one thread"):
            call(spy.grid((-1,)), x, y)
    m.s37_cp(spy.grid((8,)), x, y)  # sized: every element
    np.testing.assert_array_equal(y.numpy(), 2.0 * xs)
    s = pydiff.tensor(xs * 10, device=device)
    out = pydiff.zeros((8,), device=device)
    m.s37_sc(spy.grid((-1,)), s, out)  # a vectorised argument sizes the call: accepted
    np.testing.assert_array_equal(out.numpy(), xs * 10)
