"""Adversarial checks of the generated kernels (session 43, breaker43), and three gaps found
around them. Every value and gradient is compared with a closed form in float64 NumPy (or a
float64 central difference) and, where a generated kernel runs, bitwise with SlangPy's path
(``PYDIFF_GENERATED=0``).

Fixed here (each test failed before):
- ``copy_`` / ``fill`` / ``copy_from_numpy`` into a strided view raised SlangPy's bare
  ``RuntimeError: Destination tensor must be contiguous``; now the view's elements are written.
- ``_result="tensr"`` raised SlangPy's bare ``ValueError: Unknown return type 'tensr'``; now
  a ``ValueError`` naming ``_result`` and the close name.
- ``.fwds`` of ``T gen<T : __BuiltinFloatingPointType>`` at a ``float3`` tensor raised a raw
  ``SlangCompileError`` of pydiff's wrapper; now a ``TypeError`` naming the parameter and type.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import slangpy as spy

import pydiff
from pydiff import generated
from generated_paths import run_both_paths

SOURCE = """
import slangpy;
[Differentiable] float b43_f(float a, float x) { return a * x * x + sin(x); }
[BackwardDerivative(b43_cb_bwd)]
float b43_cb(float a, float x) { return a * x * x; }
void b43_cb_bwd(inout DifferentialPair<float> a, inout DifferentialPair<float> x, float d)
{ a = diffPair(a.p, 3.0 * d); x = diffPair(x.p, 7.0 * d); }
[ForwardDerivative(b43_cf_fwd)]
float b43_cf(float x) { return x * x; }
DifferentialPair<float> b43_cf_fwd(DifferentialPair<float> x)
{ return diffPair(x.p * x.p, 5.0 * x.d); }
[Differentiable] float b43_loop(float x, float n)
{ float s = 0; [MaxIters(64)] for (int i = 0; i < int(n); i++) s += x * x * 0.5; return s; }
[Differentiable] float b43_leaky(float x) { return x > 0 ? x : 0.1 * x; }
[Differentiable] float b43_det(float a, float x) { return a * detach(x) * x; }
[Differentiable] float3 b43_shade(float3 n, float3 l, float k) { return n * dot(n, l) * k; }
[Differentiable] T b43_gen<T : __BuiltinFloatingPointType>(T x) { return x * x; }
[Differentiable] T b43_genf<T : IFloat>(T x) { return x * x; }
[Differentiable]
void b43_grid(int idx, float a, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> result)
{ float v = x[idx]; result[idx] = a * v * v + sin(v); }
"""


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s43_breaker43", SOURCE, device=device)


def _f(a, x):
    return a * x * x + np.sin(x)


def _df(a, x):
    return 2 * a * x + np.cos(x)


def _same(gen: list, ref: list) -> None:
    for u, v in zip(gen, ref):
        np.testing.assert_array_equal(u, v)


def _close(got: list, want: list, tol: float = 2e-4) -> None:
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol)


def _view(t, shape, strides, offset, device):
    return pydiff.Tensor(t.native.view(shape=shape, strides=strides, offset=offset), device)


# ------------------------------------------------------------------------------------------
# fixed: writes into strided views


def test_copy_into_strided_view_writes_its_elements(device):
    base = np.arange(16, dtype=np.float32).reshape(4, 4)
    x = pydiff.tensor(base, device=device)
    every_other = _view(x, (4, 2), (4, 2), 0, device)
    every_other.copy_(pydiff.tensor(-np.ones((4, 2), np.float32), device=device))
    want = base.copy()
    want[:, ::2] = -1
    np.testing.assert_array_equal(x.numpy(), want)
    transposed = _view(x, (4, 4), (1, 4), 0, device)
    transposed.copy_from_numpy(base)  # writes base.T into x
    np.testing.assert_array_equal(x.numpy(), base.T)
    np.testing.assert_array_equal(transposed.numpy(), base)
    transposed.fill(5.0)
    np.testing.assert_array_equal(x.numpy(), np.full((4, 4), 5.0))


def test_copy_into_strided_vector_view_and_reversed(device):
    x3 = pydiff.zeros((6,), dtype="float3", device=device)
    _view(x3, (3,), (2,), 1, device).copy_from_numpy(np.ones((3, 3), np.float32))
    want = np.zeros((6, 3), np.float32)
    want[1::2] = 1
    np.testing.assert_array_equal(x3.numpy(), want)
    x = pydiff.tensor(np.arange(8, dtype=np.float32), device=device)
    n = x.native
    reversed_view = spy.Tensor(n.storage, n.dtype, [4], [-2], 7)  # elements 7, 5, 3, 1
    pydiff.Tensor(reversed_view, device).fill(-1.0)
    np.testing.assert_array_equal(x.numpy(), [0, -1, 2, -1, 4, -1, 6, -1])


def test_write_into_a_view_holding_elements_twice_is_refused(device):
    x = pydiff.zeros((4,), device=device)
    repeated = _view(x, (3, 4), (0, 1), 0, device)
    with pytest.raises(ValueError, match=r"shape \(3, 4\) and strides \(0, 1\)"):
        repeated.fill(1.0)
    np.testing.assert_array_equal(x.numpy(), np.zeros(4))


# ------------------------------------------------------------------------------------------
# fixed: a mistyped _result name, a generic forward mode at a type it cannot take


@pytest.mark.parametrize("name", ["tensr", "Tensor", ""])
def test_unknown_result_name_names_result(mod, device, name):
    x = pydiff.tensor(np.ones(8, np.float32), device=device)
    with pytest.raises(ValueError, match=r"_result=.*is not a result kind") as info:
        mod.b43_f(1.0, x, _result=name)
    if name:
        assert "did you mean 'tensor'" in str(info.value)
    with pytest.raises(ValueError, match=r"_result="):
        mod.b43_f(1.0, 2.0, _result=name)  # numbers only: the same refusal


def test_fwds_of_generic_at_a_vector_its_constraint_refuses(mod, device):
    x3 = pydiff.zeros((8,), dtype="float3", device=device)
    with pytest.raises(TypeError, match=r"'x'.*vector<float,3>|vector<float,3>.*'x'") as info:
        mod.b43_gen.fwds(x3.with_tangent(pydiff.ones_like(x3)))
    assert "b43_gen" in str(info.value)
    assert isinstance(info.value.__cause__, pydiff.SlangCompileError)
    # a constraint that takes vectors works, against the closed form
    v = np.arange(24, dtype=np.float32).reshape(8, 3) / 7
    xt = pydiff.zeros((8,), dtype="float3", device=device)
    xt.copy_from_numpy(v)
    y, t = mod.b43_genf.fwds(xt.with_tangent(pydiff.ones_like(xt)))
    _close([y.numpy(), t.numpy()], [v.astype(np.float64) ** 2, 2 * v.astype(np.float64)])
    # and the scalar specialisation of the strict one
    s = pydiff.tensor(v[:, 0].copy(), device=device).with_tangent(np.ones(8, np.float32))
    y, t = mod.b43_gen.fwds(s)
    _close([y.numpy(), t.numpy()], [v[:, 0].astype(np.float64) ** 2, 2 * v[:, 0]])


# ------------------------------------------------------------------------------------------
# adversarial cases the generated kernels pass (regression guards)


@pytest.mark.parametrize("n", [1, 5, 13])
@pytest.mark.parametrize("a_shape", [(), (1,)])
def test_broadcast_and_spare_lanes(mod, device, forced, n, a_shape):
    xs = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    x64 = xs.astype(np.float64)

    def run():
        x = pydiff.tensor(xs, device=device).with_grads(zero=True)
        a = pydiff.tensor(np.full(a_shape, 1.5, np.float32), device=device).with_grads()
        y = mod.b43_f(a, x, _result="tensor")
        mod.b43_f.bwds(a, x, _result=y.with_grads(ones=True))
        return [y.numpy(), x.grad.numpy(), a.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts.get("forward") == 1 and counts.get("backward") == 1
    _same(gen, ref)
    _close(gen, [_f(1.5, x64), _df(1.5, x64), np.full(a_shape, np.sum(x64 * x64))])


def test_same_tensor_at_both_parameters(mod, device, forced):
    xs = np.linspace(-2, 2, 13, dtype=np.float32)
    x64 = xs.astype(np.float64)

    def run():
        x = pydiff.tensor(xs, device=device).with_grads(zero=True)
        y = mod.b43_f(x, x)
        mod.b43_f.bwds(x, x, _result=y.with_grads(ones=True))
        y2, t = mod.b43_f.fwds(x.with_tangent(np.ones(13, np.float32)), x)
        return [y.numpy(), x.grad.numpy(), y2.numpy(), t.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts.get("backward") == 1 and counts.get("fwds") == 1
    _same(gen, ref)
    d = 3 * x64 * x64 + np.cos(x64)
    # (with_tangent sets x's tangent: both parameters carry it)
    _close(gen, [x64**3 + np.sin(x64), d, x64**3 + np.sin(x64), d])


def test_hand_written_derivatives_detach_loop_and_nan(mod, device, forced):
    xs = np.linspace(-3, 3, 37).astype(np.float32)
    xs[:5] = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    ns = (np.arange(37) % 9).astype(np.float32)
    x64 = xs.astype(np.float64)

    def run():
        out = []
        x = pydiff.tensor(xs, device=device).with_grads(zero=True)
        a = pydiff.tensor(np.full(37, 1.5, np.float32), device=device).with_grads(zero=True)
        for fn in (mod.b43_cb, mod.b43_det):
            x.grad.fill(0.0)
            a.grad.fill(0.0)
            y = fn(a, x)
            fn.bwds(a, x, _result=y.with_grads(ones=True))
            out += [y.numpy(), a.grad.numpy(), x.grad.numpy()]
        y, t = mod.b43_cf.fwds(x.with_tangent(np.ones(37, np.float32)))
        out += [y.numpy(), t.numpy()]
        x.grad.fill(0.0)
        n = pydiff.tensor(ns, device=device)
        y = mod.b43_loop(x, n)
        mod.b43_loop.bwds(x, n, _result=y.with_grads(ones=True))
        out += [y.numpy(), x.grad.numpy()]
        x.grad.fill(0.0)
        y = mod.b43_leaky(x)
        mod.b43_leaky.bwds(x, _result=y.with_grads(ones=True))
        return out + [y.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts.get("backward") == 4 and counts.get("fwds") == 1
    _same(gen, ref)
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(x64)
        one = np.ones(37)
        want = [
            1.5 * x64 * x64, 3 * one, 7 * one,  # the hand-written backward, not the math
            1.5 * x64 * x64, x64 * x64, 1.5 * x64,  # detach: d/dx = a * x only
            x64 * x64, 5 * one,  # the hand-written forward derivative
            0.5 * ns * x64 * x64, ns * x64,
            np.where(x64 > 0, x64, 0.1 * x64), np.where(x64 > 0, 1.0, 0.1),
        ]  # fmt: skip
        for g, w in zip(gen, want):
            np.testing.assert_allclose(
                np.asarray(g, np.float64)[ok],
                np.broadcast_to(w, ok.shape)[ok],
                rtol=1e-5,
                atol=1e-5,
            )
    assert np.isnan(gen[0][0]) and np.isnan(gen[10][0])  # NaN in, NaN out on both paths


def test_vector_kernels_aliasing_and_fwds(mod, device, forced):
    rng = np.random.default_rng(3)
    n = 37
    v = rng.standard_normal((n, 3)).astype(np.float32)
    w = rng.standard_normal((n, 3)).astype(np.float32)
    v64, w64 = v.astype(np.float64), w.astype(np.float64)

    def run():
        nt = pydiff.tensor(v, device=device).with_grads(zero=True)
        y = mod.b43_shade(nt, nt, 2.0)  # the same tensor at n and l
        mod.b43_shade.bwds(nt, nt, 2.0, _result=y.with_grads(ones=True))
        lt = pydiff.tensor(w, device=device)
        y2, t = mod.b43_shade.fwds(nt.with_tangent(np.ones((n, 3), np.float32)), lt, 2.0)
        return [
            y.numpy().reshape(n, 3),
            nt.grad.numpy(),
            y2.numpy().reshape(n, 3),
            t.numpy().reshape(n, 3),
        ]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts.get("backward: vector") == 1 and counts.get("fwds: vector") == 1
    _same(gen, ref)
    s, nn = v64.sum(-1, keepdims=True), np.sum(v64 * v64, -1, keepdims=True)
    d = np.sum(v64 * w64, -1, keepdims=True)
    tan = 2 * (d + v64 * w64.sum(-1, keepdims=True))
    _close(gen, [2 * v64 * nn, 2 * (nn + 2 * v64 * s), 2 * v64 * d, tan], tol=1e-3)


@pytest.mark.parametrize("offset,stride", [(1, 1), (3, 2)])
def test_grid_kernels_on_offset_and_strided_views(mod, device, forced, offset, stride):
    n = 4100  # a grid of 4096 or more takes the generated grid kernels
    big = np.random.default_rng(4).standard_normal(2 * n + 10).astype(np.float32)
    sel = big[offset : offset + n * stride : stride].astype(np.float64)

    def run():
        x = _view(pydiff.tensor(big, device=device), (n,), (stride,), offset, device)
        x = x.with_grads(zero=True)
        out = pydiff.zeros((2 * n + 10,), device=device)
        r = _view(out, (n,), (stride,), offset, device).with_grads(ones=True)
        mod.b43_grid(spy.grid((n,)), 1.5, x, r)
        mod.b43_grid.bwds(spy.grid((n,)), 1.5, x, r)
        return [out.numpy(), x.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    if device.type == "vulkan":
        assert counts.get("forward: grid") == 1 and counts.get("backward: grid") == 1
    _same(gen, ref)
    want = np.zeros(2 * n + 10)
    want[offset : offset + n * stride : stride] = _f(1.5, sel)
    _close(gen, [want, _df(1.5, sel)])


def test_views_are_declined_not_misread(mod, device, forced):
    big = np.random.default_rng(5).standard_normal(40).astype(np.float32)
    for offset, stride in [(1, 1), (4, 1), (0, 2)]:
        sel = big[offset : offset + 16 * stride : stride].astype(np.float64)

        def run():
            x = _view(pydiff.tensor(big, device=device), (16,), (stride,), offset, device)
            x = x.with_grads(zero=True)
            y = mod.b43_f(1.5, x)
            mod.b43_f.bwds(1.5, x, _result=y.with_grads(ones=True))
            yv, tv = mod.b43_f.fwds(1.5, x.with_tangent(np.ones(16, np.float32)))
            return [y.numpy(), x.grad.numpy(), yv.numpy(), tv.numpy()]

        gen, ref, _ = run_both_paths(forced, run)
        _same(gen, ref)
        _close(gen, [_f(1.5, sel), _df(1.5, sel), _f(1.5, sel), _df(1.5, sel)])


def test_tape_chain_twice_and_policies(mod, device, forced):
    xs = np.linspace(-1, 1, 21, dtype=np.float32)
    x64 = xs.astype(np.float64)

    def run():
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        a = pydiff.tensor(np.float32([1.5]), device=device, requires_grad=True)
        with pydiff.Tape() as tape:
            y = mod.b43_f(a, x)
            z = mod.b43_f(y, y)
            w = mod.b43_cb(a, z)
        tape.backward(w, grad=np.ones(21))
        out = [w.numpy(), x.grad.numpy().copy(), a.grad.numpy().copy()]
        tape.backward(w, grad=np.ones(21))  # ACCUMULATE: twice the gradients
        out += [x.grad.numpy().copy(), a.grad.numpy().copy()]
        with pydiff.zero_policy("reset"):
            tape.backward(w, grad=np.ones(21))
        return out + [x.grad.numpy(), a.grad.numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    assert counts.get("backward: in tape.backward", 0) >= 6
    _same(gen, ref)
    y = _f(1.5, x64)
    z = y**3 + np.sin(y)
    gx = 7 * (3 * y * y + np.cos(y)) * _df(1.5, x64)
    ga = 3 * 21 + np.sum(7 * (3 * y * y + np.cos(y)) * x64 * x64)
    _close(gen, [1.5 * z * z, gx, [ga], 2 * gx, [2 * ga], gx, [ga]], tol=1e-3)


def test_small_calls_switching_to_planned_kernels_keep_values(mod, device):
    """Plans take the generated kernel after 1000 calls of a layout: the values around the
    switch, with offset views (declined per call) mixed in, match the closed form."""
    big = np.random.default_rng(6).standard_normal(32).astype(np.float32)
    base = pydiff.tensor(big, device=device)
    out = pydiff.zeros((16,), device=device)
    generated.reset_stats()
    for i in range(1100):
        off = i % 5
        if i % 3 == 0:
            x = _view(base, (16,), (1,), off, device)
        else:
            x = pydiff.tensor(big[off : off + 16], device=device)
        a = float(i % 4)
        mod.b43_f(a, x, _result=out)
        if i % 97 == 0 or 995 <= i <= 1005:
            _close([out.numpy()], [_f(a, big[off : off + 16].astype(np.float64))], tol=1e-5)


def test_threads_calling_one_function(mod, device):
    errors: list = []

    def worker(tid: int, n: int) -> None:
        xs = np.random.default_rng(tid).standard_normal(n).astype(np.float32)
        x = pydiff.tensor(xs, device=device).with_grads(zero=True)
        for i in range(60):
            a = float(tid + i % 3)
            y = mod.b43_f(a, x)
            x.grad.fill(0.0)
            mod.b43_f.bwds(a, x, _result=y.with_grads(ones=True))
            if i % 20 == 0:
                x64 = xs.astype(np.float64)
                if not np.allclose(y.numpy(), _f(a, x64), atol=1e-4):
                    errors.append((tid, i, "value"))
                if not np.allclose(x.grad.numpy(), _df(a, x64), atol=1e-4):
                    errors.append((tid, i, "gradient"))

    threads = [threading.Thread(target=worker, args=(t, 16 if t % 2 else 5000)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_write_through_strided_view_counts_as_overwriting_the_base(device):
    """The strided write goes through the base's storage: a tape that read the base refuses
    its backward (the values it read are gone), as for any other write."""
    x = pydiff.tensor(np.linspace(-1, 1, 16, dtype=np.float32), device=device)
    x.requires_grad_()
    m = pydiff.load_module_from_source("s43_breaker43_sq", SQUARE, device=device)
    with pydiff.Tape() as tape:
        y = m.b43_sq(x)
    _view(x, (8,), (2,), 0, device).fill(0.0)
    with pytest.raises(pydiff.StaleInputError, match="overwritten"):
        tape.backward(y, grad=np.ones(16))


SQUARE = "[Differentiable] float b43_sq(float x) { return x * x; }"
NAMES = """
[Differentiable] float b43_n(float x) { return x * 2.0; }
namespace ns { [Differentiable] float b43_n(float x) { return x * 3.0; } }
struct S { [Differentiable] static float b43_n(float x) { return x * 4.0; } };
"""
OTHER = "[Differentiable] float b43_n(float x) { return x * 5.0; }"


def test_same_name_in_namespaces_structs_and_modules(device, forced):
    """Each generated kernel calls the function it was made for: a global, a namespaced and
    a struct's static function of one name, and one of another module, each its own."""
    xs = np.linspace(-1, 1, 11, dtype=np.float32)
    one = pydiff.load_module_from_source("s43_breaker43_names", NAMES, device=device)
    two = pydiff.load_module_from_source("s43_breaker43_other", OTHER, device=device)
    cases = [(one.b43_n, 2), (getattr(one, "ns::b43_n"), 3), (getattr(one, "S::b43_n"), 4)]
    for fn, k in cases + [(two.b43_n, 5), (one.b43_n, 2)]:

        def run():
            x = pydiff.tensor(xs, device=device).with_grads(zero=True)
            y = fn(x)
            fn.bwds(x, _result=y.with_grads(ones=True))
            _, t = fn.fwds(x.with_tangent(np.ones(11, np.float32)))
            return [y.numpy(), x.grad.numpy(), t.numpy()]

        gen, ref, counts = run_both_paths(forced, run)
        assert counts.get("forward") == 1 and counts.get("fwds") == 1, fn
        _same(gen, ref)
        _close(gen, [k * xs.astype(np.float64), np.full(11, k), np.full(11, k)])


