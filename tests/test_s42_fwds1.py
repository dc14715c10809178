"""``.fwds`` under generated.MIN_ELEMENTS: the value and the tangent come back from ONE
SlangPy call (the wrapper's ``_out`` entry point writes two outputs), not a forward call
plus a ``_split`` call; results contiguous and right against float64 closed forms."""

import importlib

import numpy as np
import pytest
import pydiff

SRC = """import slangpy;
[Differentiable] float cube(float a) { return a * a * a; }
[Differentiable] float wave(float a, float b) { return sin(a) * b; }
[Differentiable] double dcube(double a) { return a * a * a; }
"""


@pytest.fixture(scope="module")
def m():
    return pydiff.load_module_from_source("s42_fwds1", SRC)


def _counting(monkeypatch):
    """Counts pydiff's SlangPy calls (forward_call, by each module that calls it)."""
    calls = []
    from pydiff import forward_call as fc

    def counted(fn, args, kwargs):
        calls.append(fn.name)
        return fc.forward_call(fn, args, kwargs)

    for where in ("module", "forward_mode", "forward_pair"):
        try:
            found = importlib.import_module(f"pydiff.{where}")
        except ImportError:
            continue  # (forward_pair: not in older trees)
        monkeypatch.setattr(found, "forward_call", counted, raising=False)
    return calls


def _f32(a):
    return np.asarray(a, np.float32).astype(np.float64)


@pytest.mark.parametrize("n", [16, 5000])
def test_one_input_closed_form_contiguous(m, n):
    xs, us = _f32(np.linspace(-2, 2, n)), _f32(np.cos(np.arange(n)))
    x = pydiff.tensor(xs.astype(np.float32)).with_tangent(us.astype(np.float32))
    y, dy = m.cube.fwds(x)
    assert type(y) is pydiff.Tensor and type(dy) is pydiff.Tensor
    assert y.shape == dy.shape == (n,)
    np.testing.assert_allclose(y.numpy(), xs**3, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dy.numpy(), 3 * xs**2 * us, rtol=1e-6, atol=1e-6)
    # contiguous: the ops that refuse strided tensors take them
    np.testing.assert_allclose(float(pydiff.ops.sum(dy).numpy()), (3 * xs**2 * us).sum(), rtol=1e-4)
    assert dy.reshape((n, 1)).shape == (n, 1)


@pytest.mark.parametrize("n", [16, 5000])
def test_two_inputs_number_and_numpy_result(m, n):
    xs, us = _f32(np.linspace(-3, 3, n)), _f32(np.sin(np.arange(n)) + 0.5)
    x = pydiff.tensor(xs.astype(np.float32)).with_tangent(us.astype(np.float32))
    b = pydiff.tensor(np.full(n, 2.5, np.float32))
    y, dy = m.wave.fwds(x, b)
    np.testing.assert_allclose(y.numpy(), np.sin(xs) * 2.5, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dy.numpy(), np.cos(xs) * 2.5 * us, rtol=1e-5, atol=1e-6)
    y, dy = m.wave.fwds(x, (3.0, 0.5), _result="numpy")
    assert type(y) is np.ndarray and type(dy) is np.ndarray
    np.testing.assert_allclose(dy, np.cos(xs) * 3.0 * us + np.sin(xs) * 0.5, rtol=1e-5, atol=1e-6)


def test_double(m):
    xs = np.linspace(-2, 2, 16)
    x = pydiff.tensor(xs, dtype="double").with_tangent(np.full(16, 0.5))
    y, dy = m.dcube.fwds(x)
    np.testing.assert_allclose(y.numpy(), xs**3, rtol=1e-12)
    np.testing.assert_allclose(dy.numpy(), 1.5 * xs**2, rtol=1e-12)


@pytest.mark.usefixtures("auto_sizes")  # (a small call, as by default in every mode)
def test_small_fwds_is_one_slangpy_call(m, monkeypatch):
    x = pydiff.tensor(np.arange(16, dtype=np.float32)).with_tangent(np.ones(16, np.float32))
    m.cube.fwds(x)  # (compiles the wrapper)
    calls = _counting(monkeypatch)
    y, dy = m.cube.fwds(x)
    assert len(calls) == 1, calls  # before: 2 (the forward-mode call, then the _split call)
    np.testing.assert_allclose(dy.numpy(), 3 * np.arange(16.0) ** 2)
    b = pydiff.tensor(np.full(16, 2.0, np.float32))
    m.wave.fwds(x, b)
    calls.clear()
    m.wave.fwds(x, b)
    assert len(calls) == 1, calls


def test_fallbacks_stay_right(m):
    # a 0-d tensor and numbers: the call's shape is left to SlangPy (the R[2] path)
    y, dy = m.cube.fwds(pydiff.tensor(np.float32(2.0)).with_tangent(np.float32(1.0)))
    assert y.shape == () and float(dy.numpy()) == pytest.approx(12.0)
    assert m.cube.fwds((2.0, 1.0)) == pytest.approx((8.0, 12.0))
    # tensors of different shapes (broadcast): SlangPy's path
    x = pydiff.tensor(np.arange(4, dtype=np.float32)).with_tangent(np.ones(4, np.float32))
    b = pydiff.tensor(np.full((3, 4), 2.0, np.float32))
    y, dy = m.wave.fwds(x, b)
    assert dy.shape == (3, 4)
    np.testing.assert_allclose(
        dy.numpy(), np.broadcast_to(np.cos(np.arange(4.0)) * 2, (3, 4)), rtol=1e-5
    )
