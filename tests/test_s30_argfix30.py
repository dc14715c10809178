"""Arguments refused by name: gradient seeds and directions beyond float32 (tape.backward's
grad=, jvp tangents, vjp cotangents, hvp directions), booleans and text as seeds."""

import warnings

import numpy as np
import pytest

import pydiff

BIG = np.array([1e39, 1.0])


def _recorded_square(device):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = x * x
    return x, y, tape


@pytest.mark.parametrize("seed", [BIG, 1e39, [-1e39, 0.0]])
def test_tape_backward_refuses_a_seed_beyond_float32(device, seed):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = x * x
        total = y.sum()
    out = y if np.ndim(seed) else total
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning either
        with pytest.raises(ValueError, match=r"tape\.backward: grad: -?1e\+39 is beyond the larg"):
            tape.backward(out, grad=seed)


@pytest.mark.parametrize(
    "seed, kind, words",
    [(np.array([True, False]), TypeError, "booleans"), ("a", TypeError, "dtype <U1")],
)
def test_tape_backward_refuses_bool_and_text_seeds(device, seed, kind, words):
    x, y, tape = _recorded_square(device)
    with pytest.raises(kind, match=f"tape.backward: grad: got .*{words}"):
        tape.backward(y, grad=seed)


def test_tape_backward_still_takes_int_and_inf_seeds(device):
    x, y, tape = _recorded_square(device)
    tape.backward(y, grad=np.array([3, 1]))  # ints are numbers
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 4.0])  # 2 x * seed
    x, y, tape = _recorded_square(device)
    tape.backward(y, grad=[np.inf, 1.0])  # inf itself is not an overflow
    assert np.isinf(x.grad.numpy()[0]) and x.grad.numpy()[1] == 4.0


