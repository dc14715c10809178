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


@pytest.mark.parametrize(
    "setting, error",
    [
        ({"eps": 0.0}, ValueError),
        ({"eps": float("nan")}, ValueError),
        ({"eps": -1e-3}, ValueError),
        ({"atol": float("nan")}, ValueError),
        ({"rtol": float("inf")}, ValueError),
        ({"atol": -1.0}, ValueError),
        ({"eps": "1e-3"}, TypeError),
        ({"rtol": True}, TypeError),
    ],
)
def test_a_step_or_tolerance_that_cannot_check_is_refused(device, load, setting, error):
    m = load("chain", device)
    x = _t(device, [0.3, -0.7, 1.1])
    (name,) = setting
    # cube_wrong fails a real check: with these settings it would have passed, or skipped all
    with pytest.raises(error, match=f"gradcheck: {name}="):
        pydiff.gradcheck(m.cube_wrong, (x,), **setting)


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


# --- NaN and infinite gradients (issue 15, class 9) ---
@pytest.mark.parametrize("name", ["nan_grad", "inf_grad", "half_nan"])
def test_nan_or_inf_gradient_fails(device, load, name):
    m = load("check_nan", device)
    x = _t(device, [0.3, -0.7, 1.1])
    with pytest.raises(pydiff.GradcheckError, match=r"analytic (nan|inf|-inf) where the finite"):
        pydiff.gradcheck(getattr(m, name), (x,))
    assert pydiff.gradcheck(getattr(m, name), (x,), raise_exception=False) is False
    assert pydiff.gradcheck(m.fine, (x,))  # the same module, a right derivative


def test_not_finite_function_is_not_a_pass(device, load):
    """At x = 0 log(x) is -inf: the finite difference is not finite, nothing can be checked."""
    src = "[Differentiable] float lg(float x) { return log(x); }"
    m = pydiff.load_module_from_source("gc_log", src, device=device)
    with pytest.raises(pydiff.GradcheckError, match=r"finite difference is (nan|inf|-inf)"):
        pydiff.gradcheck(m.lg, (_t(device, [0.0, 1.0]),))
    assert pydiff.gradcheck(m.lg, (_t(device, [0.5, 1.0]),))


# --- tensors nested in structs (dicts) and lists (class 10) ---
def test_struct_arguments_are_checked_field_by_field(device, load):
    m = load("check_coverage", device)
    p = {"a": _t(device, [0.5, -1.5]), "b": _t(device, [[0.2, 0.4], [-0.3, 0.9]])}
    x = _t(device, [0.3, -0.7])
    assert pydiff.gradcheck(m.affine, (p, x))
    with pytest.raises(pydiff.GradcheckError, match=r"affine_wrong: input 0\['a'\], element"):
        pydiff.gradcheck(m.affine_wrong, (p, x))
    outer = {"inner": p, "c": _t(device, [1.2, -0.6])}
    assert pydiff.gradcheck(m.nested, (outer, x))


def test_list_arguments_of_a_callable(device, load):
    m = load("check_coverage", device)
    a, b = _t(device, [0.5, -1.5]), _t(device, [[0.2, 0.4], [-0.3, 0.9]])

    def f(pair, x):
        return m.affine({"a": pair[0], "b": pair[1]}, x, _result="tensor")

    def wrong(pair, x):
        return m.affine_wrong({"a": pair[0], "b": pair[1]}, x, _result="tensor")

    x = _t(device, [0.3, -0.7])
    assert pydiff.gradcheck(f, ([a, b], x))
    with pytest.raises(pydiff.GradcheckError, match=r"input 0\[0\], element"):
        pydiff.gradcheck(wrong, ([a, b], x))


# --- functions writing their inputs in place: restored between evaluations ---
@pytest.mark.parametrize("name", ["scale_inout", "two_inouts"])
def test_inout_functions_pass_and_inputs_are_restored(device, load, name):
    m = load("check_coverage", device)
    s = _t(device, [0.5, -1.2])
    a = _t(device, [0.3, 0.9])
    args = (s, a) if name == "scale_inout" else (s, a, _t(device, [[1.1, 0.2], [-0.4, 0.7]]))
    before = [t.numpy().copy() for t in args]
    assert pydiff.gradcheck(getattr(m, name), args)
    for t, b in zip(args, before):
        np.testing.assert_array_equal(t.numpy(), b)
    # an inout input that wants no gradient is restored too, and gets no gradient buffer
    held = _t(device, [0.3, 0.9], grad=False)
    assert pydiff.gradcheck(m.scale_inout, (s, held))
    np.testing.assert_array_equal(held.numpy(), np.float32([0.3, 0.9]))
    assert not held.requires_grad


