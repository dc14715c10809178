"""fix49b: outputs marked non-differentiable (tape.backward's message, gradcheck of a marked
output own_outputs copied), a [ForwardDerivative] that is not [Differentiable] (load-time
warning, hvp's refusal), gradcheck's tolerances per Jacobian block (input dtype x output
dtype). References: closed forms checked by float64 central differences (NumPy), never
pydiff's own output."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

X = np.array([0.5, -1.0, 2.0, 1.5])


def _central(f, x, h=1e-6):
    """float64 central differences of an elementwise f (the reference derivative)."""
    return (f(x + h) - f(x - h)) / (2 * h)


class _MarkedP2(pydiff.Function):
    """y = x^2 with a backward, and z = 3x marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y, z = ops.mul(x, x), ops.mul(x, 3.0)
        ctx.mark_non_differentiable(z)
        return y, z

    @staticmethod
    def backward(ctx, gy, gz):
        (x,) = ctx.saved_tensors
        return ops.mul(ops.mul(x, 2.0), gy)


class _MarkedP1(pydiff.Function):
    """The same without backward (its calls recorded on the tape)."""

    @staticmethod
    def forward(ctx, x):
        y, z = ops.mul(x, x), ops.mul(x, 3.0)
        ctx.mark_non_differentiable(z)
        return y, z


@pytest.mark.parametrize("cls", [_MarkedP2, _MarkedP1])
def test_backward_from_a_marked_output_says_it_was_marked(device, cls):
    """tape.backward(z) of an output marked non-differentiable said "computed by
    _MarkedP2.forward off a tape (no pydiff.Tape was recording)" (a tape was recording), or
    "nothing it depends on requires a gradient" (x does): now it names the Function and the
    mark."""
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        y, z = cls.apply(x)
    for out in (z, z.reshape((2, 2))):
        seed = np.ones(out.expected_numpy_shape())
        with pytest.raises(RuntimeError, match=f"{cls.__name__}.forward marked non-diff") as e:
            tape.backward(out, grad=seed)
        assert "off a tape" not in str(e.value)
    with pytest.raises(RuntimeError, match="mark_non_differentiable"):
        z.backward(grad=np.ones(4))
    with pydiff.Tape() as tape:  # a result of it: the unrecorded call's input was marked
        y, z = cls.apply(x)
        s = ops.sum(z)
    with pytest.raises(RuntimeError, match=f"of an output {cls.__name__} marked non-diff"):
        tape.backward(s)
    tape.backward(y, grad=np.ones(4))  # the unmarked output: closed form 2x
    np.testing.assert_allclose(x.grad.numpy(), _central(lambda v: v * v, X), rtol=1e-5)


class _PassesInputMarked(pydiff.Function):
    """y = x^2, and x itself returned marked non-differentiable (own_outputs copies it)."""

    wrong = 1.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(x)
        return ops.mul(x, x), x

    @classmethod
    def backward(cls, ctx, gy, gx):
        (x,) = ctx.saved_tensors
        return ops.mul(ops.mul(x, 2.0 * cls.wrong), gy)


class _PassesInputMarkedWrong(_PassesInputMarked):
    wrong = 1.02  # 2% off


def test_gradcheck_leaves_out_a_marked_output_that_was_copied(device):
    """A marked output that is an input (copied by own_outputs) was checked as a zero
    Jacobian against its finite differences (the identity): a right Function failed."""
    ref = _central(lambda v: v * v, X)  # 2x, float64
    assert np.all(np.abs(2.04 * X - ref) > 1e-2 * np.abs(ref))  # 2% off is detectable
    x = pydiff.tensor(X, requires_grad=True, device=device)
    y, z = _PassesInputMarked.apply(x)
    assert not z.requires_grad and z.storage is not x.storage
    assert pydiff.gradcheck(_PassesInputMarked, (x,))
    assert not pydiff.gradcheck(_PassesInputMarkedWrong, (x,), raise_exception=False)
    with pydiff.Tape() as tape:  # the copy is marked too: a backward from it says so
        y, z = _PassesInputMarked.apply(x)
    with pytest.raises(RuntimeError, match="_PassesInputMarked.forward marked non-diff"):
        tape.backward(z, grad=np.ones(4))
    with pytest.raises(RuntimeError) as e:  # the input itself is no marked output
        tape.backward(x, grad=np.ones(4))
    assert "marked" not in str(e.value)


