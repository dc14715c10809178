"""Float-vector tensors (float2/3/4) in pooled float4 buffers (pydiff.float_storage): the
results of the generated vector kernels (pydiff.generated_vector: forward, .fwds' value and
tangent), the gradient buffers ``with_grads`` makes for them, and every other float-vector
tensor pydiff allocates. Values against float64 NumPy closed forms and bitwise against
pydiff's SlangPy path; results kept alive never overwritten by later calls; a dropped
result's buffer reused (no new device buffer); zeroed buffers zero when reused dirty; small
repeated forward calls through a call plan's generated kernel (planned_vector)."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from generated_paths import run_both_paths

SOURCE = """
[Differentiable] float3 shade(float3 n, float3 l, float k)
{ return k * max(dot(n, l), 0.0) * n + 0.1 * l; }
[Differentiable] float2 rot(float2 v, float a)
{ return float2(cos(a) * v.x - sin(a) * v.y, sin(a) * v.x + cos(a) * v.y); }
[Differentiable] float len4(float4 v, float s) { return s * sqrt(dot(v, v) + 1.0); }
"""


@pytest.fixture
def m(device):
    return pydiff.load_module_from_source("s35_vecpool", SOURCE, device=device)


@pytest.fixture
def allocations(device, monkeypatch):
    """Bytes of the device buffers created from now on (pooled or not: both count them)."""
    counted = [0]
    allocated = device.queue.allocated

    def counting(nbytes):
        counted[0] += nbytes
        allocated(nbytes)

    monkeypatch.setattr(device.queue, "allocated", counting)
    return counted


def _shade64(n, light, k, u):
    """shade's value, the gradients of n and l for upstream u, and J·(u, 0) (float64)."""
    d = np.einsum("ij,ij->i", n, light)
    mx, on = np.maximum(d, 0.0)[:, None], (d > 0)[:, None]
    un = np.einsum("ij,ij->i", u, n)[:, None]
    ul = np.einsum("ij,ij->i", u, light)[:, None]
    y = k * mx * n + 0.1 * light
    tangent = k * (mx * u + on * ul * n)
    return y, k * (mx * u + on * un * light), k * on * un * n + 0.1 * u, tangent


