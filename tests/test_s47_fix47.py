"""Session 47 (fix47): forward mode at infinite primals, hessian shapes of 0-d inputs,
integers float32 cannot hold, and the grid-race check's cached path."""

import numpy as np
import pytest

import pydiff
from pydiff import generated

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def poly():
    return pydiff.load_module("samples/polynomial.slang")


def _torch_grad(xs):
    xt = torch.tensor(xs, dtype=torch.float64, requires_grad=True)
    (2 * xt * xt + 8 * xt - 1).sum().backward()
    return xt.grad.numpy()


XS = [np.inf, -np.inf, 1.0, -2.5]


@pytest.mark.parametrize("path", ["slangpy", "generated"])
def test_fwds_infinite_primal_matches_torch(poly, path, monkeypatch):
    # a, b, c given without tangents: literal zero tangents, folded by the driver (lavapipe)
    # so no 0 * inf term (torch: inf, not nan); see docs/forward-mode.md "Known limit"
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1 if path == "generated" else 10**9)
    generated.reset_stats()
    x = pydiff.tensor(np.array(XS, np.float32)).with_tangent(np.ones(4, np.float32))
    _, dy = poly.polynomial.fwds(2.0, 8.0, -1.0, x)
    np.testing.assert_allclose(dy.numpy(), _torch_grad(XS), rtol=1e-6)
    assert (generated.STATS["fwds"] > 0) == (path == "generated")


@pytest.mark.parametrize("path", ["slangpy", "generated"])
def test_fwds_tensor_without_tangent_is_constant(poly, path, monkeypatch):
    # a is a tensor without tangent, x one with: d/dx (a x^2 + 8x - 1) = 2 a x + 8
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1 if path == "generated" else 10**9)
    av = np.array([2.0, 3.0, 0.5, 1.0], np.float32)
    xs = np.array(XS, np.float32)
    x = pydiff.tensor(xs).with_tangent(np.ones(4, np.float32))
    _, dy = poly.polynomial.fwds(pydiff.tensor(av), 8.0, -1.0, x)
    xt = torch.tensor(xs, dtype=torch.float64, requires_grad=True)
    (torch.tensor(av, dtype=torch.float64) * xt * xt + 8 * xt - 1).sum().backward()
    np.testing.assert_allclose(dy.numpy(), xt.grad.numpy(), rtol=1e-6)


def test_fwds_finite_mixed_tangents_match_torch_jvp(poly):
    # tangents on a and x, none on b, c: torch float64 jvp of the same function
    rng = np.random.default_rng(0)
    av, xs = rng.normal(size=(2, 6)).astype(np.float32)
    ua, ux = rng.normal(size=(2, 6)).astype(np.float32)
    a = pydiff.tensor(av).with_tangent(ua)
    x = pydiff.tensor(xs).with_tangent(ux)
    y, dy = poly.polynomial.fwds(a, 8.0, (-1.0, 0.5), x)

    def f(a, x):
        return a * x * x + 8 * x - 1

    d = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    ty, tdy = torch.func.jvp(f, (d(av), d(xs)), (d(ua), d(ux)))
    np.testing.assert_allclose(y.numpy(), ty.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dy.numpy(), tdy.numpy() + 0.5, rtol=1e-5, atol=1e-5)


# -- hessian: PyTorch's shape convention (x.shape + x.shape for one differentiated input) --


def _t64(v):
    return torch.tensor(np.asarray(v, np.float64))


def test_hessian_of_0d_input_is_0d_as_torch(poly):
    f = lambda x: x * x * x  # noqa: E731
    want = torch.autograd.functional.hessian(f, _t64(2.0)).numpy()  # 6 x = 12, shape ()
    got = pydiff.hessian(lambda x: x * x * x, (np.float32(2.0),))
    assert np.shape(got) == want.shape == ()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # a Slang call of one 0-d tensor (a, b, c closed over: held fixed)
    x = pydiff.tensor(np.float32(0.5))
    got = pydiff.hessian(lambda x: poly.polynomial(2.0, 8.0, -1.0, x, _result="tensor"), (x,))
    assert np.shape(got) == ()
    np.testing.assert_allclose(got, 4.0, rtol=1e-6)  # d2/dx2 (2 x^2 + 8 x - 1) = 4


def test_hessian_of_2d_input_has_torch_shape():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(2, 3))
    from pydiff import ops

    got = pydiff.hessian(lambda x: ops.sum(ops.sin(x) * x), (X.astype(np.float32),))
    want = torch.autograd.functional.hessian(lambda x: (torch.sin(x) * x).sum(), _t64(X))
    assert np.shape(got) == tuple(want.shape) == (2, 3, 2, 3)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_hessian_of_several_inputs_stays_flattened():
    # several differentiated inputs: the (n, n) matrix of the blocks (PyTorch: a tuple)
    f = lambda a, b: (a * a * b).sum()  # noqa: E731
    a, b = np.array([1.0, 2.0]), np.array([3.0, -1.0])
    H = pydiff.hessian(f, (a.astype(np.float32), b.astype(np.float32)))
    blocks = torch.autograd.functional.hessian(f, (_t64(a), _t64(b)))
    want = np.block([[blk.numpy() for blk in row] for row in blocks])
    assert H.shape == (4, 4)
    np.testing.assert_allclose(H, want, rtol=1e-5)


