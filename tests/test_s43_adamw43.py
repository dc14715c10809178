"""The fused Adam/AdamW kernel's reads through ``Float4Load``/``load4`` (two 64-bit words per
float4 on lavapipe, pydiff/kernels.py ``float4_out_source``) and its whole-chunk path without
a bound check per float4 (shaders/optim/adamw.slang): results against float64 NumPy at sizes
that end inside a float4 and inside a chunk, several parameters in one dispatch, both the
paired form and the float4 form of the same device."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import optim
from pydiff.kernels import float4_out_source

ROOT = Path(__file__).resolve().parents[1]
# 1 and 3: less than a float4; 17: a chunk of 4 float4s and one float more; 4097: a float past
# 256 chunks; 16, 64, 65: whole chunks and one float more; 1000003: many groups, odd tail.
SIZES = (1, 3, 17, 4097, 16, 64, 65, 1000003)
STEPS = 4
LR, B1, B2, EPS = 1e-2, 0.9, 0.99, 1e-8


def _numpy_adam64(p, grads, wd, decoupled):
    """torch.optim.Adam (L2 in the gradient) / AdamW (decoupled decay) in float64."""
    p, m, v = p.astype(np.float64), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        if decoupled:
            p = p * (1 - LR * wd)
        else:
            g = g + wd * p
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        p = p - LR * (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
    return p


def test_the_float4_source_reads_as_it_writes():
    paired, plain = float4_out_source(True), float4_out_source(False)
    assert "typealias Float4Load = StructuredBuffer<uint64_t2>;" in paired
    assert "float4 load4(StructuredBuffer<uint64_t2> b, uint i)" in paired
    assert "typealias Float4Load = Float4In;" in plain
    assert "float4 load4(Float4In b, uint i)" in plain
    shader = (ROOT / "shaders" / "optim" / "adamw.slang").read_text()
    assert "uniform Float4Load p0_in" in shader and "load4(grad, q)" in shader


@pytest.mark.parametrize(
    "make, wd, decoupled",
    [(optim.AdamW, 0.05, True), (optim.AdamW, 0.0, True), (optim.Adam, 0.1, False)],
    ids=["adamw-decay", "adamw-no-decay", "adam-l2"],
)
def test_adam_at_odd_sizes_matches_float64_numpy(device, make, wd, decoupled):
    rng = np.random.default_rng(43)
    starts = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    grads = [[rng.standard_normal(n).astype(np.float32) for _ in range(STEPS)] for n in SIZES]
    # eight parameters: two four-parameter dispatches, each slot with its own tail
    ps = [pydiff.tensor(p0, device=device, requires_grad=True) for p0 in starts]
    opt = make(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=wd)
    for step in range(STEPS):
        for p, g in zip(ps, grads):
            p.grad.copy_from_numpy(g[step])
        opt.step()
    for n, p, p0, g in zip(SIZES, ps, starts, grads):
        want = _numpy_adam64(p0, g, wd, decoupled)
        got = p.numpy()
        assert got.shape == (n,)
        # float32 rounding of m and v: where g and m nearly cancel, m's relative error grows;
        # a wrong update (a step, a bias correction, a decay missed) moves p by about LR
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=LR * 1e-3, err_msg=f"size {n}")


def test_a_tail_chunk_leaves_the_next_tensor_alone(device):
    """Two parameters in one pooled buffer class: the first one's last (partial) chunk takes the
    checked path and must not write past its own float4s."""
    rng = np.random.default_rng(7)
    a0 = rng.standard_normal(17).astype(np.float32)
    b0 = np.full(40, 7.25, np.float32)
    a = pydiff.tensor(a0, device=device, requires_grad=True)
    b = pydiff.tensor(b0, device=device)  # not optimized: must stay as it was
    opt = optim.AdamW([a], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.0)
    g = rng.standard_normal(17).astype(np.float32)
    a.grad.copy_from_numpy(g)
    opt.step()
    want = _numpy_adam64(a0, [g], 0.0, True)
    np.testing.assert_allclose(a.numpy(), want, rtol=2e-6, atol=LR * 1e-3)
    assert np.array_equal(b.numpy(), b0)


def test_the_float4_form_on_this_device(device):
    """The same tests with ``PYDIFF_FLOAT4_STORES=float4``: on lavapipe, typed float4 loads and
    float4 stores in the same kernel (``load4`` over ``Float4In``)."""
    if device.type != "vulkan" or os.environ.get("PYDIFF_FLOAT4_STORES"):
        pytest.skip("runs once, from the paired form on Vulkan")
    env = {**os.environ, "PYDIFF_FLOAT4_STORES": "float4", "PYDIFF_DEVICE_TYPES": "vulkan"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


# The other float4 kernels that read through load4 (relu4, relu_bwd_acc4, sgd_step4) and the
# generated backward kernels, whose loads on lavapipe are two 64-bit words too.


def test_generated_backward_reads_words_where_stores_are_paired():
    from pydiff.generated_helpers import SOURCES, imports

    assert "StructuredBuffer<uint64_t2>" in SOURCES["pydiff_gen_helpers_w64"]
    assert imports(True, True, words=True).endswith("import pydiff_gen_helpers_w64;\n")
    assert "w64" not in imports(True, True)


@pytest.mark.parametrize("n", [1, 3, 17, 4097, 65])
def test_relu_forward_and_backward_at_odd_sizes(device, n):
    from pydiff import ops

    rng = np.random.default_rng(n)
    v = rng.standard_normal(n).astype(np.float32)
    v[:2] = np.array([-0.0, 0.0], np.float32)[: min(n, 2)]
    x = pydiff.tensor(v, device=device, requires_grad=True)
    up = rng.standard_normal(n).astype(np.float32)
    with pydiff.Tape() as tape:
        y = ops.relu(x)
        loss = ops.sum(y * pydiff.tensor(up, device=device))
    tape.backward(loss)
    assert np.array_equal(y.numpy(), np.maximum(v, 0))
    np.testing.assert_array_equal(x.grad.numpy(), np.where(v > 0, up, 0).astype(np.float32))


@pytest.mark.parametrize("n", [1, 3, 17, 4097])
def test_sgd_with_momentum_and_decay_at_odd_sizes(device, n):
    rng = np.random.default_rng(n + 1)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(STEPS)]
    p = pydiff.tensor(p0, device=device, requires_grad=True)
    opt = optim.SGD([p], lr=LR, momentum=0.9, weight_decay=0.01)
    for g in grads:
        p.grad.copy_from_numpy(g)
        opt.step()
    want, buf = p0.astype(np.float64), None
    for g in grads:
        d = g.astype(np.float64) + 0.01 * want
        buf = d if buf is None else 0.9 * buf + d
        want = want - LR * buf
    np.testing.assert_allclose(p.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 3, 17, 4097, 65])
def test_generated_polynomial_backward_at_odd_sizes(device, n):
    from pydiff import generated

    m = pydiff.load_module(ROOT / "samples" / "polynomial.slang", device=device)
    rng = np.random.default_rng(n + 2)
    xs = rng.standard_normal(n).astype(np.float32)
    ups = rng.standard_normal(n).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    up = pydiff.tensor(ups, device=device)
    if not generated.backward(m.polynomial, [2.0, 8.0, -1.0, x], up, {3: x.grad_out}):
        pytest.skip("this device takes SlangPy's backward")
    want = ups.astype(np.float64) * (4.0 * xs.astype(np.float64) + 8.0)  # d/dx (2x^2 + 8x - 1)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 3, 17, 4097])
def test_dropout_backward_at_odd_sizes(device, n):
    from pydiff import ops

    rng = np.random.default_rng(n + 3)
    v = (rng.random(n) + 0.5).astype(np.float32)  # no zeros: y == 0 marks a dropped element
    ups = rng.standard_normal(n).astype(np.float32)
    x = pydiff.tensor(v, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.dropout(x, 0.5, seed=43)
        loss = ops.sum(y * pydiff.tensor(ups, device=device))
    tape.backward(loss)
    kept = y.numpy() != 0
    np.testing.assert_array_equal(y.numpy(), np.where(kept, v * np.float32(2.0), 0))
    np.testing.assert_array_equal(x.grad.numpy(), np.where(kept, ups * np.float32(2.0), 0))