def _inputs(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, 3)).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("n", [1, 5, 1000])
def test_pooled_results_match_closed_form_and_slangpy_bitwise(device, m, forced, n):
    ns, ls, us = _inputs(n, n)

    def run():
        N = pydiff.tensor(ns, device=device, dtype="float3", requires_grad=True)
        L = pydiff.tensor(ls, device=device, dtype="float3", requires_grad=True)
        U = pydiff.tensor(us, device=device, dtype="float3")
        y = m.shade(N, L, 2.0)
        m.shade.bwds(N, L, 2.0, _result=y.with_grads(grad_in=U))
        value, tangent = m.shade.fwds(N.with_tangent(U), L, 2.0)
        assert y.shape == (n,) and y.dtype == "float3" and tangent.dtype == "float3"
        return [y.numpy(), N.grad.numpy(), L.grad.numpy(), value.numpy(), tangent.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts["forward: vector"] == 1 and counts["fwds: vector"] == 1
    assert counts["backward: vector"] == 1
    for u, v in zip(gen, ref):
        assert u.shape == v.shape == (n, 3) and u.dtype == v.dtype
        np.testing.assert_array_equal(u, v)
    y, gn, gl, tangent = _shade64(*(a.astype(np.float64) for a in (ns, ls)), 2.0, us)
    for got, want in zip(gen, [y, gn, gl, y, tangent]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_results_kept_alive_are_never_overwritten(device, m, forced, allocations):
    n = 257
    ns, ls, _ = _inputs(n, 3)
    N = pydiff.tensor(ns, device=device, dtype="float3")
    L = pydiff.tensor(ls, device=device, dtype="float3")
    m.shade(N, L, 0.0)  # dropped: its buffer goes back to the pool
    device.flush()
    held = [m.shade(N, L, k) for k in (1.0, 2.0, 3.0)]
    assert len({id(y.buffer) for y in held}) == 3
    for k in range(4, 12):  # later calls reuse the dropped results' buffers, never the held ones
        m.shade(N, L, float(k)).numpy()
    for k, y in zip((1.0, 2.0, 3.0), held):
        want = _shade64(ns.astype(np.float64), ls.astype(np.float64), k, ns)[0]
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-6)
    # N, L, the held results and two for the dropped ones (one a call plan's bound object
    # keeps until its next call: planned_kernels.HELD_MAX): not one per call (14 before)
    assert allocations[0] <= 7 * 16 * -(-3 * n // 4)


@pytest.mark.parametrize("n", [300, 1 << 19])  # a small pooled size and a large one (6 MiB)
def test_a_dropped_result_gives_its_buffer_to_the_next_call(device, m, forced, allocations, n):
    ns, ls, us = _inputs(n, 4)
    N = pydiff.tensor(ns, device=device, dtype="float3", requires_grad=True)
    L = pydiff.tensor(ls, device=device, dtype="float3", requires_grad=True)
    U = pydiff.tensor(us, device=device, dtype="float3")

    def step():
        y = m.shade(N, L, 0.5)
        m.shade.bwds(N, L, 0.5, _result=y.with_grads(grad_in=U))  # a new grad_out too
        value, tangent = m.shade.fwds(N.with_tangent(U), L, 0.5)
        return value.numpy()

    step()
    before = allocations[0]
    for _ in range(3):
        step()
    assert allocations[0] == before  # (3 * 4 * 12n bytes before: every result a new buffer)
    want = _shade64(ns.astype(np.float64), ls.astype(np.float64), 0.5, us)[0]
    np.testing.assert_allclose(step(), want, rtol=1e-5, atol=1e-5)
    # 5 steps of gradients added into N.grad and L.grad (zeroed once)
    _, gn, gl, _ = _shade64(ns.astype(np.float64), ls.astype(np.float64), 0.5, us)
    np.testing.assert_allclose(N.grad.numpy(), 5 * gn, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(L.grad.numpy(), 5 * gl, rtol=1e-4, atol=1e-4)


def test_zeroed_vector_buffers_are_zero_when_reused(device, m, forced, allocations):
    n = 64
    ns, ls, _ = _inputs(n, 5)
    N = pydiff.tensor(ns, device=device, dtype="float3", requires_grad=True)
    L = pydiff.tensor(ls, device=device, dtype="float3")
    for k in range(4):  # dirty pooled buffers of this size, dropped
        m.shade(N, L, 7.0 + k)
    device.flush()
    before = allocations[0]
    z = pydiff.zeros((n,), dtype="float3", device=device)
    assert allocations[0] == before  # a dropped result's buffer, zeroed
    np.testing.assert_array_equal(z.numpy(), np.zeros((n, 3), np.float32))
    for k in range(4):
        m.shade(N, L, 7.0 + k)
    y = m.shade(N, L, 2.0).with_grads(ones=True)  # a new shared gradient buffer of ones
    m.shade.bwds(N, L, 2.0, _result=y)
    ones = np.ones((n, 3))
    gn = _shade64(ns.astype(np.float64), ls.astype(np.float64), 2.0, ones)[1]
    np.testing.assert_allclose(N.grad.numpy(), gn, rtol=1e-5, atol=1e-5)
    y2 = m.shade(N, L, 1.0).with_grads()  # zeroed: .grad reads zeros
    np.testing.assert_array_equal(y2.grad.numpy(), np.zeros((n, 3), np.float32))


def test_other_widths_views_and_torch(device, m, forced):
    n = 6
    rng = np.random.default_rng(6)
    vs2 = rng.standard_normal((n, 2)).astype(np.float32)
    vs4 = rng.standard_normal((n, 4)).astype(np.float32)
    V2 = pydiff.tensor(vs2, device=device, dtype="float2")
    V4 = pydiff.tensor(vs4, device=device, dtype="float4")
    r = m.rot(V2, 0.3)
    c, s = np.cos(0.3), np.sin(0.3)
    v = vs2.astype(np.float64)
    want = np.stack([c * v[:, 0] - s * v[:, 1], s * v[:, 0] + c * v[:, 1]], axis=1)
    assert r.dtype == "float2" and r.shape == (n,)
    np.testing.assert_allclose(r.numpy(), want, rtol=1e-6, atol=1e-6)
    length = m.len4(V4, 2.0)  # a float result of a vector-parameter function
    want4 = 2.0 * np.sqrt((vs4.astype(np.float64) ** 2).sum(axis=1) + 1.0)
    np.testing.assert_allclose(length.numpy(), want4, rtol=1e-6)
    view = r.reshape(2, 3)
    assert view.shape == (2, 3) and view.dtype == "float2"
    np.testing.assert_array_equal(view.numpy(), r.numpy().reshape(2, 3, 2))
    torch = pytest.importorskip("torch")
    t = pydiff.to_torch(r)
    assert tuple(t.shape) == (n, 2) and t.dtype == torch.float32
    np.testing.assert_array_equal(t.cpu().numpy(), r.numpy())


# --------------------------------------------------------------------------------------------
# small repeated calls: forward call plans dispatch generated_vector's kernel (planned_vector)


def test_small_vector_calls_switch_to_planned_kernels_with_the_same_bits(device, m, soon):
    n = 16
    ns, ls, us = _inputs(n, 7)
    N = pydiff.tensor(ns, device=device, dtype="float3", requires_grad=True)
    L = pydiff.tensor(ls, device=device, dtype="float3", requires_grad=True)
    Y = pydiff.zeros((n,), dtype="float3", device=device)
    Y = Y.with_grads(grad_in=pydiff.tensor(us, device=device, dtype="float3"))
    want, gn, gl, _ = _shade64(ns.astype(np.float64), ls.astype(np.float64), 0.5, us)
    given, fresh = [], []
    for k in range(8):
        assert m.shade(N, L, 0.5, _result=Y) is Y
        given.append(Y.numpy())
        fresh.append(m.shade(N, L, 0.5))
        m.shade.bwds(N, L, 0.5, _result=Y)
        np.testing.assert_allclose(N.grad.numpy(), (k + 1) * gn, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(L.grad.numpy(), (k + 1) * gl, rtol=1e-5, atol=1e-5)
    stats = soon.stats()  # (the first call of a layout makes its plan, then 3 on SlangPy's)
    assert stats.get("forward: vector") == 2 * 4
    assert not stats.get("backward: vector")  # small .bwds: SlangPy's call (faster there)
    assert len({id(t.storage) for t in fresh}) == 8  # a new result each call
    for values in given + [t.numpy() for t in fresh]:  # SlangPy's and the planned kernel's
        np.testing.assert_array_equal(values, given[0])
        np.testing.assert_allclose(values, want, rtol=1e-6, atol=1e-6)


def test_small_vector_bwds_into_a_shared_gradient_buffer(device, m, soon):
    n = 16
    ns, ls, us = _inputs(n, 8)
    G = pydiff.zeros((n,), dtype="float3", device=device)
    N = pydiff.tensor(ns, device=device, dtype="float3").with_grads(grad_in=G, grad_out=G)
    L = pydiff.tensor(ls, device=device, dtype="float3").with_grads(grad_in=G, grad_out=G)
    U = pydiff.tensor(us, device=device, dtype="float3")
    Y = pydiff.zeros((n,), dtype="float3", device=device).with_grads(grad_in=U)
    _, gn, gl, _ = _shade64(ns.astype(np.float64), ls.astype(np.float64), 2.0, us)
    for k in range(7):
        m.shade(N, L, 2.0, _result=Y)
        m.shade.bwds(N, L, 2.0, _result=Y)
        np.testing.assert_allclose(G.numpy(), (k + 1) * (gn + gl), rtol=1e-5, atol=1e-5)
    assert soon.stats().get("forward: vector") == 3


def test_planned_vector_forward_of_other_layouts(device, m, soon):
    n = 12
    rng = np.random.default_rng(9)
    vs2 = rng.standard_normal((n, 2)).astype(np.float32)
    vs4 = rng.standard_normal((n, 4)).astype(np.float32)
    V2 = pydiff.tensor(vs2, device=device)  # a float tensor (n, 2) at a float2
    V4 = pydiff.tensor(vs4, device=device, dtype="float4")
    S = pydiff.tensor([2.0], device=device)  # a broadcast float
    c, s = np.cos(0.3), np.sin(0.3)
    v = vs2.astype(np.float64)
    want2 = np.stack([c * v[:, 0] - s * v[:, 1], s * v[:, 0] + c * v[:, 1]], axis=1)
    want4 = 2.0 * np.sqrt((vs4.astype(np.float64) ** 2).sum(axis=1) + 1.0)
    for _ in range(6):
        r, length = m.rot(V2, 0.3), m.len4(V4, S)
        assert r.dtype == "float2" and r.shape == (n,) and length.shape == (n,)
        np.testing.assert_allclose(r.numpy(), want2, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(length.numpy(), want4, rtol=1e-6)
    assert soon.stats().get("forward: vector") == 2 * 2
