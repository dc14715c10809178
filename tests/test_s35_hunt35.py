"""Cases found by the fifteenth session's adversarial hunt (hunt35), each against an
independent expectation.

- A tensor of structs with gradient buffers (a struct result made on a tape) passed to the
  next call failed with SlangPy's raw "Type 'RWDiffTensor<P, 1>' not found" and the tensor's
  bytes; now a TypeError names the parameter and says what to do.
- An interface tensor store at an index outside the tensor (reversed grid indices) made the
  backward's race check fail with NumPy's raw "index 4294967294 is out of bounds"; now a
  ValueError names the parameter, its shape, and says what to check.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import slangpy as spy

import pydiff

OUT_OF_BOUNDS = r"""
import slangpy;
[Differentiable] void cp(int2 idx, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y) {
    y[int2(idx.y, idx.x)] = x[int2(idx.x, idx.y)] * 2.0;
}
"""


def test_store_outside_the_tensor_is_named(device):
    m = pydiff.load_module_from_source("s35_oob", OUT_OF_BOUNDS, device=device)
    x = pydiff.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=device)
    x.requires_grad_(True)
    y = pydiff.zeros((2, 3), device=device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (pydiff's index-order hint)
        with pydiff.Tape() as tape:
            m.cp(spy.grid((2, 3)), x, y)
        with pytest.raises(ValueError, match=r"parameter 'y' \(shape \(2, 3\)\).*outside"):
            tape.backward(y, grad=np.ones((2, 3)))


def test_fwds_double_argument_without_a_tangent(device):
    """A double tensor without a tangent in ``.fwds`` has tangent 0 (as a float one), instead
    of a TypeError saying double tensors cannot have gradients."""
    m = pydiff.load_module_from_source(
        "s35_fwds_double",
        "[Differentiable] double fd(double a, double b) { return a * a * b; }",
        device=device,
    )
    a, b = np.array([1.0, 2.0, -1.5]), np.array([3.0, 4.0, 0.25])
    ta = pydiff.tensor(a, dtype="double", device=device).with_tangent(np.ones(3))
    y, dy = m.fd.fwds(ta, pydiff.tensor(b, dtype="double", device=device))
    np.testing.assert_allclose(y.numpy(), a * a * b, rtol=1e-12)
    np.testing.assert_allclose(dy.numpy(), 2 * a * b, rtol=1e-12)


STRUCTS = r"""
struct P : IDifferentiable { float a; float b; };
[Differentiable] P sr(float a) { P p; p.a = a * a; p.b = 2.0 * a; return p; }
[Differentiable] float sf(P p, float x) { return p.a * x + p.b; }
"""


def test_struct_tensor_with_gradients_is_refused_by_name(device):
    m = pydiff.load_module_from_source("s35_structs", STRUCTS, device=device)
    a = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    x = pydiff.tensor([3.0, 4.0], device=device)
    off = m.sf(m.sr(a, _result="tensor"), x, _result="tensor")  # off a tape: no gradients
    np.testing.assert_allclose(off.numpy(), [1.0 * 3 + 2, 4.0 * 4 + 4])
    with pydiff.Tape():
        p = m.sr(a, _result="tensor")
        with pytest.raises(TypeError, match=r"parameter 'p' got a tensor of struct P"):
            m.sf(p, x, _result="tensor")
        z = m.sf(p.detach(), x, _result="tensor")  # what the message offers
    np.testing.assert_allclose(z.numpy(), [1.0 * 3 + 2, 4.0 * 4 + 4])
    with pytest.raises(TypeError, match=r"parameter 'p' got a tensor of struct P"):
        m.sf.bwds(p, x, _result=z.with_grads(ones=True))
