"""Breaker tests for issue 16's fast paths (generated kernels, call plans, float4 kernels).

Each case compares against an independent reference (float64 NumPy / closed forms), and the
generated path against SlangPy's path (``PYDIFF_GENERATED=0``) in separate subprocesses.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pydiff

SRC = """
import slangpy;
[Differentiable]
float poly(float a, float b, float c, float x) { return a * x * x + b * x + c; }
[Differentiable]
float mul2(float x, float y) { return x * y; }
[Differentiable]
float mixnd(float x, no_diff float k) { return x * x * k; }
[Differentiable]
[BackwardDerivative(divk_bwd)]
[ForwardDerivative(divk_fwd)]
float divk(float x, no_diff float k) { return x; }
void divk_bwd(inout DifferentialPair<float> x, no_diff float k, float d)
{ x = diffPair(x.p, d * 3.0 / k); }
DifferentialPair<float> divk_fwd(DifferentialPair<float> x, no_diff float k)
{ return diffPair(x.p, x.d * 3.0 / k); }
[Differentiable]
[BackwardDerivative(xx_bwd)]
[ForwardDerivative(xx_fwd)]
float xx(float x) { return x; }
void xx_bwd(inout DifferentialPair<float> x, float d) { x = diffPair(x.p, d * 3.0 / (x.p - x.p)); }
DifferentialPair<float> xx_fwd(DifferentialPair<float> x)
{ return diffPair(x.p, x.d * 3.0 / (x.p - x.p)); }
"""

PRE = f"""
import sys
import numpy as np
import pydiff
m = pydiff.load_module_from_source("brk16", '''{SRC}''')
out = {{}}
"""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(body, env_extra, tmp_path, tag):
    path = tmp_path / f"{tag}.npz"
    code = PRE + textwrap.dedent(body) + f"\nnp.savez({str(path)!r}, **out)\n"
    env = dict(os.environ)
    for k in ("PYDIFF_GENERATED", "PYDIFF_GENERATED_MIN_ELEMENTS"):
        env.pop(k, None)
    env.update(env_extra)
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, f"{tag}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _both(body, tmp_path):
    """Run body on SlangPy's path and on the generated path (forced for every size)."""
    off = _run(body, {"PYDIFF_GENERATED": "0"}, tmp_path, "off")
    on = _run(body, {"PYDIFF_GENERATED_MIN_ELEMENTS": "1"}, tmp_path, "on")
    assert off.keys() == on.keys()
    return off, on


def _bitwise(off, on):
    bad = [k for k in off if not np.array_equal(off[k], on[k], equal_nan=True)]
    assert not bad, f"paths differ for {bad[:8]}"


SIZES = [1, 3, 4095, 4096, 4097, 4099]