def test_half_output_refuses_a_seed_beyond_half(device):
    m = pydiff.load_module_from_source(
        "s30_argfix_half", "[Differentiable] half h(half x) { return x * x; }", device=device
    )
    x = pydiff.tensor([1.0, 2.0], dtype="half", device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.h(x, _result="tensor")  # a half result: its seed must fit half
    with pytest.raises(ValueError, match=r"grad: 70000\.0 is beyond the largest half"):
        tape.backward(y, grad=[70000.0, 1.0])


def test_transforms_refuse_directions_beyond_float32(device):
    x = pydiff.tensor([1.0, 2.0], device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"jvp: tangents\[0\]: 1e\+39 is beyond"):
            pydiff.jvp(lambda a: a * a, (x,), (BIG,))
        with pytest.raises(ValueError, match=r"vjp: cotangents: 1e\+39 is beyond"):
            pydiff.vjp(lambda a: a * a, (x,), BIG)
        with pytest.raises(ValueError, match=r"vjp: cotangents\[1\]: 1e\+39 is beyond"):
            pydiff.vjp(lambda a: (a * a, a + a), (x,), (np.ones(2), BIG))
        with pytest.raises(ValueError, match=r"hvp: directions\[0\]: 1e\+39 is beyond"):
            pydiff.hvp(lambda a: (a * a).sum(), (x,), (BIG,))


def test_transforms_of_a_module_function_refuse_directions_beyond_float32(device):
    m = pydiff.load_module_from_source(
        "s30_argfix_sq", "[Differentiable] float sq(float x) { return x * x; }", device=device
    )
    x = pydiff.tensor([1.0, 2.0], device=device)
    with pytest.raises(ValueError, match=r"jvp: tangents\[0\]: 1e\+39 is beyond"):
        pydiff.jvp(m.sq, (x,), (BIG,))
    with pytest.raises(TypeError, match=r"jvp: tangents\[0\]: got booleans"):
        pydiff.jvp(m.sq, (x,), (np.array([True, False]),))
    with pytest.raises(ValueError, match=r"hvp: direction for 'x' \(v\[0\]\): 1e\+39 is beyond"):
        pydiff.hvp(m.sq, (x,), (BIG,))


@pytest.mark.parametrize("bad", ["a", np.array([True, False])])
def test_transforms_name_a_tangent_that_is_not_numbers(device, bad):
    x = pydiff.tensor([1.0, 2.0], device=device)
    with pytest.raises(TypeError, match=r"jvp: tangents\[0\]: got"):
        pydiff.jvp(lambda a: a * a, (x,), (bad,))
    with pytest.raises(TypeError, match=r"hvp: directions\[0\]: got"):
        pydiff.hvp(lambda a: (a * a).sum(), (x,), (bad,))
    with pytest.raises(TypeError, match=r"with_tangent: tangent: got"):
        pydiff.tensor([1.0, 2.0], device=device).with_tangent(bad)


def test_valid_directions_still_give_closed_forms(device):
    xs = np.array([1.5, -2.0])
    x = pydiff.tensor(xs, device=device)
    u = np.array([0.25, 3.0])
    _, dy = pydiff.jvp(lambda a: a * a * a, (x,), (u,))
    np.testing.assert_allclose(dy.numpy(), 3 * xs**2 * u, rtol=1e-6)
    _, (g,) = pydiff.vjp(lambda a: a * a * a, (x,), u)
    np.testing.assert_allclose(g.numpy(), 3 * xs**2 * u, rtol=1e-6)
    (hv,) = pydiff.hvp(lambda a: (a * a * a).sum(), (x,), (u,))
    np.testing.assert_allclose(hv.numpy(), 6 * xs * u, rtol=1e-6)


# --- weights and biases that are not pydiff tensors -------------------------------------


def _ones(device, *shape):
    return pydiff.tensor(np.ones(shape, np.float32), device=device)


@pytest.mark.parametrize("bias", [np.ones(2, np.float32), [1.0, 2.0], 1.0])
def test_linear_names_a_bias_that_is_not_a_tensor(device, bias):
    x, w = _ones(device, 3, 4), _ones(device, 2, 4)
    with pytest.raises(TypeError, match=r"linear: bias must be a pydiff.Tensor of shape \(2,\)"):
        pydiff.ops.linear(x, w, bias)


def test_linear_bias_of_the_wrong_shape_and_a_right_one(device):
    x, w = _ones(device, 3, 4), _ones(device, 2, 4)
    with pytest.raises(ValueError, match=r"linear: bias must have shape \(2,\), got \(3,\)"):
        pydiff.ops.linear(x, w, _ones(device, 3))
    b = pydiff.tensor([0.5, -1.0], device=device)
    np.testing.assert_allclose(pydiff.ops.linear(x, w, b).numpy(), np.full((3, 2), 4.0) + [0.5, -1])


@pytest.mark.parametrize("bad", [np.ones(4), [1.0] * 4, 2.0, None])
def test_norms_name_a_weight_or_bias_that_is_not_a_tensor(device, bad):
    x = _ones(device, 3, 4)
    with pytest.raises(TypeError, match=r"rms_norm: weight must be a pydiff.Tensor of shape"):
        pydiff.ops.rms_norm(x, bad)
    if bad is not None:  # (None: layer_norm's default weight and bias)
        for arg in ("weight", "bias"):
            with pytest.raises(TypeError, match=f"layer_norm: {arg} must be a pydiff.Tensor"):
                pydiff.ops.layer_norm(x, **{arg: bad})


def test_mse_loss_takes_a_list_target_and_names_a_wrong_shape(device):
    p = pydiff.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
    t = [[0.0, 2.0], [1.0, 1.0]]
    expected = np.mean((np.array([[1.0, 2.0], [3.0, 4.0]]) - np.array(t)) ** 2)
    np.testing.assert_allclose(pydiff.ops.mse_loss(p, t).item(), expected, rtol=1e-6)
    with pytest.raises(ValueError, match=r"mse_loss: prediction \(2, 2\) and target \(1, 2\)"):
        pydiff.ops.mse_loss(p, [[1.0, 2.0]])


# --- ops' and optimizers' numbers beyond float32, eps that is 0 in float32 ----------------


@pytest.mark.parametrize(
    "call, start",
    [
        (lambda x: pydiff.ops.attention(x, x, x, scale=1e39), "attention: scale=1e+39 is beyond"),
        (lambda x: pydiff.ops.attention(x, x, x, scale=-1e39), "attention: scale=-1e+39 is bey"),
        (lambda x: pydiff.ops.layer_norm(x, eps=1e39), "layer_norm: eps=1e+39 is beyond"),
        (lambda x: pydiff.ops.rms_norm(x, x[0], eps=1e39), "rms_norm: eps=1e+39 is beyond"),
    ],
)
def test_op_numbers_beyond_float32_are_named_by_the_op(device, call, start):
    x = pydiff.tensor(np.ones((3, 4), np.float32), device=device)
    with pytest.raises(ValueError) as info:
        call(x)
    assert str(info.value).startswith(start), str(info.value)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_an_eps_that_is_zero_in_float32_is_refused(device, op):
    x = pydiff.zeros((1, 4), device=device)
    w = pydiff.tensor(np.ones(4, np.float32), device=device)
    args = (x, w) if op == "rms_norm" else (x,)
    with pytest.raises(ValueError, match=rf"{op}: eps=1e-50 is 0 in float32.*1\.4012985e-45"):
        getattr(pydiff.ops, op)(*args, eps=1e-50)


def test_rms_norm_of_a_zero_row_with_the_smallest_eps_is_finite(device):
    x = pydiff.zeros((1, 4), device=device, requires_grad=True)
    w = pydiff.tensor(np.ones(4, np.float32), device=device)
    with pydiff.Tape() as tape:
        y = pydiff.ops.rms_norm(x, w, eps=1e-45)
    tape.backward(y, grad=np.ones((1, 4)))
    assert np.all(y.numpy() == 0)  # x r w with x = 0
    assert np.all(np.isfinite(x.grad.numpy()))


def test_attention_with_a_scale_that_rounds_to_zero_averages_the_values(device):
    rng = np.random.default_rng(1)
    q, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 2))
    out = pydiff.ops.attention(
        pydiff.tensor(q, device=device),
        pydiff.tensor(rng.standard_normal((5, 4)), device=device),
        pydiff.tensor(v, device=device),
        scale=1e-50,  # (allowed: scale need not be positive; 0 gives uniform weights)
    )
    np.testing.assert_allclose(out.numpy(), np.tile(v.mean(axis=0), (3, 1)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda p: pydiff.optim.SGD([p], lr=1e39), "lr"),
        (lambda p: pydiff.optim.SGD([p], lr=0.1, momentum=1e39), "momentum"),
        (lambda p: pydiff.optim.SGD([p], lr=0.1, weight_decay=1e39), "weight_decay"),
        (lambda p: pydiff.optim.Adam([p], lr=1e39), "lr"),
        (lambda p: pydiff.optim.Adam([p], lr=0.1, eps=1e39), "eps"),
        (lambda p: pydiff.optim.AdamW([p], lr=0.1, weight_decay=1e39), "weight_decay"),
    ],
)
def test_optimizer_numbers_beyond_float32_are_refused(device, make, key):
    p = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
    with pytest.raises(ValueError, match=rf"^\w+: {key}=1e\+39 is beyond the largest float32"):
        make(p)
    opt = pydiff.optim.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match=r"SGD.defaults: lr=1e\+39 is beyond"):
        opt.defaults["lr"] = 1e39
    assert opt.defaults["lr"] == 0.1