CUBE = """import slangpy;
[Differentiable] [ForwardDerivative(cube_fwd)] [BackwardDerivative(cube_bwd)]
float cube(float x) { return x * x * x; }
%s
DifferentialPair<float> cube_fwd(DifferentialPair<float> x)
{
    return diffPair(x.p * x.p * x.p, 3.0 * x.p * x.p * x.d);
}
void cube_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 3.0 * x.p * x.p * d); }
"""


def _write_cube(tmp_path, attr, name):
    path = tmp_path / f"{name}.slang"
    path.write_text(CUBE % attr)
    return path


def test_a_forward_derivative_that_is_not_differentiable_warns_and_hvp_names_it(device, tmp_path):
    """[ForwardDerivative(cube_fwd)] with cube_fwd not [Differentiable], beside a
    [BackwardDerivative]: no load-time warning (only a caller's was found), and hvp of cube
    failed with a SlangCompileError about pydiff's generated file. Now the load warns at
    cube's line and hvp/hessian raise ShaderTrapError naming the file, line and cube_fwd."""
    path = _write_cube(tmp_path, "", "fix49b_cube")
    with pytest.warns(pydiff.ShaderTrapWarning, match=r"fix49b_cube.slang:3: .*cube_fwd\(\)"):
        m = pydiff.load_module(path, device=device)
    x = pydiff.tensor(X, device=device)
    u = np.ones(4)
    for call in (
        lambda: pydiff.hvp(m.cube, (x,), (u,)),
        lambda: pydiff.hvp(lambda t: ops.sum(m.cube(t, _result="tensor")), (x,), (u,)),
        lambda: pydiff.hessian(lambda t: ops.sum(m.cube(t, _result="tensor")), (x,)),
    ):
        with pytest.raises(pydiff.ShaderTrapError, match=r"fix49b_cube.slang:3: .*cube_fwd"):
            call()
    want = _central(lambda v: v**3, X)  # 3x^2, float64
    _, t = pydiff.jvp(m.cube, (x,), (u,))  # forward mode and .bwds are unaffected
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-5)
    xg = pydiff.tensor(X, requires_grad=True, device=device)
    m.cube.bwds(xg, _result=1.0)
    np.testing.assert_allclose(xg.grad.numpy(), want, rtol=1e-5)


