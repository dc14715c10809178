"""gradcheck against central finite differences and the adjoint test."""

import numpy as np
import pytest

import pydiff


def _t(device, data, grad=True):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, requires_grad=grad)


def test_module_functions_pass(device, load):
    m = load("chain", device)
    x = _t(device, [0.3, -0.7, 1.1, 2.0])
    for fn in (m.square, m.sine, m.expo, m.cube_right):
        assert pydiff.gradcheck(fn, (x,))
    s = _t(device, [0.5])
    assert pydiff.gradcheck(m.scale, (x, s))  # a broadcast parameter


def test_catches_wrong_backward_derivative(device, load):
    m = load("chain", device)
    x = _t(device, [0.3, -0.7, 1.1])
    with pytest.raises(pydiff.GradcheckError, match=r"chain\.cube_wrong: input 0, element \(\d,\)"):
        pydiff.gradcheck(m.cube_wrong, (x,))


def test_python_callable_of_calls(device, load):
    m = load("chain", device)
    x = _t(device, [0.3, -0.7])
    s = _t(device, [1.3])

    def f(x, s):
        return m.halve_sum(
            m.times(m.sine(x, _result="tensor"), m.scale(x, s, _result="tensor"), _result="tensor"),
            _result="tensor",
        )

    assert pydiff.gradcheck(f, (x, s))


def test_leaves_values_and_gradients_as_they_were(device, load):
    m = load("chain", device)
    x = _t(device, [0.3, -0.7])
    x.grad.fill(5.0)
    pydiff.gradcheck(m.square, (x,))
    np.testing.assert_allclose(x.numpy(), [0.3, -0.7], rtol=1e-7)
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 5.0])


def test_fixed_inputs_and_errors(device, load):
    m = load("chain", device)
    x, s = _t(device, [0.3, -0.7]), _t(device, [2.0], grad=False)
    assert pydiff.gradcheck(m.scale, (x, s))
    with pytest.raises(ValueError, match="no input has requires_grad"):
        pydiff.gradcheck(m.square, (_t(device, [1.0], grad=False),))
    with pytest.raises(TypeError, match="fn must be"):
        pydiff.gradcheck(42, (x,))


def test_adjoint_test_catches_a_transposed_linear_map(device):
    """A linear map whose hand-written backward applies A instead of A^T."""
    import slangpy as spy

    src = """import slangpy;
[Differentiable] [BackwardDerivative(apply_bwd)]
float apply(int i, DiffTensor<float, 1> x)
{
    float s = 0.0;
    [MaxIters(3)] for (int j = 0; j < 3; j++) { s += float(1 + i + 3 * j) * x.load(j); }
    return s;
}
void apply_bwd(int i, DiffTensor<float, 1> x, float d)
{
    // Correct would be x.grad[j] += A[i, j] d = (1 + i + 3 j) d; this uses A[j, i].
    for (int j = 0; j < 3; j++) { x._grad_out.add(j, float(1 + j + 3 * i) * d); }
}"""
    m = pydiff.load_module_from_source("linmap", src, device=device)
    x = _t(device, [0.1, 0.2, 0.3])

    def f(x):
        return m.apply(spy.grid((3,)), x, _result="tensor")

    with pytest.raises(pydiff.GradcheckError):
        pydiff.gradcheck(f, (x,))