# --- integer primals: converted where named, held fixed where the transform picks --------

A_INT, B = np.array([1, 2]), np.array([0.5, 3.0])


def _f(a, b):
    return (a * a * b * b).sum()  # H_bb = diag(2 a^2), H_ab = diag(4 a b), H_aa = diag(2 b^2)


def _hessian_closed_form(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.block(
        [[np.diag(2 * b**2), np.diag(4 * a * b)], [np.diag(4 * a * b), np.diag(2 * a**2)]]
    )


def test_hessian_holds_integers_and_hvp_with_no_direction_for_them_agrees():
    H = pydiff.hessian(_f, (A_INT, B))
    np.testing.assert_allclose(H, np.diag(2.0 * A_INT**2), rtol=1e-6)  # b's block only
    v = np.array([0.25, -1.5])
    none, hv = pydiff.hvp(_f, (A_INT, B), (None, v))
    assert none is None
    np.testing.assert_allclose(hv, H @ v, rtol=1e-6)


def test_float_primals_hessian_and_hvp_agree_with_the_closed_form():
    a = A_INT.astype(np.float64)
    H = pydiff.hessian(_f, (a, B))
    np.testing.assert_allclose(H, _hessian_closed_form(a, B), rtol=1e-6)
    va, vb = np.array([1.0, -2.0]), np.array([0.5, 0.25])
    ha, hb = pydiff.hvp(_f, (a, B), (va, vb))
    np.testing.assert_allclose(np.concatenate([ha, hb]), H @ np.concatenate([va, vb]), rtol=1e-6)
    hai, hbi = pydiff.hvp(_f, (A_INT, B), (va, vb))  # a direction for the ints: as floats
    np.testing.assert_allclose(np.concatenate([hai, hbi]), np.concatenate([ha, hb]), rtol=1e-6)


def test_transforms_told_to_differentiate_integers_take_them_as_floats():
    want_a = 2 * A_INT * B**2  # d/da of sum(a^2 b^2)
    np.testing.assert_allclose(pydiff.grad(_f)(A_INT, B), want_a, rtol=1e-6)
    assert pydiff.grad(lambda s: s * s * s)(2) == pytest.approx(12.0)
    np.testing.assert_allclose(pydiff.jacrev(_f)(A_INT, B), want_a, rtol=1e-6)
    np.testing.assert_allclose(pydiff.jacfwd(_f)(A_INT, B), want_a, rtol=1e-6)
    _, t = pydiff.jvp(_f, ([1, 2], B), ([1.0, 1.0], None))
    assert float(np.asarray(t)) == pytest.approx(float(want_a.sum()), rel=1e-6)


def test_hessian_of_only_integer_primals_names_them():
    with pytest.raises(ValueError, match=r"no float primal.*primals \[0\] hold integers"):
        pydiff.hessian(lambda a: (a * a).sum(), (A_INT,))


def test_vjp_holds_integer_primals_fixed_and_differentiates_floats():
    for a in (A_INT, pydiff.tensor(np.array([1, 2], np.int32))):
        out, (ga, gb) = pydiff.vjp(lambda a, b: (a * b * b).sum(), (a, B), 1.0)
        assert ga is None
        np.testing.assert_allclose(gb, 2 * A_INT * B, rtol=1e-6)
        np.testing.assert_allclose(out.item(), np.sum(A_INT * B * B), rtol=1e-6)


def test_module_function_int_at_a_float_parameter_is_a_float_in_every_transform(device):
    m = pydiff.load_module_from_source(
        "s30_argfix_cube", "[Differentiable] float cube(float x) { return x * x * x; }", device
    )
    _, (g,) = pydiff.vjp(m.cube, (2,), 1.0)  # was None: ints held fixed at a float parameter
    assert g == pytest.approx(12.0)  # 3 x^2
    (hv,) = pydiff.hvp(m.cube, (2,), (1.0,))
    assert float(hv) == pytest.approx(12.0)  # 6 x
    np.testing.assert_allclose(pydiff.hessian(m.cube, (2,)), [[12.0]])