def test_a_differentiable_forward_derivative_loads_quietly_and_gives_the_hvp(device, tmp_path):
    import warnings

    path = tmp_path / "fix49b_cube_ok.slang"
    path.write_text(CUBE.replace("%s\nDifferentialPair", "[Differentiable]\nDifferentialPair"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydiff.ShaderTrapWarning)
        m = pydiff.load_module(path, device=device)
    (h,) = pydiff.hvp(m.cube, (pydiff.tensor(X, device=device),), (np.ones(4),))
    want = _central(lambda v: 3 * v**2, X)  # d/dx 3x^2 = 6x, float64
    np.testing.assert_allclose(h.numpy(), want, rtol=1e-5)


def test_a_namespaced_forward_derivative_is_found_too(device):
    """[ForwardDerivative(A.g)]: the scan read plain names only, so nothing warned."""
    src = (
        CUBE.replace("%s\n", "namespace A {\n")
        .replace("void cube_bwd", "}\nvoid cube_bwd")
        .replace("ForwardDerivative(cube_fwd)", "ForwardDerivative(A.cube_fwd)")
    )
    with pytest.warns(pydiff.ShaderTrapWarning, match=r"A\.cube_fwd\(\) that is not"):
        m = pydiff.load_module_from_source("fix49b_ns_cube", src, device=device)
    with pytest.raises(pydiff.ShaderTrapError, match="A.cube_fwd"):
        pydiff.hvp(m.cube, (pydiff.tensor(X, device=device),), (np.ones(4),))


MIXED_FWD = """import slangpy;
// x^2 w h with a hand-written forward derivative, beside a half parameter h; in x 2 percent off
[Differentiable] [ForwardDerivative(mixf_fwd)]
float mixf(float x, float w, half h) { return x * x * w * float(h); }
[Differentiable]
DifferentialPair<float> mixf_fwd(DifferentialPair<float> x, DifferentialPair<float> w,
                                 DifferentialPair<half> h)
{
    float hp = float(h.p);
    float d = %s * x.p * w.p * hp * x.d + x.p * x.p * hp * w.d + x.p * x.p * w.p * float(h.d);
    return diffPair(x.p * x.p * w.p * hp, d);
}
"""


@pytest.mark.parametrize("checked_half", [True, False])
def test_gradcheck_forward_mode_keeps_float_tolerances_beside_a_half_input(device, checked_half):
    """The forward check compared the whole direction's JVP at half's tolerances once a half
    input was checked: a [ForwardDerivative] 2% off in the float input x passed beside h
    (and failed with h held fixed). Now each block of inputs of one precision is checked
    along its own direction, float ones at the float tolerances."""
    xs, ws, hs = X, np.array([1.0, 2.0, 0.5, -1.0]), np.array([1.0, 0.5, -1.0, 2.0])
    ref = _central(lambda v: v * v, xs) * ws * hs  # d/dx x^2 w h, float64
    assert np.all(np.abs(2.04 * xs * ws * hs - ref) > 1.5e-2 * np.abs(ref))
    wrong = pydiff.load_module_from_source("fix49b_mixf_w", MIXED_FWD % "2.04", device=device)
    right = pydiff.load_module_from_source("fix49b_mixf_r", MIXED_FWD % "2.0", device=device)

    def args():
        x = pydiff.tensor(xs, requires_grad=True, device=device)
        w = pydiff.tensor(ws, requires_grad=True, device=device)
        h = pydiff.tensor(hs, dtype="half", requires_grad=checked_half, device=device)
        return x, w, h

    with pytest.raises(pydiff.GradcheckError, match="forward mode") as e:
        pydiff.gradcheck(wrong.mixf, args())
    assert ("along the non-half inputs" in str(e.value)) == checked_half
    assert pydiff.gradcheck(right.mixf, args())
    # the reference the check rests on: the right forward derivative is the closed form
    x, w, h = args()
    _, t = pydiff.jvp(right.mixf, (x, w, h), (np.ones(4), np.zeros(4), np.zeros(4)))
    np.testing.assert_allclose(t.numpy(), ref, rtol=1e-5)


def test_pydiff_check_forward_row_keeps_float_tolerances_beside_a_half_parameter(device, tmp_path):
    """`pydiff check`'s forward (and adjoint) row compared the whole direction at half's
    tolerances once a parameter was half: the forward derivative 2% off in x PASSed."""
    from pydiff.modcheck import check_module

    for wrong, want in (("2.04", "FAIL"), ("2.0", "PASS")):
        path = tmp_path / f"fix49b_mixf_{wrong.replace('.', '_')}.slang"
        path.write_text(MIXED_FWD % wrong)
        rows = {(r.function, r.parameter, r.mode): r for r in check_module(path, device=device)}
        assert rows[("mixf", "(all)", "forward")].status == want, rows
        assert rows[("mixf", "(all)", "adjoint")].status == "PASS", rows  # (the backward: Slang's)
        if want == "FAIL":
            assert "float parameters" in rows[("mixf", "(all)", "forward")].why
