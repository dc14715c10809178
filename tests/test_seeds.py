"""The SlangPy-doc examples users know (seeds 001 and 004), checked against closed forms.

The seed prints [9, 27, 53, 87] for 2x^2 + 8x - 1 at x = 1..4; the math gives
[9, 23, 41, 63], which is what we check.
"""

import numpy as np

import pydiff


def test_polynomial_broadcast(device, load):
    m = load("seeds", device)
    xs = np.array([1, 2, 3, 4], np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    y = m.polynomial(a=2.0, b=8.0, c=-1.0, x=x, _result="tensor")
    np.testing.assert_allclose(y.numpy(), [9, 23, 41, 63])
    m.polynomial.bwds(a=2.0, b=8.0, c=-1.0, x=x, _result=y.with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), 4 * xs + 8)


def test_polynomial_preallocated_result(device, load):
    m = load("seeds", device)
    x = pydiff.tensor([0.5, -1.5], device=device)
    out = pydiff.empty((2,), device=device)
    got = m.polynomial(2.0, 8.0, -1.0, x, _result=out)
    assert got is out
    np.testing.assert_allclose(out.numpy(), [2 * 0.25 + 4 - 1, 2 * 2.25 - 12 - 1])


def test_polynomial_coefficient_gradients(device, load):
    m = load("seeds", device)
    xs = np.linspace(-2, 2, 9).astype(np.float32)
    a, b, c = (pydiff.tensor([v], device=device, requires_grad=True) for v in (2.0, 8.0, -1.0))
    up = np.linspace(0.5, 1.5, 9).astype(np.float32)
    y = pydiff.tensor(np.zeros(9), device=device).with_grads()
    y.grad.copy_from_numpy(up)
    m.polynomial.bwds(a, b, c, pydiff.tensor(xs, device=device), _result=y)
    np.testing.assert_allclose(a.grad.numpy(), [np.sum(up * xs**2)], rtol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), [np.sum(up * xs)], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.grad.numpy(), [np.sum(up)], rtol=1e-5)


def test_polynomial_tensor_version(device, load):
    m = load("seeds", device)
    xs = np.array([1, 2, 3, 4], np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    result = pydiff.zeros((4,), device=device)
    import slangpy as spy

    m.polynomial_tensor(idx=spy.grid((4,)), a=2.0, b=8.0, c=-1.0, x=x, result=result)
    np.testing.assert_allclose(result.numpy(), [9, 23, 41, 63])
    result = result.with_grads(ones=True)
    m.polynomial_tensor.bwds(idx=spy.grid((4,)), a=2.0, b=8.0, c=-1.0, x=x, result=result)
    np.testing.assert_allclose(x.grad.numpy(), [12, 16, 20, 24])


def test_process_inplace_with_one_shared_buffer(device, load):
    """pydiff allocates the separate grad_in/grad_out the seed builds by hand."""
    import slangpy as spy

    m = load("seeds", device)
    x = pydiff.tensor([1.0, 2.0, 3.0, 4.0], device=device, requires_grad=True)
    m.process_inplace(idx=spy.grid((4,)), data=x)
    np.testing.assert_allclose(x.numpy(), [2, 4, 6, 8])
    x.grad.fill(1.0)  # upstream dL/d(data after)
    m.process_inplace.bwds(idx=spy.grid((4,)), data=x)
    np.testing.assert_allclose(x.grad.numpy(), [2, 2, 2, 2])


def test_process_inplace_with_separate_buffers(device, load):
    import slangpy as spy

    m = load("seeds", device)
    x = pydiff.tensor([1.0, 2.0, 3.0, 4.0], device=device)
    x = x.with_grads(
        grad_in=pydiff.ones((4,), device=device), grad_out=pydiff.zeros((4,), device=device)
    )
    m.process_inplace.bwds(idx=spy.grid((4,)), data=x)
    np.testing.assert_allclose(x.grad_out.numpy(), [2, 2, 2, 2])
    np.testing.assert_allclose(x.grad_in.numpy(), [1, 1, 1, 1])


def test_square_inplace_gradient_is_wrt_value_before(device, load):
    import slangpy as spy

    m = load("seeds", device)
    before = np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    up = np.array([1.0, 2.0, -1.0, 3.0], np.float32)
    x = pydiff.tensor(before, device=device, requires_grad=True)
    m.square_inplace(idx=spy.grid((4,)), data=x)
    np.testing.assert_allclose(x.numpy(), before**2)
    x.copy_from_numpy(before)  # bwds takes the primals of the forward call
    x.grad.copy_from_numpy(up)
    m.square_inplace.bwds(idx=spy.grid((4,)), data=x)
    np.testing.assert_allclose(x.grad.numpy(), 2 * before * up)


def test_smoothstep_custom_backward_derivative(device, load):
    m = load("seeds", device)
    xs = np.array([-0.5, 0.1, 0.25, 0.5, 0.9, 1.5], np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    import slangpy as spy

    y = m.custom_activation(spy.grid((6,)), x, _result="tensor")
    clipped = np.clip(xs, 0, 1)
    np.testing.assert_allclose(y.numpy(), clipped**2 * (3 - 2 * clipped), rtol=1e-6)
    m.custom_activation.bwds(spy.grid((6,)), x, _result=y.with_grads(ones=True))
    expected = np.where((xs > 0) & (xs < 1), 6 * xs * (1 - xs), 0.0)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-6)


def test_linear_layer_against_numpy(device, load):
    import slangpy as spy

    m = load("seeds", device)
    rng = np.random.default_rng(0)
    out_f, in_f = 5, 7
    W = rng.standard_normal((out_f, in_f)).astype(np.float32)
    bvec = rng.standard_normal(out_f).astype(np.float32)
    xin = rng.standard_normal(in_f).astype(np.float32)
    dy = rng.standard_normal(out_f).astype(np.float32)
    w, b, x = (pydiff.tensor(a, device=device, requires_grad=True) for a in (W, bvec, xin))
    y = pydiff.zeros((out_f,), device=device)
    m.linear_layer(spy.grid((out_f,)), w, b, x, y)
    np.testing.assert_allclose(y.numpy(), W @ xin + bvec, rtol=1e-5, atol=1e-5)
    y = y.with_grads()
    y.grad.copy_from_numpy(dy)
    m.linear_layer.bwds(spy.grid((out_f,)), w, b, x, y)
    np.testing.assert_allclose(w.grad.numpy(), np.outer(dy, xin), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), dy, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), W.T @ dy, rtol=1e-5, atol=1e-5)


