"""Tensors a call writes only in part, or overwrites on a tape. In place (IRWDiffTensor): the
elements it does not write pass their upstream gradient through, in explicit .bwds and on
tapes. Write-only (out, IWDiffTensor, _result) on a tape: the value before the call gets no
gradient where the call wrote it. References are closed forms in float64 NumPy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pydiff

_names = itertools.count()

SOURCE = """
import slangpy;
[Differentiable] void sq_one(int i, IRWDiffTensor<float, 1> data) { data[i] = data[i] * data[i]; }
[Differentiable] void sq_even(int i, IRWDiffTensor<float, 1> data)
{
    int k = 2 * i;
    data[k] = data[k] * data[k];
}
[Differentiable] void times_other(int i, int j, IRWDiffTensor<float, 1> data)
{
    data[i] = data[i] * data[j];
}
[Differentiable] void same_bits(int i, IRWDiffTensor<float, 1> data) { data[i] = data[i] * 1.0; }
[Differentiable] void row_first(int i, IRWDiffTensor<float, 2> data)
{
    data[i, 0] = data[i, 1] * data[i, 0];
}
[Differentiable] void vec_one(int i, IRWDiffTensor<float3, 1> data) { data[i] = data[i] * data[i]; }
[Differentiable] void conc(int i, RWDiffTensor<float, 1> data) { data[i] = data[i] * data[i]; }
[Differentiable] float times(float a, float b) { return a * b; }
[Differentiable] void dbl_one(int i, IRWDiffTensor<float, 1> data) { data[i] = 2.0 * data[i]; }
[Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
[Differentiable] void add_one(inout float v) { v = v + 1.0; }
[Differentiable] float sq(float a) { return a * a; }
[Differentiable] float twice(float v) { return 2.0 * v; }
[Differentiable] void put(float v, out float o) { o = 3.0 * v; }
[Differentiable] void w_one(int i, float v, IWDiffTensor<float, 1> o) { o[i] = v * 2.0; }
[Differentiable] void w_conc(int i, float v, WDiffTensor<float, 1> o) { o[i] = v * 2.0; }
"""


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source(f"irw_partial_{next(_names)}", SOURCE, device=device)


def leaf(device, values):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=True)


X = np.array([0.5, -1.5, 2.0, 3.0], np.float64)
U = np.array([1.0, 2.0, -3.0, 0.5], np.float64)  # upstream dL/d(after)


def bwds_with_upstream(fn, args, t, upstream):
    t.grad.copy_(pydiff.tensor(np.asarray(upstream, np.float32), device=t.device))
    fn.bwds(*args, t)
    return t.grad.numpy().astype(np.float64)


def test_one_index_explicit_bwds(device, m):
    d = leaf(device, X)
    got = bwds_with_upstream(m.sq_one, (2,), d, U)
    ref = U.copy()
    ref[2] = U[2] * 2 * X[2]
    np.testing.assert_allclose(got, ref, rtol=1e-6)


EVEN = np.arange(4) % 2 == 0


def test_every_other_element_vectorised(device, m):
    d = leaf(device, X)
    idx = pydiff.tensor(np.arange(2, dtype=np.int32), device=device)
    got = bwds_with_upstream(m.sq_even, (idx,), d, U)
    ref = np.where(EVEN, U * 2 * X, U)
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_unwritten_element_also_read(device, m):
    d = leaf(device, X)
    got = bwds_with_upstream(m.times_other, (0, 3), d, U)
    ref = U.copy()
    ref[0] = U[0] * X[3]
    ref[3] = U[3] + U[0] * X[0]  # passed through, and read by the write of element 0
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_write_of_the_same_bits_is_a_write(device, m):
    d = leaf(device, X)
    got = bwds_with_upstream(m.same_bits, (1,), d, U)
    np.testing.assert_allclose(got, U, rtol=1e-6)  # not 2*U at element 1


def test_two_dimensional(device, m):
    x2 = np.array([[1.0, 2.0], [3.0, -1.0], [4.0, 5.0]])
    u2 = np.array([[0.5, 1.0], [2.0, -1.0], [1.5, 3.0]])
    d = leaf(device, x2)
    got = bwds_with_upstream(m.row_first, (1,), d, u2)
    ref = u2.copy()
    ref[1, 0] = u2[1, 0] * x2[1, 1]
    ref[1, 1] = u2[1, 1] + u2[1, 0] * x2[1, 0]
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_vector_elements(device, m):
    x3 = np.array([[0.5, 1.0, -2.0], [1.5, 2.0, 3.0]])
    u3 = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]])
    d = pydiff.tensor(x3.astype(np.float32), dtype="float3", device=device, requires_grad=True)
    d.grad.copy_(pydiff.tensor(u3.astype(np.float32), dtype="float3", device=device))
    m.vec_one.bwds(0, d)
    ref = u3.copy()
    ref[0] = u3[0] * 2 * x3[0]
    np.testing.assert_allclose(d.grad.numpy(), ref, rtol=1e-6)


def test_on_a_tape_then_read(device, m):
    d = leaf(device, X)
    with pydiff.Tape() as tape:
        m.sq_even(pydiff.tensor(np.arange(2, dtype=np.int32), device=device), d)
        y = m.times(d, d, _result="tensor")
    tape.backward(y, grad=U.astype(np.float32))
    after = np.where(EVEN, X * X, X)
    dafter = U * 2 * after
    ref = np.where(EVEN, dafter * 2 * X, dafter)
    np.testing.assert_allclose(d.grad.numpy(), ref, rtol=1e-5)


def test_upstream_inf_and_nan_pass_through(device, m):
    d = leaf(device, X)
    up = np.array([np.inf, np.nan, 1.0, -np.inf])
    got = bwds_with_upstream(m.sq_one, (2,), d, up)
    assert got[0] == np.inf and np.isnan(got[1]) and got[3] == -np.inf
    assert got[2] == pytest.approx(2 * X[2])


def test_separate_buffers_keep_slangpy_semantics(device, m):
    d = pydiff.tensor(X.astype(np.float32), device=device)
    upstream = pydiff.tensor(U.astype(np.float32), device=device)
    g = pydiff.zeros((4,), device=device)
    d = d.with_grads(grad_in=upstream, grad_out=g, zero=False)
    m.sq_one.bwds(2, d)
    ref = np.zeros(4)
    ref[2] = U[2] * 2 * X[2]  # reads only: the pass-through is the caller's (documented)
    np.testing.assert_allclose(g.numpy(), ref, rtol=1e-6)


def test_concrete_rwdifftensor_with_one_buffer_refused(device, m):
    d = leaf(device, X)
    with pytest.raises(ValueError, match=r"'data'.*RWDiffTensor"):
        m.conc.bwds(2, d)


def test_repeated_backwards_same_answer(device, m):
    d = leaf(device, X)
    first = bwds_with_upstream(m.sq_one, (1,), d, U)
    second = bwds_with_upstream(m.sq_one, (1,), d, U)
    np.testing.assert_array_equal(first, second)


V = np.array([0.5, 0.25, -1.0, 2.0])


@pytest.mark.parametrize("how", ["result", "out"])
def test_tape_full_overwrite_of_an_intermediate(device, m, how):
    x, v = leaf(device, X), leaf(device, V)
    with pydiff.Tape() as tape:
        a = m.sq(x, _result="tensor")
        m.twice(v, _result=a) if how == "result" else m.put(v, a)
        y = m.times(a, a, _result="tensor")
    tape.backward(y, grad=U.astype(np.float32))
    k = 2.0 if how == "result" else 3.0
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(4))  # a's first value is gone
    np.testing.assert_allclose(v.grad.numpy(), U * 2 * (k * V) * k, rtol=1e-6)


def test_tape_full_overwrite_of_a_leaf(device, m):
    x, v = leaf(device, X), leaf(device, V)
    with pydiff.Tape() as tape:
        m.put(v, x)
        y = m.times(x, x, _result="tensor")
    tape.backward(y, grad=U.astype(np.float32))
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(4))
    np.testing.assert_allclose(v.grad.numpy(), U * 2 * (3 * V) * 3, rtol=1e-6)


@pytest.mark.parametrize("leaf_first", [True, False])
def test_tape_partial_write_only(device, m, leaf_first):
    x = leaf(device, X)
    v = pydiff.tensor(np.array(3.0, np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        a = x if leaf_first else m.sq(x, _result="tensor")
        m.w_one(1, v, a)
        y = m.times(a, a, _result="tensor")
    tape.backward(y, grad=U.astype(np.float32))
    before = X if leaf_first else X * X
    after = before.copy()
    after[1] = 6.0
    da_before = np.where(np.arange(4) == 1, 0.0, U * 2 * after)
    ref = da_before if leaf_first else da_before * 2 * X
    np.testing.assert_allclose(x.grad.numpy(), ref, rtol=1e-6)
    np.testing.assert_allclose(v.grad.numpy(), U[1] * 2 * 6.0 * 2, rtol=1e-6)


def test_explicit_bwds_of_write_only_keeps_the_upstream(device, m):
    d = leaf(device, X)
    v = pydiff.tensor(np.array(3.0, np.float32), device=device, requires_grad=True)
    got = bwds_with_upstream(m.w_one, (1, v), d, U)
    np.testing.assert_allclose(got, U, rtol=0)  # SlangPy semantics: grad_in is only read
    np.testing.assert_allclose(v.grad.numpy(), 2 * U[1], rtol=1e-6)


def test_tape_concrete_write_only_over_a_needed_value_refused(device, m):
    x = leaf(device, X)
    v = pydiff.tensor(np.array(3.0, np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        a = m.sq(x, _result="tensor")
        m.w_conc(1, v, a)
        y = m.times(a, a, _result="tensor")
    with pytest.raises(ValueError, match=r"'o'.*WDiffTensor"):
        tape.backward(y, grad=U.astype(np.float32))


@pytest.mark.parametrize("kind", ["irw", "inout"])
def test_bwds_after_another_in_place_write_refused(device, m, kind):
    d = leaf(device, X)
    if kind == "irw":
        m.sq_one(1, d)
        m.dbl_one(0, d)  # element 1 still holds what sq_one wrote; what it read is gone
    else:
        m.scale_inout(2.0, d)
        m.add_one(d)
    d.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"'(data|v)'.*overwritten in place.*written again"):
        m.sq_one.bwds(1, d) if kind == "irw" else m.scale_inout.bwds(2.0, d)


def test_bwds_after_a_host_reset_differentiates_at_the_new_values(device, m):
    d = leaf(device, X)
    m.sq_one(1, d)
    m.dbl_one(0, d)
    new = np.array([3.0, -2.0, 1.0, 0.5])
    d.copy_from_numpy(new.astype(np.float32))  # all values set anew: no ambiguity left
    got = bwds_with_upstream(m.sq_one, (1,), d, U)
    ref = U.copy()
    ref[1] = U[1] * 2 * new[1]
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_same_function_again_keeps_its_newest_values(device, m):
    d = leaf(device, X)
    m.sq_one(1, d)
    m.dbl_one(0, d)
    m.sq_one(1, d)  # its newest call's values read are kept again
    before = X.copy()
    before[0] *= 2
    before[1] = X[1] ** 2
    got = bwds_with_upstream(m.sq_one, (1,), d, U)
    ref = U.copy()
    ref[1] = U[1] * 2 * before[1]
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_write_only_element_stored_twice_refused(device, m):
    mm = pydiff.load_module_from_source(
        f"irw_partial_{next(_names)}",
        """
import slangpy;
[Differentiable] void twice(int i, float a, IWDiffTensor<float, 1> y)
{
    y.store(i, a);
    y.store(i, a * a);
}
""",
        device=device,
    )
    y = leaf(device, np.zeros(3))
    a = leaf(device, [1.0, 2.0, 3.0])
    y.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"'y'.*stored 2 times"):
        mm.twice(pydiff.tensor(np.arange(3, dtype=np.int32), device=device), a, y)
        mm.twice.bwds(pydiff.tensor(np.arange(3, dtype=np.int32), device=device), a, y)


def test_write_only_one_store_per_element_counted_and_right(device, m):
    v = pydiff.tensor(np.array(3.0, np.float32), device=device, requires_grad=True)
    d = leaf(device, X)
    got = bwds_with_upstream(m.w_one, (2, v), d, U)
    np.testing.assert_allclose(got, U, rtol=0)
    np.testing.assert_allclose(v.grad.numpy(), 2 * U[2], rtol=1e-6)
