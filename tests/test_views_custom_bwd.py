"""Views share their base's gradient (issue 15: a reshape on a tape dropped its gradient), and
hand-written backwards of functions with an ``inout`` parameter that read its primal (which
crashed the process through Slang's autodiff). References: closed forms in float64 NumPy."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pydiff
from pydiff import lint, lint_custom

_names = itertools.count()
X6 = np.array([0.5, -1.0, 2.0, 1.5, -0.25, 3.0], np.float32)

CHAIN = """
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float times(float a, float b) { return a * b; }
[Differentiable] float2 swap2(float2 a) { return float2(a.y * a.y, a.x); }
"""


@pytest.fixture(scope="module")
def chain(device):
    return pydiff.load_module_from_source("views_chain", CHAIN, device=device)


def leaf(device, values=X6):
    return pydiff.tensor(np.array(values, np.float32), device=device, requires_grad=True)


@pytest.mark.parametrize("shape", [(6,), (2, 3), (3, 2), (1, 6), (6, 1)])
def test_view_on_tape_adds_into_base_grad(device, chain, shape):
    x = leaf(device)
    v = x.reshape(shape)
    assert v.requires_grad and v.base is x
    with pydiff.Tape() as tape:
        y = chain.sq(v, _result="tensor")  # y = x^2 in the view's shape
        z = chain.times(y, v, _result="tensor")  # x^3
    tape.backward(z, grad=np.ones(shape))
    np.testing.assert_allclose(x.grad.numpy(), 3 * X6.astype(np.float64) ** 2, rtol=1e-5)


def test_view_of_view_and_base_together(device, chain):
    x = leaf(device)
    v = x.reshape((2, 3)).reshape((3, 2)).reshape((6,))
    w = pydiff.tensor(np.arange(1.0, 7.0), device=device)  # constant weights
    with pydiff.Tape() as tape:
        a = chain.times(x, v, _result="tensor")  # x^2
        z = chain.times(a, w, _result="tensor")
    tape.backward(z, grad=np.ones(6))
    want = 2 * X6.astype(np.float64) * np.arange(1.0, 7.0)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5)


def test_view_made_before_base_gets_gradients(device, chain):
    """A view of a tensor that gets gradient buffers later (a tape result) sees them."""
    x = leaf(device)
    out = pydiff.zeros((6,), device=device)
    flat = out.reshape((2, 3))
    assert not flat.requires_grad
    with pydiff.Tape() as tape:
        chain.sq(x, _result=out)  # out gets gradient buffers here
        z = chain.times(flat, flat, _result="tensor")  # x^4 through the earlier view
    assert flat.requires_grad
    tape.backward(z, grad=np.ones((2, 3)))
    np.testing.assert_allclose(x.grad.numpy(), 4 * X6.astype(np.float64) ** 3, rtol=1e-5)


def test_explicit_bwds_through_view(device, chain):
    x = leaf(device)
    v = x.reshape((3, 2))
    y = chain.sq(v, _result="tensor").with_grads(ones=True)
    chain.sq.bwds(v, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * X6.astype(np.float64), rtol=1e-6)
    np.testing.assert_allclose(v.grad.numpy(), 2 * X6.reshape(3, 2), rtol=1e-6)


def test_view_requires_grad_and_detach(device):
    x = pydiff.tensor(X6, device=device)
    v = x.reshape((2, 3))
    v.requires_grad_(True)  # the base gets the buffer the view shows
    assert x.requires_grad and v.grad.shape == (2, 3)
    assert not x.reshape((6,)).detach().requires_grad
    assert not x.detach().reshape((6,)).requires_grad
    v.grad.copy_from_numpy(np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(6))


def test_pattern1_function_returning_views(device, chain):
    class Views(pydiff.Function):
        @staticmethod
        def forward(ctx, x):
            return x.reshape((2, 3)), x.reshape((3, 2)).reshape((6,))

    x = leaf(device)
    with pydiff.Tape() as tape:
        a, b = Views.apply(x)
        z = chain.times(chain.sq(a, _result="tensor").reshape((6,)), b, _result="tensor")
    tape.backward(z, grad=np.ones(6))  # x^3
    np.testing.assert_allclose(x.grad.numpy(), 3 * X6.astype(np.float64) ** 2, rtol=1e-5)


# --------------------------------------------------------------------------------------
# hand-written backward of an inout function reading the inout's primal

INOUT_SRC = """
[BackwardDerivative(bw)]
void scale(float s, inout float v) { v = v * s; }
void bw(inout DifferentialPair<float> s, inout DifferentialPair<float> v) {
    float dv = v.d; s = diffPair(s.p, v.p * dv); v = diffPair(v.p, s.p * dv); }

[BackwardDerivative(cube_bw)]
float cube_acc(no_diff float k, inout float v) { float r = v * v * v; v = v + k * r; return r; }
void cube_bw(no_diff float k, inout DifferentialPair<float> v, float dr) {
    float x = v.p; float dv = v.d;
    v = diffPair(x, 3.0 * x * x * dr + dv * (1.0 + 3.0 * k * x * x)); }