def test_edited_file_runs_its_new_kernel(device, forced, tmp_path):
    path = tmp_path / "b43_edit.slang"
    xs = np.linspace(-1, 1, 9, dtype=np.float32)
    path.write_text("[Differentiable] float b43_e(float x) { return x * 2.0; }\n")
    first = pydiff.load_module(path, device=device)
    x = pydiff.tensor(xs, device=device).with_grads(zero=True)
    _close([first.b43_e(x).numpy()], [2 * xs.astype(np.float64)])
    path.write_text("[Differentiable] float b43_e(float x) { return x * 7.0; }\n")
    second = pydiff.load_module(path, device=device)
    y = second.b43_e(x)
    second.b43_e.bwds(x, _result=y.with_grads(ones=True))
    _close([y.numpy(), x.grad.numpy()], [7 * xs.astype(np.float64), np.full(9, 7.0)])
    _close([first.b43_e(x).numpy()], [2 * xs.astype(np.float64)])  # the first keeps its own
    assert generated.stats().get("forward", 0) >= 3


@pytest.mark.parametrize(
    "value", [[0.0] * 8, (0.0,), True, b"tensor", 1.5j, pydiff.Tensor], ids=repr
)
def test_result_values_nothing_writes_into(mod, device, value):
    """Before: SlangPy's internal errors ("Cannot read back value for non-writable type",
    "Exception in kernel generation: Unsupported type", BoundVariableException)."""
    x = pydiff.tensor(np.ones(8, np.float32), device=device).with_grads(zero=True)
    with pytest.raises(TypeError, match=r"b43_f: _result=.*(nothing a call writes|a number)"):
        mod.b43_f(1.0, x, _result=value)
    if not isinstance(value, (bytes, complex)) and value is not pydiff.Tensor:
        with pytest.raises(TypeError, match=r"b43_f.bwds: _result must be a pydiff.Tensor"):
            mod.b43_f.bwds(1.0, x, _result=value)  # .bwds names the upstream it wants
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(8))
    out = mod.b43_f(1.0, x, _result=np.ndarray)  # SlangPy's return types stay taken
    np.testing.assert_allclose(out, np.full(8, 1.0 + np.sin(1.0)), rtol=1e-6)


