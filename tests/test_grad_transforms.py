"""pydiff.grad / value_and_grad (issue 17) against closed forms and float64 finite
differences, with the argument forms (tensor, array, list, number) and the refusals."""

import sys

import numpy as np
import pytest

import pydiff
from pydiff import ops

RNG = np.random.default_rng(171)


def _fd(f, x, h=1e-6):
    """Central differences of a float64 NumPy function."""
    x = np.asarray(x, np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (f(x + e) - f(x - e)) / (2 * h)
    return g


def test_grad_of_a_composition_against_finite_differences(device):
    pydiff.set_default_device(device)
    X = RNG.uniform(0.5, 2.0, (3, 4))

    def loss(x):
        return ops.mean(ops.mul(ops.tanh(x), ops.log(x)))

    got = pydiff.grad(loss)(X)
    assert isinstance(got, np.ndarray) and got.shape == X.shape
    np.testing.assert_allclose(got, _fd(lambda x: np.mean(np.tanh(x) * np.log(x)), X), rtol=1e-4)


def test_value_and_grad_with_several_argnums_and_forms(device):
    pydiff.set_default_device(device)
    W = RNG.standard_normal((2, 3))
    x = pydiff.tensor(RNG.standard_normal((5, 3)))
    b = [0.25, -0.5]

    def f(w, b, x):
        return ops.sum(ops.mul(ops.linear(x, w, b), ops.linear(x, w, b)))

    w_t = pydiff.tensor(W, requires_grad=True)
    value, (gw, gb) = pydiff.value_and_grad(f, argnums=(0, -2))(w_t, b, x)
    X, B = x.numpy().astype(np.float64), np.array(b)
    Y = X @ W.T + B
    np.testing.assert_allclose(value.item(), np.sum(Y * Y), rtol=1e-5)
    assert isinstance(gw, pydiff.Tensor) and isinstance(gb, np.ndarray)
    np.testing.assert_allclose(gw.numpy(), 2 * Y.T @ X, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gb, 2 * Y.sum(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(w_t.grad.numpy(), 0.0)  # the caller's buffers untouched


def test_numbers_give_numbers_and_identity_gives_one(device):
    pydiff.set_default_device(device)
    assert pydiff.grad(lambda s: ops.sum(ops.mul(s, s)))(3.0) == pytest.approx(6.0)
    assert pydiff.grad(lambda s: s)(3.0) == 1.0
    value, g = pydiff.value_and_grad(lambda a, c: ops.mul(a, c), argnums=1)(2.5, 4.0)
    assert value.item() == 10.0 and g == pytest.approx(2.5)


def test_an_argument_the_result_does_not_depend_on_gets_zeros(device):
    pydiff.set_default_device(device)
    g = pydiff.grad(lambda a, b: ops.sum(ops.exp(a)), argnums=(0, 1))([0.0, 1.0], [5.0])
    np.testing.assert_allclose(g[0], np.exp([0.0, 1.0]), rtol=1e-6)
    np.testing.assert_array_equal(g[1], [0.0])


def test_grad_of_a_shader_function(device):
    m = pydiff.load_module("samples/polynomial.slang", device=device)
    pydiff.set_default_device(device)
    x = np.array([1.0, 2.0, 3.0])
    g = pydiff.grad(lambda x: ops.sum(m.polynomial(2.0, 8.0, -1.0, x, _result="tensor")))(x)
    np.testing.assert_allclose(g, 4 * x + 8, rtol=1e-6)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: pydiff.grad(lambda x: x)(np.ones(3)),
            ValueError,
            r"grad\(<lambda>\).*shape \(3,\)",
        ),
        (lambda: pydiff.grad(lambda x: 1.0)(2.0), TypeError, "returned a float"),
        (lambda: pydiff.grad(lambda x: x, argnums=2)(1.0), ValueError, "argnums=2 is out of range"),
        (lambda: pydiff.grad(lambda x, y: x, argnums=(0, 0))(1.0, 2.0), ValueError, "twice"),
        (
            lambda: pydiff.grad(lambda x: x, argnums="0")(1.0),
            TypeError,
            "argnums must be an int or a tuple of ints",
        ),
        (lambda: pydiff.grad(lambda x: x)("a"), TypeError, "argument 0 is a str"),
        (lambda: pydiff.grad(lambda x: x)(True), TypeError, "argument 0 is a bool"),
        (lambda: pydiff.grad(lambda x: x)(pydiff.tensor([1])), TypeError, "dtype 'int'"),
        (lambda: pydiff.grad(3), TypeError, "fn must be callable"),
        (lambda: pydiff.value_and_grad(lambda x: x, argnums=())(1.0), ValueError, "empty"),
    ],
)
def test_refusals_name_the_fault(device, call, error, message):
    pydiff.set_default_device(device)
    with pytest.raises(error, match=message):
        call()


