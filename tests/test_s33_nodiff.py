"""Interface tensors marked ``no_diff`` get no gradient (breaker gridbwd33): their loads added
into the tensor's gradient buffer anyway, on SlangPy's path and the generated one, because
reflection reports ``no_diff`` for every non-differentiable parameter type and pydiff could
not tell the marked ones apart (``pydiff.lint_nodiff`` reads them from the source)."""

from __future__ import annotations

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff.errors import GradientFlowWarning
from pydiff.lint_nodiff import no_diff_tensors


def test_the_source_scan_finds_the_marked_parameters():
    source = """
    // void f(no_diff IDiffTensor<float, 1> commented) {}
    [Differentiable]
    void f(int i, no_diff IDiffTensor<float, 1> x, IDiffTensor<float, 1> w) { }
    namespace A { [Differentiable] float g<T : IFloat>(no_diff in IRWDiffTensor<float, 2> z, T t)
    { return 0; } }
    float h(no_diff float k, IDiffTensor<float, 1> y) { return k; }
    """
    # Every parameter written no_diff, by its function's name in its namespace (the caller
    # keeps the diff tensors among them, by their reflected types: break34)
    assert no_diff_tensors(source) == {"f": {"x"}, "A::g": {"z"}, "h": {"k"}}


def test_a_no_diff_tensor_in_a_tape_and_in_bwds(device):
    src = """import slangpy;
[Differentiable]
void scaled(int idx, no_diff IDiffTensor<float, 1> s, IDiffTensor<float, 1> x,
            IWDiffTensor<float, 1> y)
{ y[idx] = s[idx] * x[idx] * x[idx]; }
"""
    m = pydiff.load_module_from_source("s33_nodiff", src, device=device)
    n = 64
    ss = np.linspace(1.0, 2.0, n, dtype=np.float32)
    xs = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    s = pydiff.tensor(ss, device=device, requires_grad=True)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = pydiff.zeros((n,), device=device)
    with pytest.warns(GradientFlowWarning, match="'s' is no_diff"):
        with pydiff.Tape() as tape:
            m.scaled(spy.grid((n,)), s, x, y)
        tape.backward(y, grad=pydiff.tensor(np.ones(n, np.float32), device=device))
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * ss * xs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(s.grad.numpy(), 0.0)
