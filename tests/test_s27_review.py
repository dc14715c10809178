"""Cases from the review of the s27 fixes: NumPy functions that would write into a tensor are
refused (the write would go to a copy), and a Function's NumPy gradient that sums past the
float range is inf, as on the device, not a host-value refusal."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff


@pytest.mark.parametrize(
    "name, call",
    [
        ("np.copyto", lambda x, o, t: np.copyto(x, np.zeros(3))),
        ("np.fill_diagonal", lambda x, o, t: np.fill_diagonal(t, 5.0)),
        ("np.put", lambda x, o, t: np.put(x, [0], [7.0])),
        ("np.concatenate", lambda x, o, t: np.concatenate([x, x], out=o)),
        ("np.dot", lambda x, o, t: np.dot(np.ones((3, 3)), np.ones(3), x)),  # positional out
    ],
)
def test_numpy_writes_into_a_tensor_are_refused(device, name, call):
    x = pydiff.ones((3,), device=device)
    o = pydiff.zeros((6,), device=device)
    t = pydiff.ones((3, 3), device=device)
    with pytest.raises(TypeError, match=f"{name}: it would write into a pydiff.Tensor"):
        call(x, o, t)
    np.testing.assert_array_equal(x.numpy(), np.ones(3))  # nothing changed either


def test_numpy_reading_a_tensor_into_an_array_still_works(device):
    x = pydiff.tensor([1.0, 2.0, 3.0], device=device)
    dst = np.zeros(3, dtype=np.float32)
    np.copyto(dst, x)
    np.testing.assert_array_equal(dst, [1.0, 2.0, 3.0])
    assert float(np.dot(x, x)) == 14.0


class _HugeHostGradient(pydiff.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return np.full(3, 3e38)  # a NumPy gradient: added on the host


def test_a_numpy_gradient_summing_past_the_range_is_inf_as_on_the_device(device):
    x = pydiff.ones((3,), device=device).requires_grad_()
    with pydiff.Tape() as tape:
        y = _HugeHostGradient.apply(x) + _HugeHostGradient.apply(x)
        loss = y.sum()
    with np.errstate(over="ignore"):
        want = (np.float32(3e38) + np.float32(3e38)) * np.ones(3, np.float32)  # IEEE: inf
    tape.backward(loss)
    np.testing.assert_array_equal(x.grad.numpy(), want)