def test_linear_layer_data_input_needs_no_gradient(device, load):
    """A data input (no requires_grad) bound to IDiffTensor just works in bwds."""
    import slangpy as spy

    m = load("seeds", device)
    W = np.arange(6, dtype=np.float32).reshape(2, 3)
    w = pydiff.tensor(W, device=device, requires_grad=True)
    b = pydiff.zeros((2,), device=device, requires_grad=True)
    x = pydiff.tensor([1.0, 2.0, 3.0], device=device)  # no gradient
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    m.linear_layer.bwds(spy.grid((2,)), w, b, x, y)
    np.testing.assert_allclose(w.grad.numpy(), np.outer([1, 1], [1, 2, 3]))


def test_batched_dense_layer_with_array_index(device):
    """The working form of the batched layer (int-array subscripts), against NumPy."""
    import slangpy as spy

    src = """import slangpy;
[Differentiable]
void dense(int[2] idx, IDiffTensor<float, 2> x, IDiffTensor<float, 2> w, IWDiffTensor<float, 2> y)
{
    int b = idx[0]; int j = idx[1];
    float s = 0.0;
    [MaxIters(16)]
    for (int k = 0; k < 5; k++) { int wi[2] = { j, k }; int xi[2] = { b, k }; s += w[wi] * x[xi]; }
    y[idx] = s;
}"""
    m = pydiff.load_module_from_source("batched_dense", src, device=device)
    rng = np.random.default_rng(3)
    X, W, U = rng.standard_normal((3, 5)), rng.standard_normal((4, 5)), rng.standard_normal((3, 4))
    x = pydiff.tensor(X, device=device, requires_grad=True)
    w = pydiff.tensor(W, device=device, requires_grad=True)
    y = pydiff.zeros((3, 4), device=device)
    m.dense(spy.grid((3, 4)), x, w, y)
    np.testing.assert_allclose(y.numpy(), X @ W.T, rtol=1e-5, atol=1e-5)
    y = y.with_grads()
    y.grad.copy_from_numpy(U)
    m.dense.bwds(spy.grid((3, 4)), x, w, y)
    np.testing.assert_allclose(w.grad.numpy(), U.T @ X, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), U @ W, rtol=1e-4, atol=1e-5)
