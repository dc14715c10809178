"""Session 44, breakA44: a new user's functions on the generated kernels and SlangPy's path,
checked against closed forms in float64 NumPy (and both paths against each other).

Fixed here (each test failed before):
- Forward mode (``.fwds``, ``jvp``, ``jacfwd``, ``hvp``, ``gradcheck``) of a ``[Differentiable]``
  function calling a function that has a hand-written ``[BackwardDerivative]`` (or is named by a
  ``[BackwardDerivativeOf]``) but is neither ``[Differentiable]`` nor given a forward
  derivative: Slang drops the call in ``fwd_diff`` without an error, so ``caller(a, x) =
  cb(a, x) + x`` gave value ``x`` and tangent ``1`` (``a x^2 + x`` and ``2 a x + 1`` are right),
  on both paths and in raw SlangPy. ``.fwds`` of ``cb`` itself raised a raw
  ``SlangCompileError`` of pydiff's wrapper. Both now raise ``ShaderTrapError`` naming
  ``cb``'s file and line and the fix (an uncalled ``cb``: a ``TypeError`` saying why);
  ``.bwds`` (right) is unchanged. So is the forward call of a function of the user's own
  Slang calling ``fwd_diff(caller)`` (before: tangent 1 where 3x + 1 is right).
- A ``[Differentiable]`` function with a hand-written derivative one way only whose body wraps
  a helper in ``no_diff(...)`` (the build rule docs/traps.md gives): Slang derives the other
  way from the body, where the helper counts 0. ``[ForwardDerivative]`` only: ``.bwds`` gave
  0 where 2x is right (silently wrong gradients, callers too); ``[BackwardDerivative]`` only:
  ``.fwds`` 0. The derived direction is now refused (``ShaderTrapError`` at the ``no_diff``'s
  line), the hand-written one runs.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import pydiff
from pydiff import generated

SOURCE = """
import slangpy;
[BackwardDerivative(a44_cb_bwd)]
float a44_cb(float a, float x) { return a * x * x; }
void a44_cb_bwd(inout DifferentialPair<float> a, inout DifferentialPair<float> x, float d)
{ a = diffPair(a.p, x.p * x.p * d); x = diffPair(x.p, 2.0 * a.p * x.p * d); }
[Differentiable] float a44_caller(float a, float x) { return a44_cb(a, x) + x; }
[Differentiable] float a44_outer(float x) { return a44_caller(2.0, x) * 2.0; }
float a44_of(float x) { return x * x; }
[BackwardDerivativeOf(a44_of)]
void a44_of_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 2.0 * x.p * d); }
[Differentiable] float a44_of_caller(float x) { return a44_of(x) + x; }
// the forms that have a forward derivative: not refused
[Differentiable][BackwardDerivative(a44_d_bwd)]
float a44_d(float x) { return x * x; }
void a44_d_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 2.0 * x.p * d); }
[ForwardDerivative(a44_fb_fwd)][BackwardDerivative(a44_fb_bwd)]
float a44_fb(float x) { return x * x; }
DifferentialPair<float> a44_fb_fwd(DifferentialPair<float> x)
{ return diffPair(x.p * x.p, 2.0 * x.p * x.d); }
void a44_fb_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 2.0 * x.p * d); }
[BackwardDerivative(a44_fo_bwd)]
float a44_fo(float x) { return x * x; }
void a44_fo_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 2.0 * x.p * d); }
[ForwardDerivativeOf(a44_fo)]
DifferentialPair<float> a44_fo_fwd(DifferentialPair<float> x)
{ return diffPair(x.p * x.p, 2.0 * x.p * x.d); }
[ForwardDifferentiable][BackwardDerivative(a44_fd_bwd)]
float a44_fd(float x) { return x * x; }
void a44_fd_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 2.0 * x.p * d); }
[Differentiable] float a44_ok_caller(float x)
{ return a44_d(x) + a44_fb(x) + a44_fo(x) + a44_fd(x) + x; }
[Differentiable] float a44_f2(float a, float x) { return a * x * x + sin(x); }
[Differentiable] float a44_g3(float a, float b, float x) { return a * exp(b * x); }
"""


@pytest.fixture(scope="module")
def mod(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pydiff.ShaderTrapWarning)
        return pydiff.load_module_from_source("s44_breakA44", SOURCE, device=device)


@pytest.fixture(params=["default", "forced"])
def paths(request, monkeypatch):
    """Each test twice: at the default threshold and with every covered call generated."""
    if request.param == "forced":
        monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    generated.reset_stats()
    return request.param


def _close(got, want, tol=2e-4) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


XS = np.array([-1.5, -0.25, 0.5, 1.0, 2.0, 3.0], np.float32)
X = XS.astype(np.float64)


# ------------------------------------------------------------------------------------------
# fixed: forward mode through a function with a hand-written backward only


@pytest.mark.parametrize("name", ["a44_caller", "a44_outer", "a44_of_caller", "a44_cb"])
def test_forward_mode_through_a_backward_only_function_is_refused(mod, device, paths, name):
    """Before: ``.fwds`` of the callers gave value x and tangent 1 (the call dropped);
    ``.fwds`` of ``a44_cb`` a raw SlangCompileError of the generated wrapper."""
    fn = getattr(mod, name)
    args = (1.5,) if name in ("a44_caller", "a44_cb") else ()
    where = "a44_of()" if name == "a44_of_caller" else "a44_cb()"
    with pytest.raises(pydiff.ShaderTrapError, match=r"no forward derivative") as info:
        fn.fwds(*args, pydiff.tensor(XS).with_tangent(np.ones(XS.shape)))
    assert where in str(info.value) and "<s44_breakA44>:" in str(info.value)
    x = pydiff.tensor(XS)
    with pytest.raises(pydiff.ShaderTrapError, match=r"no forward derivative"):
        pydiff.jvp(fn, (*args, x), (*(0.0 for _ in args), pydiff.ones(XS.shape)))
    with pytest.raises(pydiff.ShaderTrapError, match=r"hvp refused"):
        pydiff.hvp(fn, (*args, x), (*(0.0 for _ in args), pydiff.ones(XS.shape)))


def test_fwd_diff_written_in_slang_of_such_a_caller_is_refused(device):
    """A directional-derivative helper of the user's own, fwd_diff(a44j_caller) in Slang.
    Before: its forward call gave 1 (the tangent without cb's 2 a x term; 3x + 1 is right)."""
    src = SOURCE.split("[Differentiable] float a44_outer")[0].replace("a44_", "a44j_")
    src += (
        "float a44j_dir(float a, float x, float t)\n"
        "{ return fwd_diff(a44j_caller)(diffPair(a, 0.0), diffPair(x, t)).d; }\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pydiff.ShaderTrapWarning)
        m = pydiff.load_module_from_source("s44_breakA44_dir", src, device=device)
    with pytest.raises(pydiff.ShaderTrapError, match=r"fwd_diff\(a44j_caller\)' in a44j_dir"):
        m.a44j_dir(1.5, pydiff.tensor(XS), 1.0, _result="numpy")


def test_backward_through_a_backward_only_function_still_runs(mod, device, paths):
    """Reverse mode is right: caller = a x^2 + x, outer = 2 caller(2, x)."""
    a = pydiff.tensor([1.5], requires_grad=True)
    x = pydiff.tensor(XS, requires_grad=True)
    y = mod.a44_caller(a, x, _result="tensor")
    _close(y.numpy(), 1.5 * X * X + X)
    mod.a44_caller.bwds(a, x, _result=y.with_grads(ones=True))
    _close(x.grad.numpy(), 3.0 * X + 1.0)
    _close(a.grad.numpy(), [np.sum(X * X)])
    x2 = pydiff.tensor(XS, requires_grad=True)
    z = mod.a44_outer(x2, _result="tensor")
    mod.a44_outer.bwds(x2, _result=z.with_grads(ones=True))
    _close(x2.grad.numpy(), 2.0 * (4.0 * X + 1.0))


def test_functions_with_a_forward_derivative_keep_forward_mode(mod, device, paths):
    """[Differentiable] + [BackwardDerivative], [ForwardDerivative] + [BackwardDerivative],
    [ForwardDerivativeOf], [ForwardDifferentiable] + [BackwardDerivative]: 4 x^2 + x."""
    v, dv = mod.a44_ok_caller.fwds(pydiff.tensor(XS).with_tangent(np.full(XS.shape, 0.5)))
    _close(v.numpy(), 4 * X * X + X)
    _close(dv.numpy(), 0.5 * (8 * X + 1))
    x = pydiff.tensor(XS, requires_grad=True)
    y = mod.a44_ok_caller(x, _result="tensor")
    mod.a44_ok_caller.bwds(x, _result=y.with_grads(ones=True))
    _close(x.grad.numpy(), 8 * X + 1)


def test_fwds_of_an_uncalled_backward_only_function_says_why(device):
    """Nothing calls it: no load-time finding (its .bwds is all one may use); its own forward
    mode cannot build. Before: a raw SlangCompileError of pydiff's wrapper."""
    src = SOURCE.split("[Differentiable] float a44_caller")[0].replace("a44_", "a44s_")
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydiff.ShaderTrapWarning)
        m = pydiff.load_module_from_source("s44_breakA44_alone", src, device=device)
    for call in (
        lambda: m.a44s_cb.fwds(1.5, pydiff.tensor(XS).with_tangent(np.ones(XS.shape))),
        lambda: pydiff.hvp(m.a44s_cb, (1.5, pydiff.tensor(XS)), (0.0, pydiff.ones(XS.shape))),
    ):
        with pytest.raises(
            TypeError, match=r"a44s_cb has no forward derivative.*\[Differentiable\]"
        ):
            call()
    x = pydiff.tensor(XS, requires_grad=True)
    y = m.a44s_cb(1.5, x, _result="tensor")
    m.a44s_cb.bwds(1.5, x, _result=y.with_grads(ones=True))
    _close(x.grad.numpy(), 3.0 * X)


CUT = """
import slangpy;
float a44c_helper(float x) { return x * x; }
[Differentiable][ForwardDerivative(a44c_fw_fwd)]
float a44c_fw(float x) { return no_diff(a44c_helper(x)); }
DifferentialPair<float> a44c_fw_fwd(DifferentialPair<float> x)
{ return diffPair(a44c_helper(x.p), 2.0 * x.p * x.d); }
[Differentiable][BackwardDerivative(a44c_bw_bwd)]
float a44c_bw(float x) { return no_diff(a44c_helper(x)); }
void a44c_bw_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, 2.0 * x.p * d); }
[Differentiable] float a44c_fw_caller(float x) { return a44c_fw(x) + x; }
[Differentiable] float a44c_bw_caller(float x) { return a44c_bw(x) + x; }
"""


def test_derivative_slang_derives_through_no_diff_is_refused(device, paths):
    """The build rule for hand-written derivatives (docs/traps.md) wraps a non-differentiable
    helper in no_diff(...); Slang then derives the other direction from that body, where the
    helper counts 0. Before: .bwds of a44c_fw (forward hand-written) gave 0 and of its caller
    1 (2x and 2x + 1 are right); .fwds of a44c_bw likewise. Now each is refused; the
    hand-written direction still runs and is right."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pydiff.ShaderTrapWarning)
        m = pydiff.load_module_from_source("s44_breakA44_cut", CUT, device=device)
    for name in ("a44c_fw", "a44c_fw_caller"):
        x = pydiff.tensor(XS, requires_grad=True)
        y = getattr(m, name)(x, _result="tensor")
        with pytest.raises(pydiff.ShaderTrapError, match=r"no_diff\(\.\.\.\)' in a44c_fw\(\)"):
            getattr(m, name).bwds(x, _result=y.with_grads(ones=True))
        add = 1.0 if name.endswith("caller") else 0.0
        v, dv = getattr(m, name).fwds(pydiff.tensor(XS).with_tangent(np.ones(XS.shape)))
        _close(v.numpy(), X * X + add * X)
        _close(dv.numpy(), 2 * X + add)
    for name in ("a44c_bw", "a44c_bw_caller"):
        with pytest.raises(pydiff.ShaderTrapError, match=r"no_diff\(\.\.\.\)' in a44c_bw\(\)"):
            getattr(m, name).fwds(pydiff.tensor(XS).with_tangent(np.ones(XS.shape)))
        add = 1.0 if name.endswith("caller") else 0.0
        x = pydiff.tensor(XS, requires_grad=True)
        y = getattr(m, name)(x, _result="tensor")
        getattr(m, name).bwds(x, _result=y.with_grads(ones=True))
        _close(x.grad.numpy(), 2 * X + add)
    # gradcheck (check_forward=None) checks the backward alone where forward mode is refused
    assert pydiff.gradcheck(m.a44c_bw, (pydiff.tensor([0.5, 1.5], requires_grad=True),))


def test_the_finding_is_reported_at_load(device):
    with pytest.warns(pydiff.ShaderTrapWarning, match=r"a44w_cb\(\).*forward mode of it"):
        pydiff.load_module_from_source(
            "s44_breakA44_warn",
            SOURCE.replace("a44_", "a44w_"),
            device=device,
        )


# ------------------------------------------------------------------------------------------
# held (closed forms; both paths)


@pytest.mark.parametrize("xshape, ashape", [((64, 80), (1, 1)), ((64, 80), (80,))])
def test_broadcast_coefficient_gradients(mod, device, paths, xshape, ashape):
    rng = np.random.default_rng(44)
    xn = rng.standard_normal(xshape).astype(np.float32)
    an = rng.standard_normal(ashape).astype(np.float32)
    x = pydiff.tensor(xn, requires_grad=True)
    a = pydiff.tensor(an, requires_grad=True)
    y = mod.a44_f2(a, x, _result="tensor")
    xd, ad = xn.astype(np.float64), an.astype(np.float64)
    _close(y.numpy(), ad * xd * xd + np.sin(xd))
    g = rng.standard_normal(xshape).astype(np.float32)
    up = pydiff.tensor(y.numpy()).with_grads()
    up.grad.copy_from_numpy(g)
    mod.a44_f2.bwds(a, x, _result=up)
    _close(x.grad.numpy(), g * (2 * ad * xd + np.cos(xd)))
    da = g * xd * xd
    want = da.sum() if ashape in ((), (1, 1)) else da.sum(axis=0)
    _close(a.grad.numpy(), np.reshape(want, ashape), 2e-3)


def test_one_tensor_at_two_broadcast_parameters(mod, device, paths):
    """g3(a, a, x) = a exp(a x) with a (1,): da = sum(exp(a x) (1 + a x))."""
    xn = np.linspace(-1, 1, 5000, dtype=np.float32)
    xd = xn.astype(np.float64)
    x = pydiff.tensor(xn, requires_grad=True)
    a = pydiff.tensor([0.5], requires_grad=True)
    y = mod.a44_g3(a, a, x, _result="tensor")
    mod.a44_g3.bwds(a, a, x, _result=y.with_grads(ones=True))
    _close(a.grad.numpy(), [np.sum(np.exp(0.5 * xd) * (1 + 0.5 * xd))], 1e-3)
    _close(x.grad.numpy(), 0.25 * np.exp(0.5 * xd))


def test_threads_adding_into_one_shared_gradient(mod, device, paths):
    """Four threads, each ten .bwds of f2(a, x) with the same a and x (ACCUMULATE)."""
    xn = np.linspace(-2, 2, 5000, dtype=np.float32)
    xd = xn.astype(np.float64)
    x = pydiff.tensor(xn, requires_grad=True)
    a = pydiff.tensor([0.5], requires_grad=True)
    errors = []

    def work():
        try:
            for _ in range(10):
                y = mod.a44_f2(a, x, _result="tensor")
                mod.a44_f2.bwds(a, x, _result=y.with_grads(ones=True))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    _close(a.grad.numpy(), [40 * np.sum(xd * xd)], 1e-3)
    _close(x.grad.numpy(), 40 * (xd + np.cos(xd)), 1e-3)
