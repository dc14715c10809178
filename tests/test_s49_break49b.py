"""Session 49 break49b: dtype spellings and new-dtype paths (references: NumPy)."""

import numpy as np
import pytest

import pydiff


@pytest.mark.parametrize("spelling", ["<i8", "=i8", "<f4", ">i4", "|u1", "<u8"])
def test_numpy_byte_order_dtype_strings_mean_their_numpy_type(spelling):
    # Before: SlangPy segfaulted the process on a dtype name starting with '<' or '>'.
    want = np.dtype(spelling).newbyteorder("=")
    values = [3, 1] if want.kind == "u" else [3, -1]
    x = pydiff.tensor(values, dtype=spelling)
    got = x.numpy()
    assert got.dtype == want
    np.testing.assert_array_equal(got, np.array(values, dtype=want))


def test_int64_byte_order_string_keeps_values_past_2_53():
    big = 2**53 + 1
    x = pydiff.tensor([big, -big], dtype="<i8")
    assert x.numpy().tolist() == [big, -big]


@pytest.mark.parametrize("spelling", ["<x9", "(float", ")", "int(", "float)", "float;", "float{"])
def test_malformed_dtype_strings_are_refused_by_name(spelling):
    with pytest.raises(TypeError, match="dtype="):
        pydiff.tensor([1.0], dtype=spelling)


@pytest.mark.parametrize(
    ("torch_name", "asked", "values"),
    [
        ("int64", np.int64, [2**53 + 1, -(2**62)]),
        ("int64", "int64_t", [2**53 + 1, 5]),
        ("int8", np.int8, [-128, 127]),
        ("uint8", "uint8", [0, 255]),
        ("int16", np.int16, [-32768, 32767]),
        ("float64", np.float64, [0.1, 1e300]),
    ],
)
def test_from_torch_takes_same_width_dtypes_when_asked(torch_name, asked, values):
    # Before: refused, "torch.int64 with dtype=" although dtype= had been given.
    torch = pytest.importorskip("torch")
    t = torch.tensor(values, dtype=getattr(torch, torch_name))
    x = pydiff.from_torch(t, dtype=asked)
    want = t.numpy()
    got = x.numpy()
    assert got.dtype == want.dtype
    assert got.tolist() == want.tolist()


def test_from_torch_same_width_still_refuses_a_gradient():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="requires_grad"):
        pydiff.from_torch(torch.tensor([1, 2]), dtype=np.int64, requires_grad=True)


class _PassMarked(pydiff.Function):
    """Returns 2 x and its input x itself, marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_non_differentiable(x)
        return x * 2.0, x


def test_gradcheck_leaves_out_a_marked_input_returned_as_it_is():
    # Before: a raw NumPy matmul ValueError (the finite differences counted the marked
    # output, which off a tape is the input itself, not a marked copy).
    x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
    assert pydiff.gradcheck(lambda a: _PassMarked.apply(a), (x,))


def test_gradcheck_still_fails_a_wrong_gradient_beside_a_marked_input():
    class Wrong(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_non_differentiable(x)
            return x * x, x

        @staticmethod
        def backward(ctx, g, g_marked):
            return g * 3.0  # d(x^2)/dx is 2x, not 3

    x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
    assert not pydiff.gradcheck(lambda a: Wrong.apply(a), (x,), raise_exception=False)
