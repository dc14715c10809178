"""Breaker for issue 17, round b: 0-d tensors (shape ()) and torch tensors on a pydiff tape.

Values and gradients against PyTorch float64 and float64 central differences. The first block
holds the cases that fail now (nothing is xfail on purpose); the rest pin what works.
"""

import gc
import math
import threading

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")

RTOL = 2e-5


def _poly(device):
    return pydiff.load_module("samples/polynomial.slang", device=device)


def _fw(device):
    return pydiff.load_module("tests/shaders/forward.slang", device=device)


def _energy_grad(p):
    x, y, z = p
    return np.array([y * z + math.cos(x), x * z, x * y])


# ============================ cases that FAIL now ============================================


def test_vector_param_one_element_on_a_tape_gives_a_0d_tensor_and_its_gradient(device):
    """`energy(float3 p)` given one float3 (a (3,) float tensor): the call shape is (), as for
    a 0-d tensor. On a tape it must return a 0-d pydiff tensor so the gradient reaches p;
    it returns a Python float (the recorded call is lost without any error)."""
    fw = _fw(device)
    p = pydiff.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        e = fw.energy(p)
    assert isinstance(e, pydiff.Tensor), f"energy((3,)) on a tape returned {type(e).__name__}"
    assert e.shape == ()
    tape.backward(e)
    np.testing.assert_allclose(p.grad.numpy(), _energy_grad([1.0, 2.0, 3.0]), rtol=RTOL)


