"""Regression tests for two wrong gradients found while reviewing the core restructuring
(issue 14) and fixed in issue 15: `.bwds` used to write forward values into the tensors a
call writes (out, inout, _result), behind the version counters, so a second tape.backward or
the gradient of a second output of one recording was wrong. References are float64 closed
forms."""

import numpy as np
import pytest

import pydiff

SOURCE = """
[Differentiable] void sq_out(float x, out float y) { y = x * x; }
[Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float sine(float x) { return sin(x); }
[Differentiable] float cube(float x) { return x * x * x; }
"""


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("known_issues", SOURCE, device=device)


def test_second_backward_after_an_in_place_call(device, m):
    X = np.array([0.5, 1.0, 2.0])
    x = pydiff.tensor(X, device=device, requires_grad=True)
    s = pydiff.tensor([3.0], device=device, requires_grad=True)
    y = pydiff.zeros((3,), device=device)
    with pydiff.Tape() as tape:
        m.sq_out(x, y)  # y = x^2
        m.scale_inout(s, y)  # y = s x^2
    for _ in range(2):
        x.zero_grad()
        s.zero_grad()
        tape.backward(y, grad=np.ones(3))
        np.testing.assert_allclose(y.numpy(), 3 * X**2, rtol=1e-6)
        np.testing.assert_allclose(x.grad.numpy(), 6 * X, rtol=1e-5)
        np.testing.assert_allclose(s.grad.numpy(), [np.sum(X**2)], rtol=1e-5)


def test_two_outputs_of_one_recording(device, m):
    X = np.array([0.5, 0.8, 1.1])
    x = pydiff.tensor(X, device=device, requires_grad=True)
    s = pydiff.tensor([3.0], device=device)
    with pydiff.Tape() as tape:
        y = m.sq(x, _result="tensor")
        m.scale_inout(s, y)  # y = 3 x^2
        a = m.sine(y, _result="tensor")
        b = m.cube(y, _result="tensor")  # 27 x^6
    tape.backward(a, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), np.cos(3 * X**2) * 6 * X, rtol=1e-4)
    x.zero_grad()
    tape.backward(b, grad=np.ones(3))
    np.testing.assert_allclose(x.grad.numpy(), 162 * X**5, rtol=1e-4)
