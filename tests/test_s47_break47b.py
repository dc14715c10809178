"""break47b: session 47's changes broken as a user would (hessian shapes, integers a float
cannot hold, forward mode at infinite primals, handles of tensors made off a tape).
References: PyTorch float64 (torch.autograd.functional.hessian, torch.func.jvp), closed forms,
Python's exact integers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff

torch = pytest.importorskip("torch")

SOURCE = """
import slangpy;
[Differentiable] float e3(float3 v) { return v.x * v.x * v.y + sin(v.z) * v.y; }
[Differentiable] float ex(float x) { return exp(x); }
[Differentiable] float dv(float x, float y) { return x / y; }
"""


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s47_break47b", SOURCE, device=device)


def _e3_torch(v):
    return v[0] ** 2 * v[1] + torch.sin(v[2]) * v[1]


def test_hessian_of_a_0d_float3_tensor(device, m):
    # A 0-d float3 tensor (one float3 value) is one differentiated input of shape (3,):
    # x.shape + x.shape = (3, 3). hvp built its direction with float() of the (3,) array
    # (TypeError: only 0-dimensional arrays can be converted to Python scalars).
    v = np.array([0.3, -0.5, 0.9], np.float32)
    x = pydiff.tensor(v, dtype="float3", device=device)
    assert x.shape == ()
    want = torch.autograd.functional.hessian(_e3_torch, torch.tensor(v.astype(np.float64))).numpy()
    got = pydiff.hessian(m.e3, (x,))
    assert got.shape == (3, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    (h,) = pydiff.hvp(m.e3, (x,), (np.array([0.0, 1.0, 0.0]),))
    np.testing.assert_allclose(h.numpy(), want[:, 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [2**64 + 1, 2**70 + 1, -(2**70) - 1, 2**64 + 2**40])
def test_integers_past_64_bits_are_refused_for_floats(device, value):
    # NumPy makes an object array of them (or the scalar path skipped them): the cast to
    # float rounded silently (2**64 + 1 -> 2**64), where 2**24 + 1 is refused.
    assert int(float(np.float32(value))) != value  # (the reference: not exact in float32)
    name = str(value)
    with pytest.raises(ValueError, match=name):
        pydiff.tensor([value, 1], dtype="float", device=device)
    with pytest.raises(ValueError, match=name):
        pydiff.full((2,), value, device=device)
    with pytest.raises(ValueError, match=name):
        pydiff.zeros((2,), device=device).fill(value)
    x = pydiff.tensor([1.0, -1.0], device=device)
    with pytest.raises(ValueError, match=name):
        x + value
    with pytest.raises(ValueError, match=name):  # (OverflowError "Python int too large")
        pydiff.tensor([value], dtype="int", device=device)


def test_exact_integers_past_64_bits_and_overflow(device):
    # 2**70 is a float32 exactly: kept; 2**200 is beyond float32: refused as overflow.
    for make in (
        lambda v: pydiff.tensor([v], dtype="float", device=device),
        lambda v: pydiff.full((1,), v, device=device),
    ):
        assert make(2**70).numpy()[0] == np.float32(2.0**70)
        with pytest.raises(ValueError, match="inf"):
            make(2**200)
    assert pydiff.tensor([2**70], dtype="double", device=device).numpy()[0] == 2.0**70


@pytest.mark.xfail(
    strict=True,
    reason="Slang's derivative of x / y is (dx * y - x * dy) / (y * y): with dy the folded "
    "literal zero it is still 0 / 0 = NaN at y = 0, where PyTorch's dx / y gives inf",
)
def test_fwds_of_a_quotient_at_a_zero_denominator_without_its_tangent(device, m):
    want = torch.func.jvp(
        lambda x: x / torch.tensor(0.0, dtype=torch.float64),
        (torch.tensor(1.0, dtype=torch.float64),),
        (torch.tensor(1.0, dtype=torch.float64),),
    )[1].item()
    assert want == float("inf")
    x = pydiff.tensor([1.0, 2.0], device=device).with_tangent([1.0, 1.0])
    _, dy = m.dv.fwds(x, np.zeros(2, np.float32))
    np.testing.assert_array_equal(dy.numpy(), [np.inf, np.inf])


def _flow_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, pydiff.GradientFlowWarning)]


def test_bwds_of_the_handle_of_a_slice_made_off_a_tape_warns(device, m):
    # s = x[1:4] off a tape is a copy with no path back to x: .bwds(s) warns; a tensor made
    # from s's handle (pydiff.Tensor(s.native, dev)) gave x no gradient without a word.
    xs = np.linspace(-1.0, 1.0, 7).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    s = x[1:4]
    view = pydiff.Tensor(s.native, device)
    got = _flow_warnings(lambda: m.ex.bwds(view, _result=1.0))
    assert any("parameter 'x'" in w and "off a tape" in w for w in got), got
    assert x.grad is None or not np.any(x.grad.numpy())


def test_bwds_of_the_handle_of_a_temporary_slice_warns(device, m):
    # MADE_OFF_TAPE notes the tensor x[2:5], which dies before its handle is wrapped: the
    # note is kept with the handle since s48 (handles.describe_with), with the slice's storage.
    xs = np.linspace(-1.0, 1.0, 9).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    view = pydiff.Tensor(x[2:5].native, device)
    got = _flow_warnings(lambda: m.ex.bwds(view, _result=1.0))
    assert any("parameter 'x'" in w and "off a tape" in w for w in got), got
    assert x.grad is None or not np.any(x.grad.numpy())