def test_grad_of_a_vector_param_one_element_call(device):
    """pydiff.grad(lambda p: fw.energy(p))([1, 2, 3]) -> [yz + cos x, xz, xy]; now raises
    'fn returned a float' although fn returned the shader call's result."""
    fw = _fw(device)
    g = pydiff.grad(lambda p: fw.energy(p))(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(g, _energy_grad([1.0, 2.0, 3.0]), rtol=RTOL)


def test_torch_vector_param_one_element_call_takes_part_in_torch_autograd(device):
    """A torch (3,) point into a float3 parameter: a 0-d torch result with a grad_fn; now a
    TypeError 'returned float (output 0); it must return pydiff tensors'."""
    fw = _fw(device)
    t = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    e = fw.energy(t)
    assert isinstance(e, torch.Tensor) and e.shape == ()
    e.backward()
    np.testing.assert_allclose(t.grad.numpy(), _energy_grad([1.0, 2.0, 3.0]), rtol=RTOL)


def test_fwds_with_a_torch_tensor_gives_right_values(device):
    """SILENTLY WRONG: polynomial.fwds(a=torch[2, 3, 4], 0, 0, x=1) must give values a = [2, 3, 4]
    and tangents [0, 0, 0] (as with a pydiff tensor or a NumPy array); it returns
    (array([2., 0.]), array([3., 0.])): two elements, mixed values and tangents."""
    m = _poly(device)
    y, dy = m.polynomial.fwds(torch.tensor([2.0, 3.0, 4.0]), 0.0, 0.0, 1.0)
    np.testing.assert_array_equal(np.asarray(y).reshape(-1), [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(np.asarray(dy).reshape(-1), [0.0, 0.0, 0.0])


def test_fwds_with_a_torch_tensor_x_gives_right_values(device):
    """Same with x: x^2 of torch [2, 3] must be [4, 9]; now ([4, 0], [9, 0])."""
    m = _poly(device)
    y, _ = m.polynomial.fwds(1.0, 0.0, 0.0, torch.tensor([2.0, 3.0]))
    np.testing.assert_array_equal(np.asarray(y).reshape(-1), [4.0, 9.0])


@pytest.mark.parametrize("shape", [(), (2,)])
def test_fwds_with_a_torch_tensor_that_requires_grad_is_a_clear_pydiff_error(device, shape):
    """Now torch's own RuntimeError "Can't call numpy() on Tensor that requires grad" leaks.
    Either work, or a TypeError/ValueError naming the parameter and torch."""
    m = _poly(device)
    t = torch.full(shape, 2.0, requires_grad=True)
    try:
        m.polynomial.fwds(t, 0.0, 0.0, 1.0)
    except (TypeError, ValueError) as e:
        assert "torch" in str(e) and "'a'" in str(e), str(e)


def test_bwds_with_a_torch_0d_tensor_works_or_is_a_clear_pydiff_error(device):
    """`.bwds` with a torch tensor (0-d or not) raises a RuntimeError naming no parameter:
    pydiff imported first (as here): TorchBridgeNotLoaded "...call the pydiff function, which
    takes torch tensors" (this IS the pydiff function's .bwds); torch imported first: SlangPy's
    "slangpy-torch is not installed. Install with: pip install slangpy[torch]". Either convert
    it (x.grad = 2*a*x = 4) or refuse with a TypeError naming the parameter and from_torch."""
    m = _poly(device)
    x = pydiff.tensor(1.0, device=device, requires_grad=True)
    try:
        m.polynomial.bwds(torch.tensor(2.0), 0.0, 0.0, x, _result=1.0)
    except TypeError as e:
        assert "'a'" in str(e) and "from_torch" in str(e), str(e)
    else:
        np.testing.assert_allclose(float(x.grad), 4.0, rtol=RTOL)


@pytest.mark.parametrize("primal", [3.0, np.array(3.0)], ids=["number", "np0d"])
def test_jvp_of_a_number_or_0d_array_is_0d(device, primal):
    """pydiff.tensor(3.0) is 0-d and grad/value_and_grad hand fn a 0-d tensor for a number;
    jvp hands fn a (1,) tensor and returns (1,) value and tangent (JAX: shape ())."""
    seen = []

    def f(x):
        seen.append(x.shape)
        return x * x

    y, dy = pydiff.jvp(f, (primal,), (1.0,))
    assert seen == [()], seen
    assert y.shape == () and dy.shape == ()
    assert float(y) == 9.0 and float(dy) == 6.0


@pytest.mark.parametrize("jac", ["jacfwd", "jacrev"])
def test_jacobian_of_a_number_is_0d_as_of_a_0d_tensor(device, jac):
    """jac(f)(pydiff.tensor(3.0)) has shape () = out.shape + x.shape; jac(f)(3.0) gives
    [[27.]] of shape (1, 1)."""
    f = getattr(pydiff, jac)(lambda x: x * x * x)
    assert f(pydiff.tensor(3.0, device=device)).shape == ()
    J = f(3.0)
    assert np.shape(J) == (), np.shape(J)
    np.testing.assert_allclose(J, 27.0)


def test_equality_of_a_0d_tensor_is_by_value_or_refused(device):
    """s = pydiff.tensor(4.0); `s == 4.0` is False (identity), while NumPy and torch give True
    and `s < 5.0` raises TypeError: a silently wrong answer in `if loss == 0:`."""
    s = pydiff.tensor(4.0, device=device)
    try:
        r = s == 4.0
    except TypeError:
        return
    assert bool(r) is True


def test_torch_function_inside_grad_names_torch_function(device):
    """A torch_function called inside pydiff.grad raises 'pydiff.Tape: tapes do not nest' —
    the user opened no tape; the message should say torch_function runs outside pydiff tapes."""
    f = pydiff.torch_function(lambda a: ops.sum(ops.mul(a, a)))
    with pytest.raises(Exception) as info:
        pydiff.grad(lambda x: ops.mul(x, pydiff.from_torch(f(torch.tensor([1.0, 2.0])))))(2.0)
    assert "torch_function" in str(info.value), str(info.value)


# ============================ passing areas pinned ===========================================


def test_indexing_reshape_and_conversions_of_0d(device):
    x = pydiff.tensor([1.0, 2.0, 3.0], device=device)
    s = pydiff.tensor(2.0, device=device)
    assert x[1].shape == () and float(x[-1]) == 3.0
    assert s[()].shape == () and s[...].shape == () and s.T.shape == ()
    with pytest.raises(IndexError):
        s[0]
    with pytest.raises(TypeError, match="0-d"):
        len(s)
    assert s.reshape(1, 1).shape == (1, 1) and s.reshape(-1).shape == (1,)
    with pytest.raises(ValueError, match="reshape"):
        x.reshape(())
    assert pydiff.to_torch(s).shape == () and np.asarray(s).shape == ()
    assert torch.from_dlpack(pydiff.tensor([7.0], device=device).reshape(())).item() == 7.0
    assert pydiff.from_torch(torch.tensor([1.0, 2.0, 3.0])[2]).shape == ()
    h = pydiff.from_torch(torch.tensor(3.0, dtype=torch.half))
    assert h.shape == () and h.dtype == "half"
    assert torch.signbit(pydiff.to_torch(pydiff.from_torch(torch.tensor(-0.0))))
    for bad in (torch.tensor(True), torch.tensor(1 + 2j), torch.tensor(1.0, dtype=torch.bfloat16)):
        with pytest.raises(TypeError, match=str(bad.dtype)):
            pydiff.from_torch(bad)
    with pytest.raises(ValueError, match="overflow"):
        pydiff.from_torch(torch.tensor(1e300, dtype=torch.float64), dtype="float")


CASES = {
    "index_product": (lambda x: x[1] * x[2], [[1.0, 2.0, 3.0]]),
    "index_same_twice": (lambda x: x[1] * x[1], [[1.0, 2.0, 3.0]]),
    "neg_index_cube": (lambda x: x[-1] ** 3, [[1.0, 2.0, -3.0]]),
    "0d_times_2d": (lambda s, x: (s * x * s).sum(), [2.0, [[1.0, 2.0], [3.0, 4.0]]]),
    "2d_over_0d": (lambda s, x: (x / s).mean(), [2.0, [[1.0, 2.0], [3.0, 4.0]]]),
    "0d_over_1d": (lambda s, x: (s / x).sum(), [2.0, [1.0, 2.0, 3.0]]),
    "0d_0d": (lambda s, t: s * t - t / s, [2.0, -3.0]),
    "pow_neg": (lambda s: s**-2 + s**0.5 * 0, [1.5]),
    "elementwise": (
        lambda s: s.exp() + s.log() + s.tanh() + s.sigmoid() + s.sin() * s.cos(),
        [0.3],
    ),
    "variance": (lambda x: ((x - x.mean()) ** 2).mean(), [[1.0, 2.0, 4.0]]),
    "normalise": (lambda x: (x / x.sum())[0], [[1.0, 2.0, 4.0]]),
    "dot_scaled": (lambda x: ((x @ x) * x).sum(), [[1.0, 2.0, 4.0]]),
    "log_softmax": (lambda x: (x.exp() / x.exp().sum()).log()[1], [[1.0, 2.0, 0.5]]),
    "reshape_1_1": (lambda s, x: (s.reshape(1, 1) * x).sum(), [2.0, [[1.0, 2.0], [3.0, 4.0]]]),
    "slice_to_0d": (lambda x: (x[1:2].reshape(()) * x).sum(), [[1.0, 2.0, 3.0]]),
    "axis_sum_to_0d": (lambda x: x.mean(axis=(0, 1)) ** 2, [[[1.0, 2.0], [3.0, 4.0]]]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_0d_values_and_gradients_against_torch_float64(device, name):
    fn, vals = CASES[name]
    ps = [pydiff.tensor(np.float32(v), device=device, requires_grad=True) for v in vals]
    ts = [torch.tensor(np.float64(np.float32(v)), requires_grad=True) for v in vals]
    with pydiff.Tape() as tape:
        out = fn(*ps)
    tape.backward(out)
    ref = fn(*ts)
    ref.backward()
    assert out.shape == tuple(ref.shape) == ()
    np.testing.assert_allclose(out.item(), ref.item(), rtol=RTOL)
    for p, t in zip(ps, ts):
        assert p.grad.shape == tuple(t.shape)
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_value_and_grad_of_0d_against_central_differences(device):
    m = _poly(device)
    xs = np.array([0.5, -1.25, 2.0])

    def f(s, x):
        return (m.polynomial(s, s * s, -1.0, x).sum() * s).tanh()

    def f64(s, x):
        return np.tanh(np.sum(s * x * x + s * s * x - 1.0) * s)

    s0 = 0.3
    v, (gs, gx) = pydiff.value_and_grad(f, argnums=(0, 1))(s0, xs)
    assert v.shape == () and isinstance(gs, float) and gx.shape == (3,)
    h = 1e-6
    ds = (f64(s0 + h, xs) - f64(s0 - h, xs)) / (2 * h)
    dx = [(f64(s0, xs + h * e) - f64(s0, xs - h * e)) / (2 * h) for e in np.eye(3)]
    np.testing.assert_allclose(v.item(), f64(s0, xs), rtol=1e-5)
    np.testing.assert_allclose(gs, ds, rtol=1e-4)
    np.testing.assert_allclose(gx, dx, rtol=1e-4, atol=1e-6)


def test_0d_leaf_through_shaders_and_ops_chain(device):
    m = _poly(device)
    a = pydiff.tensor(2.0, device=device, requires_grad=True)
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        loss = m.polynomial(a, x.sum(), -1.0, x).sum()  # a 0-d reduction broadcast into a call
    tape.backward(loss)
    assert loss.shape == () and a.grad.shape == ()
    assert float(loss) == 17.0 and float(a.grad) == 5.0
    np.testing.assert_allclose(x.grad.numpy(), [10.0, 14.0])


def test_grad_forms_of_0d_arguments(device):
    cube = pydiff.grad(lambda s: s * s * s)
    assert cube(2.0) == 12.0 and cube(2) == 12.0
    g = cube(np.array(2.0))
    assert isinstance(g, np.ndarray) and g.shape == ()
    g = cube(pydiff.tensor(2.0, device=device))
    assert isinstance(g, pydiff.Tensor) and g.shape == ()
    assert pydiff.grad(lambda s: s)(2.0) == 1.0
    assert pydiff.grad(lambda s: (s * s).reshape(1, 1))(2.0) == 4.0
    for bad in (True, np.bool_(True), 1 + 2j, torch.tensor(3.0)):
        with pytest.raises(TypeError, match="argument 0"):
            pydiff.grad(lambda s: s * 2.0)(bad)
    with pytest.raises(TypeError, match="returned a float"):
        pydiff.grad(lambda s: (s * s).item())(2.0)


def test_torch_0d_data_on_a_pydiff_tape(device):
    m = _poly(device)
    w = torch.tensor(3.0)
    xs = np.array([1.0, 2.0])
    np.testing.assert_allclose(pydiff.grad(lambda x: ops.sum(ops.mul(x, w)))(xs), [3.0, 3.0])
    np.testing.assert_allclose(pydiff.grad(lambda x: ops.sum(ops.mul(w, x)))(xs), [3.0, 3.0])
    np.testing.assert_allclose(
        pydiff.grad(lambda x: ops.sum(m.polynomial(w, 0.0, 0.0, x)))(xs), [6.0, 12.0]
    )
    assert (
        pydiff.grad(lambda x: m.polynomial(w, torch.tensor(1.0), torch.tensor(0.0), x))(2.0) == 13.0
    )
    assert pydiff.grad(lambda x: ops.mse_loss(x, torch.tensor(1.0)))(3.0) == 4.0
    x = pydiff.tensor(2.0, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.polynomial(x, 0.0, 0.0, torch.tensor(3.0))
    assert isinstance(y, pydiff.Tensor) and y.shape == ()
    tape.backward(y)
    assert float(x.grad) == 9.0
    # a torch tensor changed in place after the forward does not change the recorded gradient
    w2 = torch.tensor([3.0, 4.0])
    v = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        loss = ops.sum(ops.mul(ops.mul(v, v), w2))
    w2.mul_(100)
    tape.backward(loss)
    np.testing.assert_allclose(v.grad.numpy(), [6.0, 16.0])


@pytest.mark.parametrize("how", ["leaf", "nonleaf", "keyword"])
def test_torch_0d_that_requires_grad_on_a_tape_is_refused(device, how):
    m = _poly(device)
    t = torch.tensor(2.0, requires_grad=True)
    if how == "nonleaf":
        t = t * 1.0
    if how == "keyword":
        fn = lambda x: ops.sum(m.polynomial(a=t, b=0.0, c=0.0, x=x))  # noqa: E731
    else:
        fn = lambda x: ops.sum(ops.mul(x, t))  # noqa: E731
    with pytest.raises(TypeError, match="requires grad"):
        pydiff.grad(fn)(np.array([1.0, 2.0]))


def test_torch_autograd_with_0d_tensors(device):
    m = _poly(device)
    a, x = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    y = m.polynomial(a, 8.0, -1.0, x)
    (y * y).backward()
    assert y.shape == () and a.grad.shape == () and x.grad.shape == ()
    assert a.grad.item() == 2 * 41 * 9 and x.grad.item() == 2 * 41 * 20
    a = torch.tensor(2.0, requires_grad=True)
    xs = torch.tensor([1.0, 2.0], requires_grad=True)
    m.polynomial(a, 8.0, -1.0, xs).sum().backward()
    assert a.grad.shape == () and a.grad.item() == 5.0
    t = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    outs = pydiff.torch_function(lambda v: (v.sum(), v.mean(), v[1] * v[2]))(t)
    assert [o.shape for o in outs] == [(), (), ()]
    (outs[0] * outs[1] + outs[2]).backward()
    np.testing.assert_allclose(t.grad.numpy(), [2 + 6 / 3, 2 + 6 / 3 + 3, 2 + 6 / 3 + 2])
    s = torch.tensor(2.0, dtype=torch.float32, requires_grad=True)
    assert torch.autograd.gradcheck(
        pydiff.torch_function(lambda v: v * v * v), (s,), eps=1e-2, atol=1e-2, rtol=1e-2
    )
    logits = torch.tensor([[1.0, 2.0, 0.5]], requires_grad=True)
    ops.cross_entropy(logits, torch.tensor([1])).backward()
    ref = logits.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy(ref, torch.tensor([1])).backward()
    np.testing.assert_allclose(logits.grad.numpy(), ref.grad.numpy(), rtol=1e-5)
    p = torch.nn.Parameter(torch.tensor(2.0))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(30):
        opt.zero_grad()
        (m.polynomial(p, 0.0, 0.0, 1.0) ** 2).backward()
        opt.step()
    assert abs(p.item()) < 1e-2


def test_threads_grad_with_0d_and_torch_data(device):
    errors = []

    def work(i):
        try:
            for _ in range(10):
                g = pydiff.grad(lambda s, x: (s * x).sum() ** 2)(
                    float(i), np.array([1.0, 2.0, 3.0])
                )
                assert np.isclose(g, 2 * 6 * i * 6), g
                w = torch.tensor(float(i))
                g2 = pydiff.grad(lambda x: ops.sum(ops.mul(x, w)))(np.array([1.0, 2.0]))
                assert np.allclose(g2, [i, i]), g2
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_rss_flat_over_repeated_0d_steps(device):
    m = _poly(device)
    vg = pydiff.value_and_grad(
        lambda s, x: (m.polynomial(s, 1.0, 0.0, x).sum() * s) ** 2, argnums=(0, 1)
    )
    xs = np.linspace(-1, 1, 16)
    w = torch.tensor(0.5)
    tf = pydiff.torch_function(lambda a: (a * a).sum())

    def step(i):
        vg(float(i % 5) * 0.1, xs)
        pydiff.grad(lambda x: ops.sum(ops.mul(x, w)))(xs)
        tf(torch.tensor(2.0, requires_grad=True)).backward()
        pydiff.to_torch(pydiff.from_torch(torch.tensor(3.0)).sum())

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    for i in range(150):
        step(i)
    gc.collect()
    r0 = rss()
    for i in range(600):
        step(i)
    gc.collect()
    assert rss() - r0 < 16, (r0, rss())