def test_strided_write_after_pending_generated_work(mod, device, forced):
    """A strided write lands after the generated kernels queued before it, and before the
    ones queued after it."""
    xs = np.linspace(-1, 1, 64, dtype=np.float32)
    x, out = pydiff.tensor(xs, device=device), pydiff.zeros((64,), device=device)
    for i in range(3):
        mod.b43_f(1.5, x, _result=out)
        _view(out, (32,), (2,), 1, device).fill(float(i))
        z = mod.b43_f(1.0, out)
        want = _f(1.5, xs.astype(np.float64))
        want[1::2] = i
        _close([out.numpy(), z.numpy()], [want, _f(1.0, want)])


NAMES_CLASH = """
[Differentiable] float b43_t(float x, float x__t) { return x * 2.0 + x__t * 3.0; }
[Differentiable] float b43_p(float x, inout float x__p)
{ float r = x * x__p; x__p = x__p * 2.0; return r; }
[Differentiable] float b43_pi(inout float x, float x__p, float x__t)
{ float r = x * x__p + x__t; x = x * x__t; return r; }
[Differentiable] float b43_v(float x, float x__v) { return x * x * x__v; }
[Differentiable] float b43_in(float o__in, inout float o)
{ float r = o * o__in; o = o * 2.0; return r; }
"""