def test_inout_wrong_derivative_fails(device, load):
    m = load("check_coverage", device)
    s, v = _t(device, [0.5, -1.2]), _t(device, [0.3, 0.9])
    with pytest.raises(pydiff.GradcheckError, match=r"scale_inout_wrong: input 1, element"):
        pydiff.gradcheck(m.scale_inout_wrong, (s, v))


def test_rw_tensor_in_place(device, load):
    import slangpy as spy

    m = load("check_coverage", device)
    d = _t(device, [0.3, -0.9, 1.3])

    def f(fn):
        def call(d):
            fn(spy.grid((3,)), d)
            return d

        return call

    assert pydiff.gradcheck(f(m.square_inplace), (d,))
    np.testing.assert_array_equal(d.numpy(), np.float32([0.3, -0.9, 1.3]))
    with pytest.raises(pydiff.GradcheckError):
        pydiff.gradcheck(f(m.square_inplace_wrong), (d,))


# --------------------------------------------------------------------------------------
# issue 15: one tensor passed twice, identity Functions, generic functions, half values

SAME_TWICE = """
import slangpy;
[Differentiable] float times(float a, float b) { return a * b; }
[Differentiable] float poly3(float a, float b, float c) { return a * b * c + a; }
[Differentiable] float3 vtimes(float3 a, float3 b) { return a * b; }
[BackwardDerivative(times_bwd)]
float times_wrong(float a, float b) { return a * b; }
void times_bwd(inout DifferentialPair<float> a, inout DifferentialPair<float> b, float d)
{ a = diffPair(a.p, b.p * d); b = diffPair(b.p, 0.0); }
[Differentiable][ForwardDerivative(times_fwd)]
float times_fwd_wrong(float a, float b) { return a * b; }
DifferentialPair<float> times_fwd(DifferentialPair<float> a, DifferentialPair<float> b)
{ return diffPair(a.p * b.p, b.p * a.d); }
[Differentiable] T gcube<T : __BuiltinFloatingPointType>(T x) { return x * x * x; }
[Differentiable] T gaxpy<T : __BuiltinFloatingPointType>(T a, T x, T y) { return a * x + y; }
[Differentiable] half hsq(half x) { return x * x; }
[Differentiable] float hmix(half h, float y) { return float(h) * float(h) * y; }
[BackwardDerivative(hsq_bwd)]
half hsq_wrong(half x) { return x * x; }
void hsq_bwd(inout DifferentialPair<half> x, half d) { x = diffPair(x.p, half(2.2) * x.p * d); }
"""


@pytest.fixture(scope="module")
def twice(device):
    return pydiff.load_module_from_source("gradcheck_twice", SAME_TWICE, device=device)


def test_same_tensor_twice_is_one_variable(device, twice):
    x = _t(device, [0.5, 1.0, -2.0])
    assert pydiff.gradcheck(twice.times, (x, x), check_forward=True)  # d(x^2) = 2x
    assert pydiff.gradcheck(twice.poly3, (x, x, x), check_forward=True)  # d(x^3 + x)
    y = _t(device, [0.3, -0.4, 1.2])
    assert pydiff.gradcheck(twice.poly3, (x, y, x), check_forward=True)
    assert pydiff.gradcheck(twice.poly3, (x, x.reshape((3,)), y), check_forward=True)
    v = pydiff.tensor(
        np.float32([[0.5, 1.0, -2.0], [1.5, -0.3, 0.7]]),
        dtype="float3",
        device=device,
        requires_grad=True,
    )
    assert pydiff.gradcheck(twice.vtimes, (v, v), check_forward=True)


def test_same_tensor_twice_wrong_derivatives_still_fail(device, twice):
    x = _t(device, [0.5, 1.0, -2.0])
    with pytest.raises(pydiff.GradcheckError, match="times_wrong"):
        pydiff.gradcheck(twice.times_wrong, (x, x))  # backward gives x, not 2x
    with pytest.raises(pydiff.GradcheckError, match="forward mode"):
        pydiff.gradcheck(twice.times_fwd_wrong, (x, x), check_forward=True)  # JVP x u