def test_creation_ranges_match_numpy(device):
    pydiff.set_default_device(device)
    np.testing.assert_array_equal(pydiff.arange(5).numpy(), np.arange(5))
    assert pydiff.arange(5).dtype == "int" and pydiff.arange(0.5, 2).dtype == "float"
    np.testing.assert_array_equal(
        pydiff.arange(2, -3, -1.5).numpy(), np.float32(np.arange(2, -3, -1.5))
    )
    np.testing.assert_array_equal(
        pydiff.linspace(-1, 1, 7).numpy(), np.float32(np.linspace(-1, 1, 7))
    )
    np.testing.assert_array_equal(
        pydiff.full((2, 3), 0.1).numpy(), np.full((2, 3), np.float32(0.1))
    )
    x = pydiff.tensor(np.ones((3, 2)), dtype="half")
    z, o = pydiff.zeros_like(x), pydiff.ones_like(x, requires_grad=True)
    assert z.shape == o.shape == (3, 2) and z.dtype == o.dtype == "half" and o.requires_grad
    np.testing.assert_array_equal(o.numpy(), 1.0)
    for bad, message in [
        (lambda: pydiff.arange(1, 2, 0), "step must not be 0"),
        (lambda: pydiff.arange(3, 1), "no values"),
        (lambda: pydiff.linspace(0, 1, 0), "num must be an int >= 1"),
        (lambda: pydiff.rand(2, -1), "positive ints"),
        (lambda: pydiff.randn(), "give a shape"),
        (lambda: pydiff.rand(2, seed=-1), "seed must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            bad()
    with pytest.raises(TypeError, match="zeros_like: x must be a pydiff.Tensor"):
        pydiff.zeros_like(np.zeros(2))


def test_random_values_are_philox_counter_based_and_seeded(device):
    pydiff.set_default_device(device)
    a, b = pydiff.rand(4, 5, seed=7), pydiff.rand((4, 5), seed=7)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    ref = np.random.Generator(np.random.Philox(7)).random((4, 5), dtype=np.float32)
    np.testing.assert_array_equal(a.numpy(), ref)  # the documented generator, exactly
    assert not np.array_equal(pydiff.rand(4, 5, seed=8).numpy(), a.numpy())
    n = pydiff.randn(20000, seed=1).numpy()
    assert abs(n.mean()) < 0.03 and abs(n.std() - 1) < 0.03
    u = pydiff.rand(20000, seed=2).numpy()
    assert u.min() >= 0.0 and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01


def test_without_torch_the_interop_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"pip install 'pydiff\[torch\]'"):
        pydiff.to_torch(pydiff.tensor([1.0]))


def test_float64_values_that_overflow_float32_are_refused_by_name(device):
    # 1e300 is no float32 (largest 3.4e38): NumPy's cast would make it inf with a warning only
    pydiff.set_default_device(device)
    f = lambda x, d: (x * d).sum()  # noqa: E731
    for run, where in (
        (lambda: pydiff.value_and_grad(f)(np.array([1e300]), np.ones(1)), "argument 0"),
        (lambda: pydiff.grad(f)(np.ones(1), np.array([-1e300])), "argument 1"),  # data too
        (lambda: pydiff.grad(f)([1e39], np.ones(1)), "argument 0"),
        (lambda: pydiff.jacfwd(lambda x: x * 1.0)(np.array([1e300])), "primal 0"),
    ):
        with pytest.raises(ValueError, match=rf"{where}: float64 values up to .* overflow"):
            run()
    # inf given as inf stays inf (not an overflow): d/dx sum(x * 1) = 1
    np.testing.assert_array_equal(pydiff.grad(f)(np.array([np.inf]), np.ones(1)), [1.0])


def test_arange_of_non_finite_bounds_and_sum_of_non_int_axes_say_which(device):
    with pytest.raises(ValueError, match=r"arange: stop=inf is not finite"):
        pydiff.arange(0, np.inf, device=device)
    with pytest.raises(ValueError, match=r"arange: start=nan"):
        pydiff.arange(np.nan, 3, device=device)
    x = pydiff.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
    for axis in (1.0, (0, 1.0), True, "0"):
        with pytest.raises(TypeError, match=r"sum: axis=.* an axis is an int"):
            x.sum(axis=axis)
    np.testing.assert_array_equal(x.sum(axis=np.int64(1)).numpy(), [3.0, 7.0])  # NumPy ints


def test_asarray_copy_false_raises_as_numpy2_and_copies_otherwise(device):
    x = pydiff.tensor([1.0, 2.0], device=device)
    with pytest.raises(ValueError, match=r"copy=False.*without a copy"):
        np.asarray(x, copy=False)
    with pytest.raises(ValueError, match=r"copy=False"):
        np.array(x, copy=False)
    a = np.asarray(x)
    a[0] = 9.0
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0])  # a copy, as documented
    np.testing.assert_array_equal(np.array(x, copy=True, dtype=np.float64), [1.0, 2.0])