def test_poly_broadcast_grads_both_paths(tmp_path):
    body = f"""
    rng = np.random.default_rng(1)
    for n in {SIZES}:
        xv = rng.standard_normal(n).astype(np.float32)
        g = rng.standard_normal(n).astype(np.float32)
        out[f"x{{n}}"] = xv; out[f"g{{n}}"] = g
        for sh in [(), (1,)]:
            a = pydiff.tensor(np.full(sh, 1.5, np.float32), requires_grad=True)
            c = pydiff.tensor(np.full(sh, -0.25, np.float32), requires_grad=True)
            x = pydiff.tensor(xv, requires_grad=True)
            y = m.poly(a, 2.0, c, x, _result="tensor").with_grads()
            y.grad.copy_from_numpy(g)
            m.poly.bwds(a, 2.0, c, x, _result=y)
            # second backward accumulates (ACCUMULATE policy)
            m.poly.bwds(a, 2.0, c, x, _result=y)
            k = f"{{n}}{{len(sh)}}"
            out["y" + k] = y.numpy(); out["xg" + k] = x.grad.numpy()
            out["ag" + k] = a.grad.numpy(); out["cg" + k] = c.grad.numpy()
    """
    off, on = _both(body, tmp_path)
    _bitwise(off, on)
    for n in SIZES:
        x = off[f"x{n}"].astype(np.float64)
        g = off[f"g{n}"].astype(np.float64)
        for r in (0, 1):
            k = f"{n}{r}"
            np.testing.assert_allclose(
                on["y" + k], 1.5 * x * x + 2 * x - 0.25, rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(on["xg" + k], 2 * g * (3 * x + 2), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(
                on["ag" + k].ravel(), [2 * (g * x * x).sum()], rtol=1e-4, atol=1e-4
            )
            np.testing.assert_allclose(on["cg" + k].ravel(), [2 * g.sum()], rtol=1e-4, atol=1e-4)


def test_zero_dim_tensor_keeps_shape(device):
    # pydiff.tensor of a 0-d array was (1,) (its grad too); fixed with 0-d tensors (issue 17)
    a = pydiff.tensor(np.float32(1.5), device=device, requires_grad=True)
    assert a.shape == () and a.numpy().shape == () and a.grad.numpy().shape == ()


def test_aliasing_and_nonfinite_broadcast(tmp_path):
    body = f"""
    rng = np.random.default_rng(2)
    for n in {SIZES}:
        xv = rng.standard_normal(n).astype(np.float32)
        out[f"x{{n}}"] = xv
        x = pydiff.tensor(xv, requires_grad=True)
        y = m.mul2(x, x, _result="tensor").with_grads(ones=True)
        m.mul2.bwds(x, x, _result=y)
        out[f"alias{{n}}"] = x.grad.numpy()
        for val in (np.inf, np.nan):
            a = pydiff.tensor(np.array([val], np.float32), requires_grad=True)
            x = pydiff.tensor(xv, requires_grad=True)
            y = m.poly(a, 2.0, -1.0, x, _result="tensor").with_grads(ones=True)
            m.poly.bwds(a, 2.0, -1.0, x, _result=y)
            out[f"nf{{n}}{{val}}x"] = x.grad.numpy(); out[f"nf{{n}}{{val}}a"] = a.grad.numpy()
    """
    off, on = _both(body, tmp_path)
    _bitwise(off, on)
    for n in SIZES:
        x = on[f"x{n}"].astype(np.float64)
        np.testing.assert_allclose(on[f"alias{n}"], 2 * x, rtol=1e-6)
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(
                on[f"nf{n}infx"], np.float32(np.inf) * np.sign(x).astype(np.float32)
            )
        assert np.isnan(on[f"nf{n}nanx"]).all()


def test_custom_derivative_runtime_inf_nan(tmp_path):
    # d * 3 / k with k a runtime zero: the derivative must be +-inf (or NaN for 0 * inf).
    body = f"""
    for n in {SIZES}:
        xv = np.linspace(-1, 1, n).astype(np.float32)
        for kv in (0.0, 2.0):
            x = pydiff.tensor(xv, requires_grad=True)
            y = m.divk(x, kv, _result="tensor").with_grads(ones=True)
            m.divk.bwds(x, kv, _result=y)
            out[f"b{{n}}{{kv}}"] = x.grad.numpy()
            v, dv = m.divk.fwds(pydiff.tensor(xv).with_tangent(np.ones(n, np.float32)), kv)
            out[f"f{{n}}{{kv}}"] = dv.numpy()
    """
    off, on = _both(body, tmp_path)
    _bitwise(off, on)
    for n in SIZES:
        assert np.isposinf(on[f"b{n}0.0"]).all() and np.isposinf(on[f"f{n}0.0"]).all()
        np.testing.assert_array_equal(on[f"b{n}2.0"], np.full(n, 1.5, np.float32))
        np.testing.assert_array_equal(on[f"f{n}2.0"], np.full(n, 1.5, np.float32))


def test_fwds_tangents_broadcast_and_pairs(tmp_path):
    body = f"""
    rng = np.random.default_rng(3)
    for n in {SIZES}:
        xv = rng.standard_normal(n).astype(np.float32)
        t = rng.standard_normal(n).astype(np.float32)
        out[f"x{{n}}"] = xv; out[f"t{{n}}"] = t
        a = pydiff.tensor(np.array([1.5], np.float32)).with_tangent(np.array([0.5], np.float32))
        v, dv = m.poly(a, (2.0, -1.0), -1.0, pydiff.tensor(xv).with_tangent(t)) if False else \
            m.poly.fwds(a, (2.0, -1.0), -1.0, pydiff.tensor(xv).with_tangent(t))
        out[f"v{{n}}"] = v.numpy(); out[f"dv{{n}}"] = dv.numpy()
        v2, dv2 = m.mixnd.fwds(pydiff.tensor(xv).with_tangent(t), 3.0)
        out[f"m{{n}}"] = dv2.numpy()
    """
    off, on = _both(body, tmp_path)
    _bitwise(off, on)
    for n in SIZES:
        x = on[f"x{n}"].astype(np.float64)
        t = on[f"t{n}"].astype(np.float64)
        np.testing.assert_allclose(on[f"v{n}"], 1.5 * x * x + 2 * x - 1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            on[f"dv{n}"], 0.5 * x * x - x + (3 * x + 2) * t, rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(on[f"m{n}"], 6 * x * t, rtol=1e-5, atol=1e-5)


def test_call_plan_number_tensor_alternation(tmp_path):
    body = """
    rng = np.random.default_rng(4)
    for n in (5, 4097):
        xv = rng.standard_normal(n).astype(np.float32)
        out[f"x{n}"] = xv
        for i in range(6):
            x = pydiff.tensor(xv, requires_grad=True)
            if i % 3 == 0:
                a = 1.0 + i
            elif i % 3 == 1:
                a = pydiff.tensor(np.array([1.0 + i], np.float32), requires_grad=True)
            else:
                a = pydiff.tensor(np.full(n, 1.0 + i, np.float32), requires_grad=True)
            y = m.poly(a, 0.5 * i, -1.0, x, _result="tensor").with_grads(ones=True)
            m.poly.bwds(a, 0.5 * i, -1.0, x, _result=y)
            out[f"y{n}_{i}"] = y.numpy(); out[f"xg{n}_{i}"] = x.grad.numpy()
            if not isinstance(a, float):
                out[f"ag{n}_{i}"] = a.grad.numpy()
    """
    off, on = _both(body, tmp_path)
    _bitwise(off, on)
    for n in (5, 4097):
        x = on[f"x{n}"].astype(np.float64)
        for i in range(6):
            av, b = 1.0 + i, 0.5 * i
            np.testing.assert_allclose(
                on[f"y{n}_{i}"], av * x * x + b * x - 1, rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(on[f"xg{n}_{i}"], 2 * av * x + b, rtol=1e-5, atol=1e-5)
            if i % 3 == 1:
                np.testing.assert_allclose(on[f"ag{n}_{i}"], [(x * x).sum()], rtol=1e-4)
            elif i % 3 == 2:
                np.testing.assert_allclose(on[f"ag{n}_{i}"], x * x, rtol=1e-5, atol=1e-6)


def test_tape_same_tensor_twice_and_reset_policy(tmp_path):
    body = """
    rng = np.random.default_rng(5)
    for n in (7, 4096, 4099):
        xv = rng.standard_normal(n).astype(np.float32)
        out[f"x{n}"] = xv
        x = pydiff.tensor(xv, requires_grad=True)
        with pydiff.Tape() as tape:
            y = m.mul2(x, x, _result="tensor")
            z = m.poly(1.0, 2.0, 0.0, y, _result="tensor")   # z = y^2 + 2y
        tape.backward(z, grad=np.ones(n, np.float32))
        out[f"tg{n}"] = x.grad.numpy()
        x.zero_policy = pydiff.ZeroPolicy.RESET
        for _ in range(3):
            with pydiff.Tape() as tape:
                y = m.mul2(x, x, _result="tensor")
                z = m.poly(1.0, 2.0, 0.0, y, _result="tensor")
            tape.backward(z, grad=np.ones(n, np.float32))
        out[f"rg{n}"] = x.grad.numpy()
    """
    off, on = _both(body, tmp_path)
    _bitwise(off, on)
    for n in (7, 4096, 4099):
        x = on[f"x{n}"].astype(np.float64)
        ref = (2 * x * x + 2) * 2 * x  # d/dx (x^4 + 2x^2)
        np.testing.assert_allclose(on[f"tg{n}"], ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(on[f"rg{n}"], ref, rtol=1e-5, atol=1e-5)


def test_strict_policy_refuses_second_bwds_generated(device):
    m = pydiff.load_module_from_source("brk16s", SRC, device=device)
    n = 4097
    xv = np.linspace(-1, 1, n).astype(np.float32)
    x = pydiff.tensor(xv, device=device, requires_grad=True)
    y = m.mul2(x, 2.0, _result="tensor").with_grads(ones=True)
    with pydiff.zero_policy("strict"):
        m.mul2.bwds(x, 2.0, _result=y)
        with pytest.raises(pydiff.StaleGradientError):
            m.mul2.bwds(x, 2.0, _result=y)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(n, 2.0, np.float32))


def test_noncontiguous_and_half_decline_correctly(device):
    m = pydiff.load_module_from_source("brk16h", SRC, device=device)
    n = 8194
    base = np.linspace(-2, 2, n).astype(np.float32)
    xb = pydiff.tensor(base.reshape(2, n // 2), device=device)
    xt = xb.numpy().T.copy()
    try:
        xv = xb.T if hasattr(xb, "T") else None
    except Exception:  # noqa: BLE001
        xv = None
    if xv is not None:
        y = m.mul2(xv, xv, _result="tensor")
        np.testing.assert_allclose(y.numpy(), xt.astype(np.float64) ** 2, rtol=1e-6)
    h = pydiff.tensor(base, dtype="half", device=device)
    try:
        y = m.mul2(h, 2.0, _result="tensor")
    except Exception:  # noqa: BLE001  (declining with an error is fine; a wrong value is not)
        return
    np.testing.assert_allclose(
        np.asarray(y.numpy(), np.float64), 2 * base.astype(np.float16), rtol=1e-3
    )


@pytest.mark.parametrize("n", [1, 3, 5, 17, 4097])
def test_adamw_sgd_odd_sizes_vs_numpy(device, n):
    rng = np.random.default_rng(n)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(5)]
    p = pydiff.tensor(p0, device=device, requires_grad=True)
    q = pydiff.tensor(p0, device=device, requires_grad=True)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.01
    opt = pydiff.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    sgd = pydiff.optim.SGD([q], lr=0.1, momentum=0.9, weight_decay=0.01)
    P = p0.astype(np.float64)
    Q = p0.astype(np.float64)
    mm = np.zeros(n)
    vv = np.zeros(n)
    buf = None
    for t, g in enumerate(grads, 1):
        opt.zero_grad()
        sgd.zero_grad()
        p.grad.copy_from_numpy(g)
        q.grad.copy_from_numpy(g)
        opt.step()
        sgd.step()
        G = g.astype(np.float64)
        P = P * (1 - lr * wd)
        mm = b1 * mm + (1 - b1) * G
        vv = b2 * vv + (1 - b2) * G * G
        P = P - lr * (mm / (1 - b1**t)) / (np.sqrt(vv / (1 - b2**t)) + eps)
        d = G + 0.01 * Q
        buf = d if buf is None else 0.9 * buf + d
        Q = Q - 0.1 * buf
    np.testing.assert_allclose(p.numpy(), P, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(q.numpy(), Q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shape", [(1, 5, 3), (4, 1, 1), (5, 4, 1), (7, 13, 5), (3, 8, 4), (1, 1, 1)]
)
def test_matmul_linear_relu_odd_shapes(device, shape):
    M, K, N = shape
    rng = np.random.default_rng(M * 100 + K * 10 + N)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    W = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    G = rng.standard_normal((M, N)).astype(np.float32)
    a = pydiff.tensor(A, device=device, requires_grad=True)
    b = pydiff.tensor(B, device=device, requires_grad=True)
    w = pydiff.tensor(W, device=device, requires_grad=True)
    bb = pydiff.tensor(bias, device=device, requires_grad=True)
    x = pydiff.tensor(A, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        c = pydiff.ops.matmul(a, b)
    tape.backward(c, grad=G)
    A64, B64, W64, G64 = (v.astype(np.float64) for v in (A, B, W, G))
    np.testing.assert_allclose(c.numpy(), A64 @ B64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.grad.numpy(), G64 @ B64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), A64.T @ G64, rtol=1e-5, atol=1e-5)
    with pydiff.Tape() as tape:
        o = pydiff.ops.linear(x, w, bb, activation="relu")
    tape.backward(o, grad=G)
    pre = A64 @ W64.T + bias
    mask = pre > 0
    np.testing.assert_allclose(o.numpy(), np.maximum(pre, 0), rtol=1e-5, atol=1e-5)
    Gm = G64 * mask
    np.testing.assert_allclose(x.grad.numpy(), Gm @ W64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), Gm.T @ A64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bb.grad.numpy(), Gm.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 5, 15, 17, 4097])
def test_relu_odd_sizes(device, n):
    v = np.linspace(-1, 1, n).astype(np.float32)
    if n > 2:
        v[n // 2] = 0.0
    x = pydiff.tensor(v, device=device, requires_grad=True)
    g = np.arange(1, n + 1, dtype=np.float32)
    with pydiff.Tape() as tape:
        y = pydiff.ops.relu(x)
    tape.backward(y, grad=g)
    np.testing.assert_array_equal(y.numpy(), np.maximum(v, 0))
    np.testing.assert_array_equal(x.grad.numpy(), np.where(v > 0, g, 0))


def test_high_rank_call_no_push_constant_overflow(tmp_path):
    """SlangPy's path of a >=4-D call with a broadcast (1,) parameter used to log 'Total push
    constant size (284..464) exceeds the maximum allowed (256)': pydiff.call_uniforms."""
    code = (
        PRE
        + """
rng = np.random.default_rng(0)
xv = rng.standard_normal((2, 2, 2, 513)).astype(np.float32)
X = xv.astype(np.float64)
a = pydiff.tensor(np.array([1.25], np.float32), requires_grad=True)
x = pydiff.tensor(xv, requires_grad=True)
y = m.poly(a, 2.0, -1.0, x, _result="tensor").with_grads(ones=True)
m.poly.bwds(a, 2.0, -1.0, x, _result=y)
assert np.allclose(x.grad.numpy(), 2.5 * X + 2, atol=1e-5)
assert np.isclose(a.grad.numpy()[0], (X * X).sum(), rtol=1e-5)
"""
    )
    if "vulkan" not in pydiff.available_devices():  # Vulkan's limit is what this is about
        pytest.skip("no Vulkan device here")
    env = dict(os.environ, PYDIFF_GENERATED="0", PYDIFF_DEVICE="vulkan")
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "exceeds the maximum" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-500:]


@pytest.mark.parametrize("shape", [(3, 4097), (2, 3, 700), (4097, 1), (1, 4099)])
def test_multidim_generated_vs_closed_form(device, shape):
    m = pydiff.load_module_from_source("brk16md", SRC, device=device)
    rng = np.random.default_rng(sum(shape))
    xv = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    X, G = xv.astype(np.float64), g.astype(np.float64)
    a = pydiff.tensor(np.array([1.25], np.float32), device=device, requires_grad=True)
    x = pydiff.tensor(xv, device=device, requires_grad=True)
    y = m.poly(a, 2.0, -1.0, x, _result="tensor").with_grads()
    y.grad.copy_from_numpy(g)
    m.poly.bwds(a, 2.0, -1.0, x, _result=y)
    v, dv = m.poly.fwds(a.detach().with_tangent([1.0]), 2.0, -1.0, x.detach().with_tangent(g))
    np.testing.assert_allclose(y.numpy(), 1.25 * X * X + 2 * X - 1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), G * (2.5 * X + 2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.grad.numpy(), [(G * X * X).sum()], rtol=1e-5)
    np.testing.assert_allclose(dv.numpy(), X * X + (2.5 * X + 2) * G, rtol=1e-5, atol=1e-5)


def test_threads_views_and_function_outputs(device):
    import threading

    m = pydiff.load_module_from_source("brk16th", SRC, device=device)
    n = 4098
    xv = np.linspace(-1.5, 1.5, n).astype(np.float32)
    X = xv.astype(np.float64)
    res = {}

    def worker(i):
        a = pydiff.tensor(np.array([1.0 + i], np.float32), device=device, requires_grad=True)
        x = pydiff.tensor(xv, device=device, requires_grad=True)
        for _ in range(3):
            y = m.poly(a, 2.0, -1.0, x, _result="tensor").with_grads(ones=True)
            m.poly.bwds(a, 2.0, -1.0, x, _result=y)
        res[i] = (a.grad.numpy(), x.grad.numpy())

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i in range(3):
        np.testing.assert_allclose(res[i][0], [3 * (X * X).sum()], rtol=1e-5)
        np.testing.assert_allclose(res[i][1], 3 * (2 * (1 + i) * X + 2), rtol=1e-5, atol=1e-5)

    # the same tensor through two reshape views
    x = pydiff.tensor(xv, device=device, requires_grad=True)
    v1, v2 = x.reshape((2, n // 2)), x.reshape((2, n // 2))
    y = m.mul2(v1, v2, _result="tensor").with_grads(ones=True)
    m.mul2.bwds(v1, v2, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * X, rtol=1e-6)

    class Scale(pydiff.Function):
        @staticmethod
        def forward(ctx, t):
            return m.mul2(t, 4.0, _result="tensor")

        @staticmethod
        def backward(ctx, g):
            return 4.0 * g.numpy()

    for _ in range(3):
        junk = pydiff.tensor(np.full(n, 5.0, np.float32), device=device, requires_grad=True)
        junk.grad.copy_from_numpy(np.full(n, 777.0, np.float32))
        del junk
        x = pydiff.tensor(xv, device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            s = Scale.apply(x)
            w = m.poly(1.0, 1.0, 0.0, Scale.apply(s), _result="tensor")  # r = 16x: r^2 + r
            u = m.mul2(s, s, _result="tensor")  # 16 x^2
            z = m.mul2(w, u, _result="tensor")
        tape.backward(z, grad=np.ones(n, np.float32))
        # z = (256 x^2 + 16 x) * 16 x^2 = 4096 x^4 + 256 x^3
        np.testing.assert_allclose(x.grad.numpy(), 16384 * X**3 + 768 * X**2, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("n", [5, 4097])
def test_relu_propagates_nan(device, n):
    """relu(NaN) is NaN (NumPy's maximum, torch.relu); its gradient there follows PyTorch's
    convention (threshold_backward: 0 where the result is <= 0, else the upstream)."""
    v = np.linspace(-1, 1, n).astype(np.float32)
    v[1] = np.nan
    x = pydiff.tensor(v, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = pydiff.ops.relu(x)
    tape.backward(y, grad=np.ones(n, np.float32))
    assert np.isnan(y.numpy()[1])
    expected = np.where(v <= 0, 0.0, 1.0)  # NaN <= 0 is false: the upstream passes
    np.testing.assert_array_equal(x.grad.numpy(), expected)


def test_linear_relu_propagates_nan(device):
    """A diverged batch shows: a NaN input row stays NaN through the fused relu."""
    x = pydiff.tensor(np.array([[np.nan, 1.0, 2.0, 3.0]], np.float32), device=device)
    w = pydiff.tensor(np.eye(4, dtype=np.float32), device=device)
    assert np.isnan(pydiff.ops.linear(x, w).numpy()).all()
    assert np.isnan(pydiff.ops.linear(x, w, activation="relu").numpy()).all()
