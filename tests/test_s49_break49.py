"""break49: a demanding user of the generated kernels (issue 16), each case against an
independent reference (float64 NumPy closed forms), each failing before its fix.

- ``generated.stats()`` is documented to name the reason for every large call that takes
  SlangPy's path ("Declined ... NumPy arrays as arguments; SlangPy options; a number as the
  upstream gradient; NumPy tangents in .fwds"). Large calls declined before the generator
  looked at them were not counted at all: NumPy arrays as the only array arguments, a
  ``_result`` of ``"numpy"`` or a NumPy array, a number as ``.bwds``' upstream, a NumPy
  ``(value, tangent)`` pair in ``.fwds``: ``stats()`` said nothing, so nothing said which
  path the call took.
- A ``.fwds`` on SlangPy's path counted as ``forward_fallback`` too (its wrapper's forward
  call, ``declined: returns void``, or a second ``PYDIFF_GENERATED=0``): one call, two or
  three paths in ``stats()``.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import pydiff
from pydiff import generated

SRC = """
[Differentiable] float b49f(float a, float x) { return a * x * x + sin(x); }
[Differentiable] float b49h(float x, float y) { return x * y + x / y; }
[Differentiable] float3 b49v(float3 n, float k) { return n * k * n.x; }
"""
N = 5000  # over the 4096-element threshold: these calls are "large"


@pytest.fixture(scope="module")
def mod():
    return pydiff.load_module_from_source("break49_stats", SRC)


@pytest.fixture
def xs():
    return np.linspace(0.5, 2.0, N, dtype=np.float32)


def _f(a, x):
    x = np.asarray(x, np.float64)
    return a * x * x + np.sin(x)


def _declined(kind: str) -> dict:
    got = generated.stats()
    assert got.get(f"{kind}_fallback", 0) == 1, got
    reasons = [k for k in got if k.startswith("declined: ")]
    assert len(reasons) == 1, got
    return got


@pytest.fixture(autouse=True)
def _sizes(monkeypatch):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 4096)
    monkeypatch.delenv("PYDIFF_GENERATED", raising=False)
    generated.reset_stats()


def test_numpy_only_arguments_are_named(mod, xs):
    y = mod.b49f(2.0, xs, _result="tensor")
    assert np.allclose(y.numpy(), _f(2.0, xs), atol=1e-5)
    assert "ndarray" in str(_declined("forward"))


def test_numpy_result_is_named(mod, xs):
    y = mod.b49f(2.0, pydiff.tensor(xs), _result="numpy")
    assert np.allclose(y, _f(2.0, xs), atol=1e-5)
    _declined("forward")
    generated.reset_stats()
    out = np.zeros(N, np.float32)
    mod.b49f(2.0, pydiff.tensor(xs), _result=out)
    assert np.allclose(out, _f(2.0, xs), atol=1e-5)
    _declined("forward")


def test_number_upstream_is_named(mod, xs):
    x = pydiff.tensor(xs, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod.b49f.bwds(2.0, x, _result=1.0)
    x64 = xs.astype(np.float64)
    assert np.allclose(x.grad.numpy(), 4 * x64 + np.cos(x64), atol=1e-5)
    _declined("backward")


@pytest.mark.parametrize("switch", ["1", "0"])
def test_fwds_counts_once(mod, xs, monkeypatch, switch):
    monkeypatch.setenv("PYDIFF_GENERATED", switch)
    x64 = xs.astype(np.float64)
    v, d = mod.b49f.fwds(2.0, (xs, np.ones(N, np.float32)))  # a NumPy pair: SlangPy's path
    assert np.allclose(v.numpy(), _f(2.0, xs), atol=1e-5)
    assert np.allclose(d.numpy(), 4 * x64 + np.cos(x64), atol=1e-5)
    got = _declined("fwds")
    assert "forward_fallback" not in got, got
    generated.reset_stats()
    n = pydiff.tensor(np.stack([xs, xs, xs], 1)).with_tangent(np.ones((N, 3), np.float32))
    v, d = mod.b49v.fwds(n, 2.0)
    if switch == "0":
        got = _declined("fwds")
        assert "forward_fallback" not in got, got
    else:
        assert generated.stats() == {"fwds": 1, "fwds: vector": 1}
    x3 = x64[:, None] * np.ones((1, 3))
    assert np.allclose(np.asarray(v.numpy()).reshape(N, 3), 2 * x3 * x64[:, None], atol=1e-4)
    d_ref = 2 * x64[:, None] + 2 * x3  # d(k n n.x) with every tangent 1
    assert np.allclose(np.asarray(d.numpy()).reshape(N, 3), d_ref, atol=1e-4)


@pytest.mark.parametrize(
    "value, tangent, says",
    [
        (np.full(5, 1e39), np.ones(5), r"parameter 'x' \(float\): a NumPy array"),
        (np.ones(5), np.full(5, 1e39), r"parameter 'x' \(tangent\) \(float\): a NumPy array"),
        (np.zeros(0), np.zeros(0), r"parameter 'x' \(float\): got an array of shape \(0,\)"),
        (np.ones(5) * 1j, np.ones(5), r"parameter 'x' \(float\): a NumPy array of dtype complex"),
    ],
)
def test_fwds_errors_name_the_function(mod, value, tangent, says):
    """A refused NumPy (value, tangent) pair in ``.fwds`` named pydiff's internal wrapper
    (``pydiff_fwd_c10_b49f_....b49f__pydiff_fwd_c10: parameter 'x__t'``), not the call."""
    with pytest.raises((ValueError, TypeError)) as info:
        mod.b49f.fwds(2.0, (value, tangent))
    text = str(info.value)
    assert "pydiff_fwd" not in text and "__t'" not in text, text
    assert text.startswith("break49_stats.b49f.fwds: "), text
    assert re.search(says, text), text


def test_fwds_vector_error_names_the_function(mod):
    bad = (np.ones((5, 4), np.float32), np.ones((5, 4), np.float32))
    with pytest.raises(ValueError, match=r"^break49_stats\.b49v\.fwds: parameter 'n'"):
        mod.b49v.fwds(bad, 2.0)


RW_SRC = """import slangpy;
[Differentiable] void b49_scale(inout float y, float x) { y = y * x; }
[Differentiable]
void b49_rw(int idx, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> y)
{ y[idx] = y[idx] * x[idx]; }
"""


@pytest.fixture(scope="module")
def rw_mod():
    return pydiff.load_module_from_source("break49_rw", RW_SRC)


def test_read_written_tensor_without_gradients_is_refused(rw_mod):
    """A tensor read and written by the call (``inout``, ``IRWDiffTensor``) with no gradient
    buffers gave its upstream as zero: ``x.grad`` came back 0 where y is right (d(y x)/dx),
    silently; a written-only one (``IWDiffTensor``) was already refused."""
    import slangpy as spy

    y0 = np.full(5, 2.0, np.float32)
    x = pydiff.tensor(np.full(5, 3.0, np.float32), requires_grad=True)
    with pytest.raises(ValueError, match=r"parameter 'y' is read and written .* has none"):
        rw_mod.b49_scale.bwds(pydiff.tensor(y0), x)
    with pytest.raises(ValueError, match=r"parameter 'y' is read and written .* has none"):
        rw_mod.b49_rw.bwds(spy.grid((5,)), x, pydiff.tensor(y0))
    assert np.array_equal(x.grad.numpy(), np.zeros(5))  # refused before anything was added
    rw_mod.b49_rw.bwds(spy.grid((5,)), x, pydiff.tensor(y0).with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), y0)  # d(y x)/dx = y, upstream 1
    y = pydiff.tensor(y0)  # nothing else wants a gradient: nothing lost, still allowed
    rw_mod.b49_rw.bwds(spy.grid((5,)), pydiff.tensor(np.full(5, 3.0, np.float32)), y)
