"""x[key] = value writes x in place (Tensor.__setitem__), and an in-place method called on a
temporary copy (x[1:3].fill(3.0): indexing returns copies) is refused instead of writing
nothing of x silently. References: NumPy arrays given the same assignments; gradients against
closed forms in float64 (d(x^2)/dx = 2x at the written values); the version rule of the other
in-place writes (a .bwds or a tape backward whose input was overwritten is refused)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] float sq(float x) { return x * x; }
"""


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("s48_slice48", SOURCE, device=device)


def _t(a, device, **kw):
    return pydiff.tensor(np.asarray(a, np.float32), device=device, **kw)


CASES = [
    ((6,), (slice(1, 3),), 7.0),
    ((6,), (slice(None, None, 2),), [1.0, 2.0, 3.0]),
    ((6,), (-1,), 9.0),
    ((6,), (slice(-4, None, -2),), [5.0, 6.0]),
    ((3, 4), (slice(None), 2), [1.0, 2.0, 3.0]),
    ((3, 4), (1,), [4.0, 3.0, 2.0, 1.0]),
    ((3, 4), (Ellipsis, -1), 0.5),
    ((3, 4), (slice(None, None, -1), slice(1, None, 2)), [[1.0, 2.0]]),  # broadcast rows
    ((2, 3, 4), (Ellipsis, slice(1, 3)), np.arange(6.0).reshape(2, 3, 1)),
    ((2, 3, 4), (1, -1, slice(None, None, 3)), [8.0, 9.0]),
    ((2, 3, 4), (slice(None),), 1.5),  # every element
]


@pytest.mark.parametrize("shape,key,value", CASES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_setitem_matches_numpy(device, shape, key, value, as_tensor):
    ref = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    x = _t(ref, device)
    before = x.storage.version
    ref[key if len(key) > 1 else key[0]] = value
    v = _t(value, device) if as_tensor else value
    x[key if len(key) > 1 else key[0]] = v
    np.testing.assert_array_equal(x.numpy(), ref)
    assert x.storage.version > before


def test_setitem_zero_d_and_augmented(device):
    s = _t(3.0, device).sum()  # 0-d
    s[()] = 5.0
    assert s.shape == () and float(s) == 5.0
    s[...] = np.float32(-2.0)
    assert float(s) == -2.0
    ref = np.arange(6.0, dtype=np.float32)
    x = _t(ref, device)
    x[1:4] += 10.0  # x.__setitem__(k, x[k] + 10): the copy added to, written back
    ref[1:4] += 10.0
    np.testing.assert_array_equal(x.numpy(), ref)


def test_setitem_float3_vector_tensor(device):
    ref = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    x = pydiff.tensor(ref, dtype="float3", device=device)
    x[1] = [7.0, 8.0, 9.0]
    x[-2:] = 0.5  # every component
    x[..., 0] = [1.0, 1.0, 1.0]  # Ellipsis indexes the tensor's axes, not the components
    ref[1] = [7.0, 8.0, 9.0]
    ref[-2:] = 0.5
    ref[0] = [1.0, 1.0, 1.0]
    np.testing.assert_array_equal(x.numpy(), ref)


def test_setitem_int_tensor(device):
    x = pydiff.tensor(np.arange(5, dtype=np.int32), dtype="int", device=device)
    x[::2] = 7
    np.testing.assert_array_equal(x.numpy(), [7, 1, 7, 3, 7])
    with pytest.raises(ValueError, match="not a whole number"):
        x[1] = 2.5
    np.testing.assert_array_equal(x.numpy(), [7, 1, 7, 3, 7])


def test_setitem_errors_name_key_and_shape(device):
    x = _t(np.zeros((3, 4)), device)
    with pytest.raises(IndexError, match=r"x\[5\].*\(3, 4\)"):
        x[5] = 1.0
    with pytest.raises(ValueError, match=r"x\[:, 1:3\].*\(3,\).*\(3, 2\)"):
        x[:, 1:3] = np.ones(3)
    with pytest.raises(TypeError, match="dtype half.*astype"):
        x[0] = pydiff.tensor(np.ones(4, np.float16), dtype="half", device=device)
    with pytest.raises(TypeError, match="boolean mask"):
        x[np.zeros((3, 4), bool)] = 1.0
    with pytest.raises(TypeError, match="index of type list"):
        x[[0, 2]] = 1.0
    with pytest.raises(TypeError, match="None"):
        x[None] = 1.0
    with pytest.raises(TypeError, match="give a number"):
        x[0] = "a"
    np.testing.assert_array_equal(x.numpy(), np.zeros((3, 4)))


WRITES = {
    "fill": lambda c: c.fill(3.0),
    "zero_": lambda c: c.zero_(),
    "copy_": lambda c: c.copy_(c),
    "copy_from_numpy": lambda c: c.copy_from_numpy(np.full(c.shape, 3.0, np.float32)),
}


def test_inplace_on_temporary_copy_refused(device):
    ref = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    x = _t(ref, device)
    with pytest.raises(TypeError, match=r"x\[1:3\]\.fill.*temporary copy.*x\[1:3\] = value"):
        x[1:3].fill(3.0)
    with pytest.raises(TypeError, match=r"x\[0\]\.zero_"):
        x[0].zero_()
    with pytest.raises(TypeError, match=r"x\[:, 2\]\.copy_"):
        x[:, 2].copy_(_t([1.0, 2.0, 3.0], device))
    with pytest.raises(TypeError, match=r"x\[1:3\]\.copy_from_numpy"):
        x[1:3].copy_from_numpy(np.zeros((2, 4)))
    with pytest.raises(TypeError, match=r"x\[1:3\]\[\.\.\.\] = value"):
        x[1:3][0] = 5.0
    with pytest.raises(TypeError, match=r"x\.T\.fill.*copy_\(values\.T\)"):
        x.T.fill(0.0)
    with pytest.raises(TypeError, match="temporary copy"):  # fill returns self: still lost
        _ = x[1:3].fill(3.0)
    np.testing.assert_array_equal(x.numpy(), ref)


@pytest.mark.parametrize("method", sorted(WRITES))
def test_inplace_on_named_copy_allowed(device, method):
    ref = np.arange(6.0, dtype=np.float32)
    x = _t(ref, device)
    y = x[1:3]
    WRITES[method](y)
    held = [x[::2]]
    WRITES[method](held[0])
    expect = {"fill": 3.0, "zero_": 0.0, "copy_": None, "copy_from_numpy": 3.0}[method]
    if expect is not None:
        np.testing.assert_array_equal(y.numpy(), np.full(2, expect))
        np.testing.assert_array_equal(held[0].numpy(), np.full(3, expect))
    np.testing.assert_array_equal(x.numpy(), ref)  # a copy: x unchanged, as documented


def test_temporary_on_tape_refused_named_allowed(device):
    x = _t(np.arange(4.0), device, requires_grad=True)
    with pydiff.Tape():
        with pytest.raises(TypeError, match="temporary copy"):
            x[1:3].fill(0.0)
        y = x[1:3]
        z = x[::2]
        y.fill(0.0)
        z.zero_()
    tape = pydiff.Tape()
    with tape:
        w = x[1:]
    tape.reset()  # (the tape drops its references to w: a named copy, still allowed)
    w.fill(1.0)


def test_setitem_then_bwds_refused_as_stale(device, m):
    x = _t([1.0, 2.0, 3.0], device, requires_grad=True)
    y = m.sq(x, _result="tensor")
    x[1] = 5.0
    with pytest.raises(ValueError, match="x\\[1\\] = value|__setitem__|written"):
        m.sq.bwds(x, _result=y.with_grads(ones=True))


def test_setitem_then_tape_backward_refused(device, m):
    x = _t([1.0, 2.0, 3.0], device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.sq(x, _result="tensor")
        loss = y.sum()
    x[0:2] = 0.0
    with pytest.raises((RuntimeError, ValueError), match="overwritten|written"):
        tape.backward(loss)


def test_gradient_after_setitem_closed_form(device, m):
    ref = np.array([1.0, 2.0, 3.0, 4.0])
    x = _t(ref, device, requires_grad=True)
    x[1:3] = [0.5, -1.5]
    ref[1:3] = [0.5, -1.5]
    c = _t([1.0, 1.0, 1.0, 1.0], device)
    c[::2] = 3.0  # a data tensor written in part, used on the tape as a constant
    cref = np.array([3.0, 1.0, 3.0, 1.0])
    with pydiff.Tape() as tape:
        loss = (m.sq(x, _result="tensor") * c).sum()
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * ref * cref, rtol=1e-6)
    np.testing.assert_allclose(float(loss), float(np.sum(ref**2 * cref)), rtol=1e-6)


def test_setitem_of_a_tape_result_refused_whole_write_allowed(device):
    x = _t([1.0, 2.0, 3.0], device, requires_grad=True)
    with pydiff.Tape() as tape:
        h = x * 2.0
        with pytest.raises(RuntimeError, match=r"x\[0\] = value.*recorded.*keep"):
            h[0] = 0.0
        h[...] = 1.0  # every element: as h.fill(1.0), the values are constants to the tape
        loss = (h * x).sum()
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), np.ones(3))  # d(sum(1 * x))/dx