void wrong_bw(inout DifferentialPair<float> v) { v = diffPair(v.p, 3.0 * v.p * v.d); }
[BackwardDerivative(wrong_bw)]
void sq_inout(inout float v) { v = v * v; }
"""


def test_custom_inout_backward_reading_primal(device):
    m = pydiff.load_module_from_source(f"custom_inout_{next(_names)}", INOUT_SRC, device=device)
    s0, v0 = np.float32([0.5, 1.5, -2.0]), np.float32([2.0, 3.0, 0.25])
    s = pydiff.tensor(s0, device=device, requires_grad=True)
    v = pydiff.tensor(v0, device=device, requires_grad=True)
    m.scale(s, v)
    v.grad.copy_from_numpy(np.float32([1.0, -2.0, 0.5]))
    m.scale.bwds(s, v)  # differentiates at the value read (kept by the forward call)
    dv = np.float64([1.0, -2.0, 0.5])
    np.testing.assert_allclose(s.grad.numpy(), v0 * dv, rtol=1e-6)
    np.testing.assert_allclose(v.grad.numpy(), s0 * dv, rtol=1e-6)

    k, x0 = 0.5, np.float32([0.5, -1.0, 1.25])
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        r = m.cube_acc(k, x, _result="tensor")  # r = x^3, x <- x + k x^3
        total = pydiff.module.library(device).op_add(r, x, _result="tensor")
    tape.backward(total, grad=np.ones(3))
    xd = x0.astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), 3 * xd**2 + 1 + 3 * k * xd**2, rtol=1e-5)


def test_wrong_custom_inout_backward_still_caught(device):
    m = pydiff.load_module_from_source(f"custom_inout_{next(_names)}", INOUT_SRC, device=device)
    assert not pydiff.gradcheck(
        m.sq_inout, (leaf(device, [0.5, 1.5, -0.7]),), raise_exception=False
    )


def test_caller_of_custom_inout_backward_refused_not_crash(device):
    code = textwrap.dedent(
        f"""
        import warnings, pydiff, numpy as np
        warnings.simplefilter("ignore")
        dev = pydiff.create_device({device.type!r})
        m = pydiff.load_module_from_source("seg_caller", '''
        [BackwardDerivative(bw)]
        void f(float s, inout float v) {{ v = v * s; }}
        void bw(inout DifferentialPair<float> s, inout DifferentialPair<float> v) {{
            float dv = v.d; s = diffPair(s.p, v.p * dv); v = diffPair(v.p, s.p * dv); }}
        [Differentiable] float g(float s, float x) {{ float v = x; f(s, v); return v * v; }}
        [Differentiable] float h(float s, float x) {{ return g(s, x) + 1.0; }}
        ''', device=dev)
        s = pydiff.tensor(np.float32([0.5, 1.5]), device=dev, requires_grad=True)
        x = pydiff.tensor(np.float32([2.0, 3.0]), device=dev, requires_grad=True)
        for fn in (m.g, m.h):
            try:
                fn.bwds(s, x, _result=1.0)
                print("RAN")
            except pydiff.ShaderTrapError as exc:
                print("REFUSED", str(exc).replace("\\n", " "))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"process died ({out.returncode}): {out.stderr[-800:]}"
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("REFUSED") for line in lines), out.stdout
    assert "<seg_caller>:6: in g(): calls f()" in lines[0] and "'v'" in lines[0]


@pytest.mark.parametrize(
    "source, callers",
    [
        (  # BackwardDerivativeOf, a primal read through getPrimal()
            """void f(float s, inout float v) { v = v * s; }
            [BackwardDerivativeOf(f)]
            void bw(inout DifferentialPair<float> s, inout DifferentialPair<float> w) {
                s = diffPair(s.p, w.getPrimal() * w.d); w = diffPair(w.p, s.p * w.d); }
            [Differentiable] float g(float x) { float v = x; f(2.0, v); return v; }""",
            ["g"],
        ),
        (  # the backward reads only the in parameter's primal: no finding
            """[BackwardDerivative(bw)] void f(float s, inout float v) { v = v * s; }
            void bw(inout DifferentialPair<float> s, inout DifferentialPair<float> v) {
                s = diffPair(s.p, 2.0 * v.d); v = diffPair(v.p, s.p * v.d); }
            [Differentiable] float g(float x) { float v = x; f(2.0, v); return v; }""",
            [],
        ),
        (  # the primal read is in a comment; a no_diff inout is not differentiated
            """[BackwardDerivative(bw)] void f(float s, inout float v) { v = v * s; }
            void bw(inout DifferentialPair<float> s, inout DifferentialPair<float> v) {
                // v.p
                s = diffPair(s.p, 2.0 * v.d); v = diffPair(v.p, s.p * v.d); }
            [Differentiable] float g(float x) { float v = x; f(2.0, v); return v; }""",
            [],
        ),
    ],
)
def test_custom_inout_scan(source, callers):
    found = lint_custom.scan_source(source, "t.slang")
    # f has a hand-written backward only: forward mode of g is refused too (s44 breakA44)
    assert [f.function for f in found if f.kind == lint.BWD_ONLY_KIND] == ["f"]
    found = [f for f in found if f.kind != lint.BWD_ONLY_KIND]
    assert sorted(f.function for f in found) == callers
    assert all(f.refuses_bwds and not f.crashes_call for f in found)


def test_custom_inout_reading_primal_gradients_in_subprocess(device):
    """The issue's case, checked for its values (the breaker test accepts a refusal too)."""
    code = textwrap.dedent(
        f"""
        import json, numpy as np, pydiff
        dev = pydiff.create_device({device.type!r})
        m = pydiff.load_module_from_source("seg_inout_vals", {INOUT_SRC!r}, device=dev)
        s = pydiff.tensor(np.float32([0.5, 1.5]), device=dev, requires_grad=True)
        v = pydiff.tensor(np.float32([2.0, 3.0]), device=dev, requires_grad=True)
        m.scale(s, v)
        v.grad.copy_from_numpy(np.ones(2, np.float32))
        m.scale.bwds(s, v)
        print(json.dumps([s.grad.numpy().tolist(), v.grad.numpy().tolist()]))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-800:]
    np.testing.assert_allclose(
        json.loads(out.stdout.strip().splitlines()[-1]), [[2, 3], [0.5, 1.5]]
    )