def test_parameters_named_like_pydiffs_wrapper_names(device, forced):
    """Before: raw SlangCompileErrors ("conflicting declaration") of pydiff's generated
    wrappers for .fwds (x beside x__t; inout x beside x__p) and hvp (x beside x__v)."""
    m = pydiff.load_module_from_source("s43_breaker43_clash", NAMES_CLASH, device=device)
    xs = np.linspace(0.5, 2, 6, dtype=np.float32)
    x64 = xs.astype(np.float64)
    one, ones = np.ones(6, np.float32), np.ones(6)
    x = pydiff.tensor(xs, device=device).with_tangent(one)
    t = pydiff.tensor(one, device=device).with_tangent(2 * one)
    y, dy = m.b43_t.fwds(x, t)
    _close([y.numpy(), dy.numpy()], [2 * x64 + 3, 8 * ones])
    for gen in ("1", "0"):  # (the vector of 6 also leaves the SlangPy wrapper to run)
        forced.setenv("PYDIFF_GENERATED", gen)
        p = pydiff.tensor(2 * one, device=device).with_tangent(np.zeros(6, np.float32))
        y, dy = m.b43_p.fwds(pydiff.tensor(xs, device=device).with_tangent(one), p)
        _close(
            [y.numpy(), dy.numpy(), p.numpy(), p.tangent.numpy()],
            [2 * x64, 2 * ones, 4 * ones, 0 * ones],
        )
        xi = pydiff.tensor(xs, device=device).with_tangent(one)
        y, dy = m.b43_pi.fwds(xi, (3.0, 0.0), (2.0, 1.0))  # r = 3x + t, x <- x t
        _close(
            [y.numpy(), dy.numpy(), xi.numpy(), xi.tangent.numpy()],
            [3 * x64 + 2, 4 * ones, 2 * x64, 2 + x64],
        )
    forced.setenv("PYDIFF_GENERATED", "1")
    hv = pydiff.hvp(m.b43_v, (pydiff.tensor(xs, device=device), 2.0), (one, 0.0))
    _close([hv[0].numpy(), hv[1]], [4 * ones, np.sum(2 * x64)])  # (2 x__v, sum of 2x)
    o = pydiff.tensor(3 * one, device=device).with_grads(
        grad_in=pydiff.tensor(one, device=device), grad_out=pydiff.zeros((6,), device=device)
    )
    a = pydiff.tensor(xs, device=device).with_grads(zero=True)
    with pytest.raises(
        ValueError, match=r"'o__in' has the name pydiff gives .* inout parameter 'o'"
    ):
        m.b43_in.bwds(a, o, _result=pydiff.zeros((6,), device=device).with_grads(ones=True))