# -- integers a float cannot hold exactly: refused, naming the value and dtype --------------

BIG = 2**24 + 1  # 16777217: float32 holds 16777216 and 16777218, not this


@pytest.mark.parametrize(
    "make",
    [
        lambda: pydiff.tensor([1, BIG], dtype="float"),
        lambda: pydiff.tensor(np.array([1, BIG], np.int64), dtype="float"),
        lambda: pydiff.tensor(np.array([-BIG], np.int32), dtype="float"),
        lambda: pydiff.tensor(np.array([2**64 - 1], np.uint64), dtype="float"),
        lambda: pydiff.tensor(np.array([2049]), dtype="half"),
        lambda: pydiff.zeros((2,)).copy_from_numpy(np.array([3, BIG])),
    ],
)
def test_inexact_integer_to_float_tensor_is_refused(make):
    with pytest.raises(ValueError, match=r"has no exact (float|half) value"):
        make()


def test_inexact_integer_message_names_value_and_dtype():
    with pytest.raises(ValueError, match=r"integer 16777217 has no exact float value.*16777216"):
        pydiff.tensor([BIG], dtype="float")


def test_exact_integers_to_float_stay_allowed():
    # exact: small ints, powers of two and even numbers past 2^24 (float64 reference)
    vals = np.array([0, -7, 2**24, 2**24 + 2, 2**25, -(2**30), 2**62, -(2**63)], np.int64)
    t = pydiff.tensor(vals, dtype="float")
    np.testing.assert_array_equal(t.numpy().astype(np.float64), vals.astype(np.float64))
    # float64 data rounds to float32 as before (a float is approximate already)
    np.testing.assert_array_equal(pydiff.tensor([BIG + 0.0]).numpy(), np.float32(BIG))
    # double holds every int32 / int up to 2**53
    d = pydiff.tensor(np.array([BIG, 2**53], np.int64), dtype="double")
    np.testing.assert_array_equal(d.numpy(), [float(BIG), 2.0**53])


def test_inexact_integer_call_arguments_refused(poly):
    x = pydiff.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"parameter 'c'.*integer 16777217 has no exact float"):
        poly.polynomial(0.0, 0.0, BIG, x)
    with pytest.raises(ValueError, match=r"integer 16777217 has no exact float"):
        poly.polynomial(0.0, 0.0, np.array([BIG, 1]), x)
    # exact ints still pass: 0 x^2 + 0 x + 2^25 (closed form)
    np.testing.assert_array_equal(poly.polynomial(0.0, 0.0, 2**25, x).numpy(), [2.0**25] * 2)


def test_inexact_integer_through_creation_apis_refused():
    t = pydiff.tensor(np.array([BIG], np.int32))  # an int tensor holds it exactly
    for make in (
        lambda: t.astype("float"),
        lambda: pydiff.full((2,), BIG),
        lambda: pydiff.zeros((2,)).fill(BIG),
    ):
        with pytest.raises(ValueError, match="integer 16777217 has no exact float value"):
            make()
    np.testing.assert_array_equal(pydiff.full((2,), BIG + 1).numpy(), [float(BIG + 1)] * 2)
    np.testing.assert_array_equal(pydiff.full((2,), 7, dtype="int").numpy(), [7, 7])


# -- grid-race check: its cache key (grid shape, stride, offset as tuples) --------------------


def test_grid_race_verdict_follows_the_grid_stride():
    """nxt_plain reads x[i, j + 1]: over a grid of stride 2 along x no thread stores what
    another loads (allowed; float64 closed form), over the same shape with stride 1 one does
    (refused), whichever verdict was cached first."""
    import slangpy as spy

    src = """
import slangpy;
void nxt_plain(int2 px, RWTensor<float, 2> x)
{
    x[px.y, px.x] = x[px.y, px.x] * x[px.y, clamp(px.x + 1, 0, 7)];
}
"""
    m = pydiff.load_module_from_source("s47_grid", src)
    x0 = np.random.default_rng(2).uniform(0.5, 2.0, (4, 8)).astype(np.float32)
    for _ in range(2):
        x = pydiff.tensor(x0)
        m.nxt_plain(spy.grid((4, 4), stride=(1, 2)), x)
        want = x0.astype(np.float64)
        want[:, 0::2] *= x0[:, 1::2]
        np.testing.assert_allclose(x.numpy(), want, rtol=1e-6)
        with pytest.raises(ValueError, match=r"parameter 'x'.*read and written"):
            m.nxt_plain(spy.grid((4, 4)), pydiff.tensor(x0))
        with pytest.raises(ValueError, match=r"parameter 'x'.*read and written"):
            m.nxt_plain(spy.grid((4, 4), offset=(0, 1)), pydiff.tensor(x0))
