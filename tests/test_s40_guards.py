"""A refused call changes nothing; a replay honours the modes an eager step would.

- Under the RESET zeroing policy a ``.bwds`` zeroes each gradient buffer as it binds the
  parameter. A call refused after that (a later argument that does not broadcast, a
  ``_result`` of the wrong kind, a raw SlangPy tensor) must leave every gradient as it was:
  the buffers it zeroed are kept first and put back (pydiff.bwds_binding).
- A step captured with deterministic mode off and replayed with it on would run kernels
  deterministic mode refuses to record: replay() refuses, naming the mode.

Values against closed forms and NumPy, never against pydiff's own output.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import slangpy as spy

import pydiff

SOURCE = """
[Differentiable] float prod2(float a, float b) { return a * b; }
[Differentiable] float cube(float a) { return a * a * a; }
"""
_names = itertools.count()
N = 4


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source(f"s40_guards_{next(_names)}", SOURCE, device=device)


def _with_grad(device, values, grad_fill: float) -> pydiff.Tensor:
    t = pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=True)
    t.grad.copy_from_numpy(np.full(t.shape, grad_fill, np.float32))
    return t


def _parts(device):
    a = np.arange(1, N + 1, dtype=np.float32)
    b = np.arange(2, N + 2, dtype=np.float32)
    x, w = _with_grad(device, a, 7.0), _with_grad(device, b, 9.0)
    y = pydiff.zeros((N,), device=device).with_grads(ones=True)
    return a, b, x, w, y


def _bad_broadcast(device):  # a later argument SlangPy refuses when it binds the call
    return _with_grad(device, np.arange(N - 1), 5.0)


BAD_LATER = {
    "broadcast": lambda device: _bad_broadcast(device),
    "raw slangpy tensor": lambda device: spy.Tensor.from_numpy(
        device.native, np.ones(N, np.float32)
    ),
}


@pytest.mark.parametrize("policy", ["reset", "accumulate"])
@pytest.mark.parametrize("bad", sorted(BAD_LATER))
def test_bwds_refused_after_binding_leaves_gradients(device, mod, policy, bad):
    a, b, x, w, y = _parts(device)
    with pydiff.zero_policy(policy):
        with pytest.raises((ValueError, TypeError)):
            mod.prod2.bwds(x, BAD_LATER[bad](device), _result=y)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(N, 9.0, np.float32))
    np.testing.assert_array_equal(y.grad.numpy(), np.ones(N, np.float32))
    with pydiff.zero_policy(policy):  # a valid call afterwards: d(ab)/da = b, d/db = a
        mod.prod2.bwds(x, w, _result=y)
    base_x, base_w = (0.0, 0.0) if policy == "reset" else (7.0, 9.0)
    np.testing.assert_allclose(x.grad.numpy(), base_x + b, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), base_w + a, rtol=1e-6)


@pytest.mark.parametrize("result", ["numpy", "string"])
def test_bwds_refused_result_under_reset_leaves_gradients(device, mod, result):
    a, b, x, w, _ = _parts(device)
    bad = np.ones(N, np.float32) if result == "numpy" else "tensor"
    with pydiff.zero_policy("reset"):
        with pytest.raises((TypeError, ValueError)):
            mod.prod2.bwds(x, w, _result=bad)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(N, 9.0, np.float32))


def test_bwds_refused_under_tensor_reset_policy(device, mod):
    """The tensor's own policy (``x.zero_policy = "reset"``) under a global ACCUMULATE."""
    a, b, x, w, y = _parts(device)
    x.zero_policy = "reset"
    with pytest.raises(ValueError, match="broadcast"):
        mod.prod2.bwds(x, _bad_broadcast(device), _result=y)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0, np.float32))
    mod.prod2.bwds(x, w, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), b, rtol=1e-6)