MASKS = """
import slangpy;
[Differentiable]
void b43_w3(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> a,
            IWDiffTensor<float, 1> b, IWDiffTensor<float, 1> a_b)
{ float v = x[idx]; a[idx] = v * 2.0; b[idx] = v * 3.0; a_b[idx] = v * 5.0; }
[Differentiable] float b43_sq(float x) { return x * x; }
[Differentiable] float b43_add3(float a, float b, float c) { return a + b + c; }
"""


def test_masked_wrappers_of_parameter_sets_that_join_alike(device):
    """The tape's backward records which elements a call wrote into tensors whose earlier
    value it needs, through a wrapper per set of such parameters: {'a_b'} and {'a', 'b'}
    were one wrapper name, and the second call got the first's (SlangPy refused the call)."""
    m = pydiff.load_module_from_source("s43_breaker43_masks", MASKS, device=device)
    n = 8
    ps = np.arange(1, n + 1, dtype=np.float32)
    p = pydiff.tensor(ps, device=device, requires_grad=True)
    x0 = pydiff.tensor(np.arange(10, 10 + n, dtype=np.float32), device=device)
    x0.requires_grad_()
    with pydiff.Tape() as tape:
        a, b, ab = m.b43_sq(p), m.b43_sq(p), m.b43_sq(p)
        fresh = [pydiff.empty((n,), device=device) for _ in range(3)]
        m.b43_w3(spy.grid((n,)), x0, fresh[0], fresh[1], ab)  # ab's old value: masked
        m.b43_w3(spy.grid((n,)), x0, a, b, fresh[2])  # a's and b's: masked
        out = m.b43_add3(a, b, ab)
    tape.backward(out, grad=np.ones(n))
    # a, b and ab were all overwritten before out read them: nothing reaches p
    np.testing.assert_array_equal(p.grad.numpy(), np.zeros(n))
    np.testing.assert_array_equal(x0.grad.numpy(), np.full(n, 2.0 + 3.0 + 5.0))
    np.testing.assert_array_equal(out.numpy(), 10 * x0.numpy())


