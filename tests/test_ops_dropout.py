"""ops.dropout: the mask is Philox4x32-10 of (seed, element index), checked bit for bit against
an independent Python Philox (tests/philox_ref.py, checked here on Random123's known-answer
vectors); the drop
fraction against a binomial bound; the backward against its closed form (mask * scale)."""

import math

import numpy as np
import pytest

import pydiff
from philox_ref import M32, keep_mask, philox4x32
from pydiff import ops

RNG = np.random.default_rng(18)


def _t(device, data, grad=True):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, requires_grad=grad)


def test_reference_philox_matches_random123_known_answers():
    assert philox4x32((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32((M32,) * 4, (M32, M32)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    ctr = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    assert philox4x32(ctr, (0xA4093822, 0x299F31D0)) == [
        0xD16CFE09,
        0x94FDCCEB,
        0x5001E420,
        0x24126EA1,
    ]


@pytest.mark.parametrize(
    "shape, p, seed",
    [((10,), 0.5, 12345), ((3, 5, 7), 0.25, 2**40 + 7), ((4099,), 0.9, 0), ((1,), 0.5, 1)],
)
def test_mask_values_and_backward_match_the_reference(device, shape, p, seed):
    X = RNG.standard_normal(shape).astype(np.float32)
    G = RNG.standard_normal(shape).astype(np.float32)
    keep = keep_mask(X.size, p, seed).reshape(shape)
    scale = np.float32(1.0 / (1.0 - p))
    x = _t(device, X)
    with pydiff.Tape() as tape:
        y = ops.dropout(x, p, seed=seed)
    tape.backward(y, grad=G)
    np.testing.assert_array_equal(y.numpy() != 0, keep)
    np.testing.assert_allclose(y.numpy(), np.where(keep, X * scale, 0), rtol=1e-7, atol=0)
    np.testing.assert_allclose(x.grad.numpy(), np.where(keep, G * scale, 0), rtol=1e-7, atol=0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_fraction_is_p_within_a_binomial_bound(device, p):
    n = 200_003
    y = ops.dropout(pydiff.ones((n,), device=device), p, seed=7)
    dropped = float(np.mean(y.numpy() == 0))
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / n), dropped
    np.testing.assert_allclose(y.numpy()[y.numpy() != 0], 1 / (1 - p), rtol=1e-7)


def test_same_seed_same_mask_different_seed_different_mask(device):
    x = pydiff.ones((1000,), device=device)
    a, b = ops.dropout(x, 0.5, seed=3).numpy(), ops.dropout(x, 0.5, seed=3).numpy()
    np.testing.assert_array_equal(a, b)
    c = ops.dropout(x, 0.5, seed=4).numpy()
    d = ops.dropout(x, 0.5, seed=3 + 2**32).numpy()  # the seed's high word counts too
    assert (a != c).sum() > 300 and (a != d).sum() > 300


def test_p_zero_is_the_identity_and_p_one_gives_zeros(device):
    X = np.array([1.5, -0.0, np.inf, -np.inf, np.nan, 3e38, -2e-38], np.float32)
    x = _t(device, X)
    with pydiff.Tape() as tape:
        y = ops.dropout(x, 0.0, seed=1)
    tape.backward(y, grad=np.arange(7, dtype=np.float32))
    np.testing.assert_array_equal(y.numpy(), X)
    np.testing.assert_array_equal(x.grad.numpy(), np.arange(7))
    x = _t(device, X)
    with pydiff.Tape() as tape:
        y = ops.dropout(x, 1.0, seed=1)
    tape.backward(y, grad=np.full(7, np.inf, np.float32))
    np.testing.assert_array_equal(y.numpy(), np.zeros(7))  # no NaN at inf or NaN inputs
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(7))


def test_views_use_their_own_flat_index(device):
    X = RNG.standard_normal((3, 6)).astype(np.float32)
    row = pydiff.tensor(X, device=device)[1]
    y = ops.dropout(row, 0.5, seed=11)
    want = np.where(keep_mask(6, 0.5, 11), X[1] * 2, 0)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-7, atol=0)


def test_gradcheck_and_composition(device):
    x = _t(device, RNG.standard_normal((4, 5)))
    w = _t(device, RNG.standard_normal((3, 5)))
    assert pydiff.gradcheck(lambda x: ops.dropout(x, 0.3, seed=5), (x,))
    assert pydiff.gradcheck(
        lambda x, w: ops.sum(ops.tanh(ops.linear(ops.dropout(x, 0.4, seed=9), w))), (x, w)
    )


def test_a_captured_step_replays_the_same_mask(device):
    X = RNG.standard_normal((8, 8)).astype(np.float32)
    x = _t(device, X)
    w = _t(device, RNG.standard_normal((4, 8)))
    labels = pydiff.tensor(np.arange(8, dtype=np.int32) % 4, dtype="int", device=device)

    def step():
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(ops.linear(ops.dropout(x, 0.5, seed=21), w), labels)
        tape.backward(loss)
        return loss

    eager = step().item()
    grad_eager = x.grad.numpy().copy()
    captured = pydiff.capture(step)
    captured.replay()
    assert captured.result.item() == eager
    # the gradient accumulates: the eager step, the step run by capture, the replay
    np.testing.assert_allclose(x.grad.numpy(), 3 * grad_eager, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"p": -0.1}, ValueError, r"dropout: p=-0.1 must be a probability in \[0, 1\]"),
        ({"p": 1.5}, ValueError, r"dropout: p=1.5 must be"),
        ({"p": float("nan")}, ValueError, r"dropout: p=nan must be"),
        ({"p": "0.5"}, ValueError, r"dropout: p='0.5' must be"),
        ({"p": True}, ValueError, r"dropout: p=True must be"),
        ({"seed": -1}, ValueError, r"dropout: seed=-1 must be in \[0, 2\*\*64\)"),
        ({"seed": 2**64}, ValueError, r"dropout: seed=18446744073709551616 must be in"),
        ({"seed": 1.5}, TypeError, r"dropout: seed must be an int, got float"),
        ({"seed": None}, TypeError, r"dropout: seed must be an int, got NoneType"),
    ],
)
def test_bad_arguments_are_refused(device, kwargs, error, match):
    args = {"p": 0.5, "seed": 0, **kwargs}
    with pytest.raises(error, match=match):
        ops.dropout(pydiff.ones((4,), device=device), args["p"], seed=args["seed"])


def test_half_tensors_are_refused(device):
    with pytest.raises(pydiff.OpDtypeError, match="dropout: x has dtype half"):
        ops.dropout(pydiff.tensor(np.ones(4), dtype="half", device=device), 0.5, seed=0)