def test_identity_function_without_backward(device, load):
    m = load("chain", device)

    class Ident(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    class Flat(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return x.reshape((x.numel,))

    class Both(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return x, m.square(x, _result="tensor")

    x = _t(device, [0.3, -0.7, 1.1])
    assert pydiff.gradcheck(Ident, (x,))
    assert pydiff.gradcheck(
        Flat, (pydiff.tensor(np.ones((2, 2), np.float32), device=device, requires_grad=True),)
    )
    assert pydiff.gradcheck(Both, (x,))
    held = _t(device, [2.0, 3.0, 4.0], grad=False)  # an identity of a held input adds nothing
    assert pydiff.gradcheck(
        lambda a, b: (Ident.apply(b), m.times(a, b, _result="tensor")), (x, held)
    )


def test_identity_function_with_a_wrong_backward_fails(device):
    class Halve(pydiff.Function):  # forward is the identity, backward claims 0.5
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return 0.5 * g.numpy()

    with pytest.raises(pydiff.GradcheckError, match="Halve"):
        pydiff.gradcheck(Halve, (_t(device, [0.3, -0.7, 1.1]),))


def test_generic_functions(device, twice):
    x = _t(device, [0.5, 1.0, -2.0])
    assert pydiff.gradcheck(twice.gcube, (x,), check_forward=True)
    y, dy = twice.gcube.fwds(x.detach().with_tangent(np.ones(3)))
    np.testing.assert_allclose(dy.numpy(), 3 * np.float64([0.5, 1.0, -2.0]) ** 2, rtol=1e-6)
    a, b = _t(device, [0.3, -0.7, 1.1]), _t(device, [2.0, 0.1, -1.0])
    assert pydiff.gradcheck(twice.gaxpy, (a, x, b), check_forward=True)
    _, dz = twice.gaxpy.fwds((2.0, 1.0), x.detach().with_tangent(np.zeros(3)), (0.5, 0.0))
    np.testing.assert_allclose(dz.numpy(), [0.5, 1.0, -2.0], rtol=1e-6)  # d/da (a x) = x
    h = pydiff.tensor(
        np.float32([0.5, 1.0, -1.25]), dtype="half", device=device, requires_grad=True
    )
    _, dh = twice.gcube.fwds(h.detach().with_tangent(np.ones(3)))
    assert dh.dtype == "half"
    np.testing.assert_allclose(dh.numpy(), 3 * np.float64([0.5, 1.0, -1.25]) ** 2, rtol=2e-3)


def test_half_values_follow_half_precision(device, twice):
    h = pydiff.tensor(
        np.float32([0.5, 1.0, -1.3, 0.77]), dtype="half", device=device, requires_grad=True
    )
    y = _t(device, [0.4, -1.1, 0.9, 1.4])
    assert pydiff.gradcheck(twice.hsq, (h,))
    assert pydiff.gradcheck(twice.hmix, (h, y))
    with pytest.raises(pydiff.GradcheckError, match="hsq_wrong"):  # 10% off still fails
        pydiff.gradcheck(twice.hsq_wrong, (h,))


def test_closed_over_parameters_keep_their_grad(device):
    # gradcheck's upstream v is random: added into a model parameter the function closes
    # over, it would corrupt the training step it is called in (vjp/jacrev/hvp lend buffers).
    from pydiff import ops

    W = _t(device, [0.3, 0.7, -0.2])
    view = W.reshape((3, 1))
    x = _t(device, [0.5, -1.0, 2.0])
    W.grad.copy_from_numpy(np.array([7.0, 7.0, 7.0], np.float32))
    x.grad.copy_from_numpy(np.array([1.0, 2.0, 3.0], np.float32))
    assert pydiff.gradcheck(lambda x: ops.sum(ops.tanh(W * x)), (x,))
    assert pydiff.gradcheck(lambda x: ops.sum(view.reshape((3,)) * x * x), (x,))
    np.testing.assert_array_equal(W.grad.numpy(), [7.0, 7.0, 7.0])
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 2.0, 3.0])
    # the closure's tensor as an input is checked, and its buffer restored too
    assert pydiff.gradcheck(lambda w, x: ops.sum(ops.tanh(w * x)), (W, x))
    np.testing.assert_array_equal(W.grad.numpy(), [7.0, 7.0, 7.0])