@pytest.mark.parametrize("n", [16, 4100])
def test_result_shifted_over_its_input_is_refused(mod, device, forced, n):
    """``_result`` one element after the input on one buffer: thread i stores where thread
    i + 1 loads (a race; before: accepted on both paths, values by the device's order). The
    same view (each element read and written by one thread) and disjoint views still run."""
    xs = np.linspace(-1, 1, 2 * n + 2, dtype=np.float32)
    base = pydiff.tensor(xs, device=device)
    x = _view(base, (n,), (1,), 0, device)
    with pytest.raises(ValueError, match=r"_result and parameter 'x' are views of one storage"):
        mod.b43_f(1.5, x, _result=_view(base, (n,), (1,), 1, device))
    np.testing.assert_array_equal(base.numpy(), xs)  # nothing ran
    with pytest.raises(ValueError, match=r"_result and parameter 'x'"):
        mod.b43_f(1.5, x, _result=_view(base, (n,), (2,), 0, device))  # strided over x
    mod.b43_f(1.5, x, _result=_view(base, (n,), (1,), n + 2, device))  # disjoint: runs
    mod.b43_f(1.5, x, _result=x)  # the same view: in place, runs
    want = xs.astype(np.float64)
    want[n + 2 :] = _f(1.5, want[:n])
    want[:n] = _f(1.5, want[:n])
    _close([base.numpy()], [want])


