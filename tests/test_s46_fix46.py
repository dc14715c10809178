"""Session 46 (fix46): eviction of kernels keeps the plans of the others; races of grid
calls reading neighbours of a tensor they write; captured inputs re-bound while a retained
tape keeps the old ones; forward-mode tangents of Python-number primals. References: float64
NumPy, closed forms and central differences, never pydiff's own output."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pydiff
import slangpy as spy

from pydiff import generated
from pydiff import kernels as kernels_module
from pydiff import ops


def _matmul_checked(device, m, k, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = ops.matmul(pydiff.tensor(a, device=device), pydiff.tensor(b, device=device)).numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def _plans_of(device, n):
    """The product plans of (40, 12, n) products (their kernel's N define is n)."""
    return {
        key: plan
        for key, plan in device.kernels.plans.items()
        if plan and key[:5] == ("product", "mm_nn", 40, n, 12)
    }


def test_eviction_drops_only_the_evicted_kernels_plans(device, monkeypatch):
    monkeypatch.setattr(kernels_module, "KERNELS_MAX", 3)
    kernels = device.kernels
    kernels.plans.clear()
    built: list = []
    real = kernels._build  # noqa: SLF001 (counting the cache's own builds)

    def build(file, entry, defines):
        built.append(defines.get("N"))
        return real(file, entry, defines)

    monkeypatch.setattr(kernels, "_build", build)
    _matmul_checked(device, 40, 12, 4, 0)
    first = _plans_of(device, 4)
    assert first
    for seed, n in enumerate((8, 12)):  # two more kernels: the cache is full, none evicted
        _matmul_checked(device, 40, 12, n, 1 + seed)
    _matmul_checked(device, 40, 12, 4, 3)  # the first one used again: the most recent
    kept = _plans_of(device, 4)
    assert kept == first and all(kept[k] is first[k] for k in kept)
    before = len(built)
    _matmul_checked(device, 40, 12, 16, 4)  # a new kernel evicts N=8's (the oldest), only it
    assert len(built) == before + 1
    survivors = _plans_of(device, 4)
    assert survivors and all(survivors[k] is first[k] for k in survivors)  # (not planned again)
    assert _plans_of(device, 12) and not _plans_of(device, 8)
    held = {plan[0] for plan in kernels.plans.values() if plan}
    assert held <= set(kernels._kernels)  # noqa: SLF001 (no plan outlives its kernel)
    _matmul_checked(device, 40, 12, 8, 5)  # planned and built again, still right
    assert built[-1] == 8 and _plans_of(device, 8)
    _matmul_checked(device, 40, 12, 4, 6)
    assert kernels.sizes()["kernels"] <= 3


# ---------------------------------------------------------------- captured inputs re-bound


def _sgd_reference(w0, b0, xs, ys, lr):
    """float64 SGD steps of mean cross-entropy(x @ w.T + b, y) over the batches (closed-form
    gradient: (softmax - one-hot) / B)."""
    w, b = w0.astype(np.float64), b0.astype(np.float64)
    for x, y in zip(xs, ys):
        z = x.astype(np.float64) @ w.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        dz = p / len(y)
        w, b = w - lr * dz.T @ x.astype(np.float64), b - lr * dz.sum(axis=0)
    return w, b


@pytest.mark.parametrize("retain", [True, False])
def test_replay_refuses_a_rebound_input_while_the_retained_tape_keeps_the_old(device, retain):
    """``tape.backward(loss, retain_graph=True)`` (the default) inside a captured step keeps
    the tape, and so the old input tensor, alive through the loss the step returns: the
    replay's check of dropped inputs used to pass, and the replay trained on the captured
    batch without a word. Refused now; copying into the captured tensor stays right."""
    rng = np.random.default_rng(7)
    layer = pydiff.nn.Linear(8, 4, seed=3, device=device)
    w0, b0 = layer.weight.numpy(), layer.bias.numpy()
    opt = pydiff.optim.SGD([layer.weight, layer.bias], lr=0.5)
    state: dict = {}
    xs: list = []
    ys: list = []

    def new_batch():
        x = rng.standard_normal((16, 8)).astype(np.float32)
        y = rng.integers(0, 4, 16).astype(np.int32)
        state["x"], state["y"] = pydiff.tensor(x, device=device), pydiff.tensor(y, device=device)
        return x, y

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layer(state["x"]), state["y"])
        tape.backward(loss, retain_graph=retain)
        opt.step()
        return loss

    def check():
        w, b = _sgd_reference(w0, b0, xs, ys, 0.5)
        np.testing.assert_allclose(layer.weight.numpy(), w, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(layer.bias.numpy(), b, rtol=1e-4, atol=1e-5)

    for k in range(2):  # eager, then the capture (each on its batch)
        x, y = new_batch()
        xs.append(x), ys.append(y)
        step() if k == 0 else (captured := pydiff.capture(step))
    check()
    x, y = new_batch()  # the names re-bound: a replay would read the captured batch
    gc.collect()
    with pytest.raises(pydiff.CaptureError, match="dropped|re-bound"):
        captured.replay()
    check()  # refused before anything ran
    captured = pydiff.capture(step)  # capturing again works
    xs.append(x), ys.append(y)
    check()
    x = rng.standard_normal((16, 8)).astype(np.float32)  # the supported way: copied in
    y = rng.integers(0, 4, 16).astype(np.int32)
    state["x"].copy_from_numpy(x)
    state["y"].copy_from_numpy(y)
    captured.replay()
    xs.append(x), ys.append(y)
    check()


# ---------------------------------------------------------------- forward mode: number primals

FWD_SRC = """
import slangpy;
[Differentiable] float f(float a, float x) { return a * x * x + sin(a * x); }
"""


def _f(a, x):
    return a * x * x + np.sin(a * x)


@pytest.fixture
def fwd_module(device):
    return pydiff.load_module_from_source("s46_fwd", FWD_SRC, device=device)


def test_number_primal_takes_one_direction_whatever_the_tangents_type(device, fwd_module):
    """The directional derivative of f(a, x) along a number a is (df/da) * da with one da:
    the tangent lives in a's space, shape (). A (5,) tangent (one direction per call
    element) is the derivative of another function (a copied per element): NumPy arrays
    were refused, pydiff tensors of that shape broadcast; both refused now, naming 'a'."""
    xs = np.linspace(-1.5, 2.0, 5).astype(np.float32)
    x = pydiff.tensor(xs, device=device)
    a0, da, eps = 1.3, 0.7, 1e-6
    x64 = xs.astype(np.float64)
    want = da * (_f(a0 + eps, x64) - _f(a0 - eps, x64)) / (2 * eps)  # central differences
    for tangent in (da, np.float32(da), pydiff.tensor(np.float32(da), device=device)):
        y, dy = fwd_module.f.fwds((a0, tangent), x)
        np.testing.assert_allclose(y.numpy(), _f(a0, x64), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dy.numpy(), want, rtol=1e-4, atol=1e-5)
    for tangent in (np.full(5, da, np.float32), pydiff.tensor(np.full(5, da, np.float32))):
        with pytest.raises(ValueError, match=r"parameter 'a'.*tangent has shape \(5,\).*\(\)"):
            fwd_module.f.fwds((a0, tangent), x)
    # one direction per element: a tensor as the value, its tangent of its shape
    dirs = np.linspace(0.5, -0.5, 5)
    a = pydiff.tensor(np.full(5, a0, np.float32), device=device)
    _, dy = fwd_module.f.fwds((a, pydiff.tensor(dirs.astype(np.float32), device=device)), x)
    want = dirs * (_f(a0 + eps, x64) - _f(a0 - eps, x64)) / (2 * eps)
    np.testing.assert_allclose(dy.numpy(), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- grid calls reading neighbours

GRID_SRC = """
import slangpy;
[Differentiable]
void nxt(int2 px, IRWDiffTensor<float, 2> x)
{
    int j = px.x;
    int i = px.y;
    float a = x[i, j];
    float b = x[i, min(j + 1, 7)];
    x[i, j] = a * b;
}
void nxt_plain(int2 px, RWTensor<float, 2> x)
{
    x[px.y, px.x] = x[px.y, px.x] * x[px.y, clamp(px.x + 1, 0, 7)];
}
void prev_1d(int i, RWTensor<float, 1> x) { x[i] = x[i] + x[max(i - 1, 0)]; }
[Differentiable]
void blur(int2 px, IDiffTensor<float, 2> s, IWDiffTensor<float, 2> d)
{
    int j = px.x;
    int i = px.y;
    d[i, j] = s[i, j] * s[i, min(j + 1, 7)];
}
[Differentiable]
void pairs(int2 px, IRWDiffTensor<float, 2> x)
{
    int i = px.y;
    int j = 2 * px.x;
    float a = x[i, j + 1];
    x[i, j] = x[i, j] * a;
}
[Differentiable]
void sq_own(int2 px, IRWDiffTensor<float, 2> x)
{
    float v = x[px.y, px.x];
    x[px.y, px.x] = v * v;
}
void put(int2 px, IWTensor<float, 2> y) { y[px.y, px.x] = float(px.y * 10 + px.x); }
void halves(int2 px, RWTensor<float, 2> x) { x[px.y, px.x / 2] = 2.0 * x[px.y, px.x / 2]; }
float at(RWTensor<float, 2> t, int i, int j) { return t[i, j]; }
void through_helper(int2 px, RWTensor<float, 2> x)
{
    x[px.y, px.x] = at(x, px.y, px.x + 1);
}
"""


@pytest.fixture
def grid_module(device):
    return pydiff.load_module_from_source("s46_grid", GRID_SRC, device=device)


def _next_product(x):
    """float64: y[i, j] = x[i, j] * x[i, min(j + 1, 7)], every x read before the call."""
    return x * np.concatenate([x[:, 1:], x[:, -1:]], axis=1)


@pytest.fixture(params=["generated", "slangpy"])
def path(request, forced):
    """Both paths: pydiff's generated grid kernels (every covered call) and SlangPy's."""
    forced.setenv("PYDIFF_GENERATED", "1" if request.param == "generated" else "0")
    return request.param


@pytest.mark.parametrize("name", ["nxt", "nxt_plain"])
def test_in_place_grid_call_reading_a_neighbour_is_refused(device, grid_module, path, name):
    """x[i, j] stored while the thread of (i, j - 1) loads it: a race (lavapipe happened to
    give the values before the call, a GPU need not). Refused before anything ran, naming
    the parameter and two threads that race; with requires_grad, on a tape too."""
    x0 = np.random.default_rng(1).uniform(0.5, 2.0, (4, 8)).astype(np.float32)
    for grad in (False, True):
        x = pydiff.tensor(x0, device=device, requires_grad=grad and name == "nxt")
        with pytest.raises(ValueError, match=r"parameter 'x'.*\(0, 0\) loads its element \(0, 1\)"):
            getattr(grid_module, name)(spy.grid((4, 8)), x)
        np.testing.assert_array_equal(x.numpy(), x0)
        if x.requires_grad:
            with pydiff.Tape(), pytest.raises(ValueError, match="a race"):
                grid_module.nxt(spy.grid((4, 8)), x)
    x = pydiff.tensor(np.arange(6, dtype=np.float32), device=device)
    with pytest.raises(ValueError, match=r"thread \(1,\) loads its element \(0,\)"):
        grid_module.prev_1d(spy.grid((6,)), x)


def test_the_same_tensor_as_input_and_output_reads_the_values_before(device, grid_module, path):
    """The tensor passed as both the read and the written parameter: the read is given a copy
    taken before the call, so the values are the non-aliased ones (float64 reference),
    across workgroups too (rows of 8, 4096 rows)."""
    for rows in (4, 4096):
        x0 = np.random.default_rng(rows).uniform(0.5, 2.0, (rows, 8)).astype(np.float32)
        x = pydiff.tensor(x0, device=device)
        grid_module.blur(spy.grid((rows, 8)), x, x)
        np.testing.assert_allclose(x.numpy(), _next_product(x0.astype(np.float64)), rtol=1e-6)
    if path == "generated":  # (pydiff's generated grid kernel ran them)
        assert generated.stats().get("forward: grid", 0) == 2


def test_race_free_grid_calls_run_and_are_right(device, grid_module, path):
    """Loads of elements no other thread stores (each thread's own, or a neighbour nobody
    writes) are kept: forward and .bwds against float64 NumPy and central differences."""
    rng = np.random.default_rng(5)
    x0 = rng.uniform(0.5, 2.0, (3, 8)).astype(np.float32)
    x = pydiff.tensor(x0, device=device)
    grid_module.pairs(spy.grid((3, 4)), x)  # stores even columns, loads the odd ones
    want = x0.astype(np.float64).copy()
    want[:, 0::2] = want[:, 0::2] * want[:, 1::2]
    np.testing.assert_allclose(x.numpy(), want, rtol=1e-6)
    x = pydiff.tensor(x0, device=device, requires_grad=True)
    up = rng.uniform(-1, 1, (3, 8))
    with pydiff.Tape() as tape:
        grid_module.sq_own(spy.grid((3, 8)), x)
    np.testing.assert_allclose(x.numpy(), x0.astype(np.float64) ** 2, rtol=1e-6)
    tape.backward(x, grad=up.astype(np.float32))
    np.testing.assert_allclose(x.grad.numpy(), 2 * x0 * up, rtol=1e-5)
    if path == "generated":  # (pairs: the one off a tape)
        assert generated.stats().get("forward: grid", 0) == 1


def test_explicit_bwds_of_a_neighbour_reading_function_is_right(device, grid_module, path):
    """``.bwds`` reads the primal values and adds gradients into a buffer of their own (the
    upstream read from another): no race, the gradient of the non-aliased function, which
    central differences give, and x left unchanged."""
    rng = np.random.default_rng(9)
    x0 = rng.uniform(0.5, 2.0, (4, 8))
    up = rng.uniform(-1.0, 1.0, (4, 8))
    x = pydiff.tensor(x0.astype(np.float32), device=device, requires_grad=True)
    x.grad.copy_from_numpy(up.astype(np.float32))
    grid_module.nxt.bwds(spy.grid((4, 8)), x)
    eps, want = 1e-6, np.zeros_like(x0)
    for k in np.ndindex(x0.shape):
        e = np.zeros_like(x0)
        e[k] = eps
        want[k] = np.sum(up * (_next_product(x0 + e) - _next_product(x0 - e))) / (2 * eps)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(x.numpy(), x0, rtol=1e-7)


def test_stores_of_one_element_by_several_threads_and_unreadable_text_are_refused(
    device, grid_module, path
):
    x = pydiff.tensor(np.ones((2, 8), np.float32), device=device)
    with pytest.raises(ValueError, match=r"threads \(0, 0\) and \(0, 1\) both store"):
        grid_module.halves(spy.grid((2, 8)), x)
    with pytest.raises(ValueError, match="cannot tell which of its elements.*'x' is used other"):
        grid_module.through_helper(spy.grid((2, 8)), x)
    np.testing.assert_array_equal(x.numpy(), 1.0)


@pytest.mark.parametrize("name", ["sq_own", "put"])
def test_a_written_tensor_parameter_given_a_view_holding_elements_twice_is_refused(
    device, grid_module, path, name
):
    """Each thread stores its own element of the view, but a view with a stride of 0 holds
    one storage element at several: three threads store (and sq_own reads) it, whichever
    comes last kept (it ran: sq_own applied 2 -> 26, three times in turn, put kept the last
    row; NumPy's broadcast_to is read-only for the same reason)."""
    x = pydiff.tensor(np.full(4, 2.0, np.float32), device=device)
    repeated = pydiff.Tensor(x.native.view(shape=(3, 4), strides=(0, 1), offset=0), device)
    with pytest.raises(ValueError, match=r"holds elements more than once.*strides \(0, 1\)"):
        getattr(grid_module, name)(spy.grid((3, 4)), repeated)
    np.testing.assert_array_equal(x.numpy(), 2.0)
