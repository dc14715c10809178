"""Zeroing policies: ACCUMULATE (default), RESET and STRICT; global, context and per tensor."""

import numpy as np
import pytest

import pydiff


def _setup(device, load):
    m = load("calls", device)
    x = pydiff.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    return m, x, 2 * np.array([1.0, 2.0, 3.0])


def test_accumulate_adds(device, load):
    m, x, g = _setup(device, load)
    m.square.bwds(x, _result=1.0)
    m.square.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), 2 * g)


def test_reset_global(device, load):
    m, x, g = _setup(device, load)
    pydiff.set_zero_policy("reset")
    assert pydiff.get_zero_policy() is pydiff.ZeroPolicy.RESET
    m.square.bwds(x, _result=1.0)
    m.square.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), g)


def test_reset_context_manager_restores(device, load):
    m, x, g = _setup(device, load)
    with pydiff.zero_policy("reset"):
        m.square.bwds(x, _result=1.0)
        m.square.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), g)
    assert pydiff.get_zero_policy() is pydiff.ZeroPolicy.ACCUMULATE
    m.square.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), 2 * g)


def test_strict_raises_naming_tensor_parameter_and_earlier_backward(device, load):
    m, x, g = _setup(device, load)
    with pydiff.zero_policy(pydiff.ZeroPolicy.STRICT):
        m.square.bwds(x, _result=1.0)
        with pytest.raises(
            pydiff.StaleGradientError, match=r"calls\.square: parameter 'x'.*square\.bwds"
        ):
            m.square.bwds(x, _result=1.0)
        np.testing.assert_allclose(x.grad.numpy(), g)  # nothing was added by the refused call
        x.zero_grad()
        m.square.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), g)


def test_per_tensor_policy_overrides_global(device, load):
    m, x, g = _setup(device, load)
    other = pydiff.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    x.zero_policy = "reset"
    for _ in range(3):
        m.square.bwds(x, _result=1.0)
        m.square.bwds(other, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), g)
    np.testing.assert_allclose(other.grad.numpy(), 3 * g)


def test_per_tensor_strict(device, load):
    m, x, _ = _setup(device, load)
    x.zero_policy = pydiff.ZeroPolicy.STRICT
    m.square.bwds(x, _result=1.0)
    with pytest.raises(pydiff.StaleGradientError):
        m.square.bwds(x, _result=1.0)


def test_strict_allows_user_set_upstream(device, load):
    """A gradient the user wrote (an upstream) is not a stale backward result."""
    m, x, _ = _setup(device, load)
    with pydiff.zero_policy("strict"):
        x.grad.fill(0.0)
        m.square.bwds(x, _result=1.0)


def test_bad_policy_name():
    with pytest.raises(ValueError, match="zero policy 'sometimes'"):
        pydiff.set_zero_policy("sometimes")