UNDERSCORED = """
[Differentiable] float b43_u(float __p, float __r) { return __p * __r; }
[Differentiable] float b43_ui(float __r, inout float o)
{ float y = o * __r; o = o * 2.0; return y; }
"""


def test_parameters_named_like_the_wrappers_locals(device):
    """``__p``, ``__r`` were names of the .fwds wrapper's outputs and locals (and ``__r`` of
    the inout wrapper's): "conflicting declaration" in the generated wrapper before."""
    m = pydiff.load_module_from_source("s43_breaker43_under", UNDERSCORED, device=device)
    x = pydiff.tensor(np.full(4, 2.0, np.float32), device=device).with_tangent(np.ones(4))
    y, t = m.b43_u.fwds(x, 3.0)
    _close([y.numpy(), t.numpy()], [np.full(4, 6.0), np.full(4, 3.0)])
    assert m.b43_u.fwds((2.0, 1.0), 3.0) == (6.0, 3.0)
    r = pydiff.tensor(np.full(4, 2.0, np.float32), device=device).with_grads(zero=True)
    o = pydiff.tensor(np.full(4, 3.0, np.float32), device=device)
    ones = pydiff.tensor(np.ones(4, np.float32), device=device)
    o = o.with_grads(grad_in=ones, grad_out=pydiff.zeros((4,), device=device))
    m.b43_ui.bwds(r, o, _result=pydiff.zeros((4,), device=device).with_grads(ones=True))
    # y = o r, o' = 2 o; upstream 1 for both: dr = o = 3, do = r + 2 = 4
    _close([r.grad.numpy(), o.grad_out.numpy()], [np.full(4, 3.0), np.full(4, 4.0)])