def test_setitem_value_with_gradient_path_on_tape_refused(device):
    a = _t([1.0, 2.0], device, requires_grad=True)
    x = _t(np.zeros(4), device)
    with pydiff.Tape():
        v = a * 3.0
        with pytest.raises(RuntimeError, match="gradient path.*lost"):
            x[1:3] = v
    np.testing.assert_array_equal(x.numpy(), np.zeros(4))


def test_setitem_under_jvp_with_tangent_refused(device):
    def f(x):
        y = x * 2.0
        y[0] = 1.0
        return y

    with pytest.raises(RuntimeError, match="pydiff.jvp"):
        pydiff.jvp(f, (_t([1.0, 2.0], device),), (np.ones(2),))


def test_setitem_bool_and_half(device):
    b = pydiff.tensor(np.array([True, False, True]), dtype="bool", device=device)
    b[1] = True
    b[0] = 0
    np.testing.assert_array_equal(b.numpy(), [False, True, True])
    h = pydiff.tensor(np.arange(4.0, dtype=np.float16), dtype="half", device=device)
    h[1:] = 0.25
    np.testing.assert_array_equal(h.numpy(), np.array([0.0, 0.25, 0.25, 0.25], np.float16))
    with pytest.raises(ValueError, match="float16"):
        h[0] = 1e6


def test_setitem_value_with_gradient_path_off_tape_marked_as_copy_(device):
    """Off a tape the write is kept and marked as copy_ marks values with a gradient path:
    a tape reading x later refuses it (its gradient to a would be a silent 0)."""
    a = _t([1.0, 2.0], device, requires_grad=True)
    x = _t(np.zeros(4), device)
    x[1:3] = a
    np.testing.assert_array_equal(x.numpy(), [0.0, 1.0, 2.0, 0.0])
    w = _t(np.ones(4), device, requires_grad=True)
    with pytest.raises(RuntimeError, match="gradient path"):
        with pydiff.Tape():
            _ = x * w
