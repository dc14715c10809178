"""NumPy functions given tensors (__array_function__), operators with array operands of a
shape that does not broadcast, non-finite eps/scale of the norms and attention, and
`import pydiff;` found wherever Slang's syntax puts it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pydiff
from pydiff import ops

X = np.array([1.0, 2.0, 3.0])


# --- NumPy functions (not ufuncs) -----------------------------------------------------------
@pytest.mark.parametrize(
    "name, f",
    [
        ("np.dot", lambda x: np.dot(x, x)),
        ("np.linalg.norm", lambda x: np.linalg.norm(x)),
        ("np.concatenate", lambda x: np.concatenate([x, x])),
        ("np.outer", lambda x: np.outer(np.ones(2), x)),
        ("np.reshape", lambda x: np.reshape(x, (3, 1), order="F")),
        ("np.allclose", lambda x: np.allclose(x, X)),
    ],
)
def test_numpy_function_of_tensor_requiring_grad_on_tape_is_refused(device, name, f):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape():
        with pytest.raises(TypeError, match=rf"^{name}: .*requires a gradient.*Tape.*numpy\(\)"):
            f(x)
        with pytest.raises(TypeError, match=rf"^{name}: "):
            f(x * 1.0)  # an intermediate carrying the gradient too


def test_numpy_function_mixed_back_gives_no_silent_wrong_gradient(device):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        with pytest.raises(TypeError, match="np.dot"):
            (np.dot(x, x) * x).sum()
        loss = ((x @ x) * x).sum()  # the pydiff way: |x|^2 * sum(x)
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), 2 * X * X.sum() + X @ X, rtol=1e-6)  # 26 38 50


def test_numpy_function_under_jvp_with_a_tangent_is_refused(device):
    def f(v):
        return v * float(np.dot(v, v))

    with pytest.raises(TypeError, match=r"np.dot: .*tangent while pydiff.jvp"):
        pydiff.jvp(f, (X,), (np.array([1.0, 0.0, 0.0]),))


def test_numpy_functions_compute_on_values_where_nothing_is_lost(device):
    x = pydiff.tensor(X, requires_grad=True, device=device)
    assert np.dot(x, x) == pytest.approx(14.0)  # off a tape: values
    assert np.linalg.norm(x) == pytest.approx(math.sqrt(14.0))
    np.testing.assert_array_equal(np.concatenate([x, x]), np.concatenate([X, X]))
    assert np.allclose(x, X)
    c = pydiff.tensor(X, device=device)
    with pydiff.Tape():
        assert np.dot(c, c) == pytest.approx(14.0)  # no gradient to lose
        assert np.dot(x.detach(), x.numpy()) == pytest.approx(14.0)
        assert np.asarray(x.detach()).tolist() == X.tolist()  # an explicit copy, as x.numpy()
        with pytest.raises(TypeError, match="NumPy converted"):  # s28: as np.array([x])
            np.asarray(x)
        assert (np.shape(x), np.ndim(x), np.size(x), np.size(x, 0)) == ((3,), 1, 3, 3)


def test_numpy_transpose_and_reshape_run_the_tensor_methods(device):
    a = np.arange(6.0).reshape(2, 3)
    x = pydiff.tensor(a, requires_grad=True, device=device)
    t = np.transpose(pydiff.tensor(a, device=device))  # was "axes (None,) are not a permutation"
    assert isinstance(t, pydiff.Tensor)
    np.testing.assert_array_equal(t.numpy(), a.T)
    w = np.array([[1.0, -2.0], [0.5, 3.0], [2.0, 1.0]])
    with pydiff.Tape() as tape:
        y = np.transpose(x * x, (1, 0))  # recorded, as x.transpose(1, 0)
        z = np.reshape(x, (3, 2))  # a view sharing x's gradient
        loss = (y * w).sum() + (z * w).sum() + np.sum(x, axis=0, keepdims=True).sum()
    tape.backward(loss)
    expected = 2 * a * w.T + w.reshape(2, 3) + 1.0
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-6)


# --- operators with array operands ------------------------------------------------------
@pytest.mark.parametrize(
    "f, message",
    [
        (lambda x: x + np.ones(3), r"^add: shapes \(3, 4\) and \(3,\) do not broadcast$"),
        (lambda x: x * [1.0, 2.0], r"^mul: shapes \(3, 4\) and \(2,\) do not broadcast$"),
        (lambda x: np.ones((2, 4)) - x, r"^sub: shapes \(2, 4\) and \(3, 4\) do not broadcast$"),
        (lambda x: x / np.ones((3, 3)), r"^div: shapes \(3, 4\) and \(3, 3\) do not broadcast$"),
    ],
)
def test_operator_with_array_of_wrong_shape_names_op_and_shapes(device, f, message):
    x = pydiff.tensor(np.arange(12.0).reshape(3, 4), device=device)
    with pytest.raises(ValueError, match=message):
        f(x)


@pytest.mark.parametrize(
    "other",
    [np.arange(4.0) + 1.0, [[2.0], [3.0], [-1.0]], np.full((2, 1, 4), 0.5), np.float32(2.5)],
)
def test_operator_with_broadcasting_array_matches_float64(device, other):
    a = np.arange(12.0).reshape(3, 4) / 7.0 + 0.25
    o = np.asarray(other, dtype=np.float64)
    x = pydiff.tensor(a, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        y = (x * other + other) / (other - x * 0.0 + 4.0)
        loss = (y * y).sum()
    tape.backward(loss)
    ya = (a * o + o) / (o + 4.0)
    np.testing.assert_allclose(y.numpy(), ya, rtol=1e-5)
    grad = (2 * ya * o / (o + 4.0)).reshape((-1,) + a.shape).sum(axis=0)
    np.testing.assert_allclose(x.grad.numpy(), grad, rtol=1e-5)


# --- non-finite hyper-parameters --------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_norms_refuse_non_finite_eps(device, bad):
    x = pydiff.tensor(np.arange(8.0).reshape(2, 4), device=device)
    w = pydiff.ones((4,), device=device)
    with pytest.raises(ValueError, match=r"^layer_norm: eps=.* must be a finite number"):
        ops.layer_norm(x, w, eps=bad)
    with pytest.raises(ValueError, match=r"^rms_norm: eps=.* must be a finite number"):
        ops.rms_norm(x, w, eps=bad)


def test_norms_eps_type_and_sign(device):
    x = pydiff.tensor(np.arange(8.0).reshape(2, 4), device=device)
    w = pydiff.ones((4,), device=device)
    with pytest.raises(ValueError, match=r"^rms_norm: eps=-1.0 must be positive"):
        ops.rms_norm(x, w, eps=-1.0)
    with pytest.raises(TypeError, match=r"^layer_norm: eps must be a number"):
        ops.layer_norm(x, eps="1e-5")
    xt = torch.tensor(np.arange(8.0).reshape(2, 4))
    expected = torch.nn.functional.layer_norm(xt, (4,), eps=1).numpy()
    np.testing.assert_allclose(ops.layer_norm(x, eps=1).numpy(), expected, rtol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("shape", [(3, 2), (2, 3, 2)])
def test_attention_refuses_non_finite_scale(device, bad, shape):
    q = pydiff.tensor(np.ones(shape), device=device)
    with pytest.raises(ValueError, match=r"^attention: scale=.* must be a finite number"):
        ops.attention(q, q, q, scale=bad)


def test_attention_negative_scale_matches_torch(device):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 2)) for _ in range(3))
    out = ops.attention(*(pydiff.tensor(a, device=device) for a in (q, k, v)), scale=-0.7)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a) for a in (q, k, v)), scale=-0.7
    )
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


# --- `import pydiff;` wherever Slang reads it ---------------------------------------------
_USES_PYDIFF = "[Differentiable] float f(FwdDiffTensor<1> w, float s) { return w.load({0}) * s; }\n"


@pytest.mark.parametrize(
    "tag, head",
    [
        ("same_line", "import slangpy; import pydiff;\n"),
        ("after_block_comment", "/* pydiff's types */ import pydiff;\n"),
        ("after_comment", "// FwdDiffTensor\nimport slangpy; /* c */ import pydiff; // x\n"),
        ("exported", "import slangpy;  __exported import pydiff;\n"),
        ("quoted", 'import "pydiff.slang";\n'),
    ],
)
def test_import_pydiff_anywhere_links_the_library(device, tag, head):
    m = pydiff.load_module_from_source(f"s27_import_{tag}", head + _USES_PYDIFF, device=device)
    w, s = pydiff.tensor([2.0], device=device), pydiff.tensor([1.0, 2.0], device=device)
    np.testing.assert_allclose(m.f(w, s, _result="numpy"), [2.0, 4.0])


@pytest.mark.parametrize(
    "tag, comment",
    [("block", "/*\nimport pydiff;\n*/\n"), ("line", "// import pydiff;\n")],
)
def test_import_pydiff_in_a_comment_does_not_link_the_library(device, tag, comment):
    # Linked, pydiff's FixedPointGrad would clash with the module's own in the call's kernel.
    src = comment + (
        "struct FixedPointGrad { float v; };\n"
        "float g(FixedPointGrad p, float s) { return p.v * s; }\n"
    )
    m = pydiff.load_module_from_source(f"s27_comment_{tag}", src, device=device)
    out = m.g({"v": 3.0}, pydiff.tensor([1.0, 2.0], device=device), _result="numpy")
    np.testing.assert_allclose(out, [3.0, 6.0])
