"""fast_product's plans (which kernel a product takes, memoised per kernel cache): right
products when the kernels they hold are evicted, and a bounded memo."""

from __future__ import annotations

import numpy as np

import pydiff
from pydiff import kernels as kernels_module
from pydiff import ops, products


def _check_matmul(device, m, k, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = ops.matmul(pydiff.tensor(a, device=device), pydiff.tensor(b, device=device)).numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def test_evicting_kernels_empties_the_plans_and_products_stay_right(device, monkeypatch):
    monkeypatch.setattr(kernels_module, "KERNELS_MAX", 2)
    shapes = [(8, 16, 4), (16, 8, 8), (32, 4, 16), (8, 16, 4), (16, 8, 8)]
    for seed, shape in enumerate(shapes):
        _check_matmul(device, *shape, seed)
        held = {v[1] for v in device.kernels.plans.values() if v}
        # every kernel a plan holds is one the cache holds (none outlives its eviction)
        assert held <= set(device.kernels._kernels.values())  # noqa: SLF001 (the cache's own)
    assert device.kernels.sizes()["kernels"] <= 2


def test_the_plans_stay_bounded(device, monkeypatch):
    monkeypatch.setattr(products, "PLANS_MAX", 3)
    for seed, n in enumerate((4, 8, 12, 16, 20)):
        _check_matmul(device, 8, 8, n, seed)
        assert len(device.kernels.plans) <= 3


def test_a_product_used_through_its_plan_stays_among_the_recent_kernels(device, monkeypatch):
    """A plan's hit counts as a use of its kernel: new kernels evict others first (the hot
    product is built once, not again after every KERNELS_MAX new kernels)."""
    monkeypatch.setattr(kernels_module, "KERNELS_MAX", 3)
    built: list = []
    real = device.kernels._build  # noqa: SLF001 (counting the cache's own builds)

    def build(file, entry, defines):
        # (M and K are uniforms, or constants once a shape is hot: products.sizes_fixed)
        built.append((entry, defines.get("N"), "FIXED_M" in defines))
        return real(file, entry, defines)

    monkeypatch.setattr(device.kernels, "_build", build)
    # an empty cache, so that it fills before it evicts (a kernel a plan used without
    # counting the use would be the oldest then)
    device.kernels._kernels.clear()  # noqa: SLF001
    device.kernels.plans.clear()
    device.kernels.shape_uses.clear()
    device.kernels.fixed_shapes.clear()
    for seed, n in enumerate((4, 8, 12, 16, 20, 24)):
        _check_matmul(device, 24, 40, 36, 100 + seed)  # the hot product
        _check_matmul(device, 40, 12, n, seed)  # a new kernel each time (shapes no other test uses)
    hot = [b for b in built if b[1] == 36]
    assert sorted(hot) == [("mm_nn", 36, False), ("mm_nn", 36, True)], built  # each once


def test_a_hot_shape_takes_constant_sizes_and_stays_right(device, monkeypatch):
    """The first uses of a shape take the kernels with uniform sizes, later ones kernels of
    their own (products.sizes_fixed): each use is right (float64), for at most
    FIXED_SHAPES_MAX shapes; the others keep the uniform kernels, still right."""
    monkeypatch.setattr(products, "FIXED_SHAPES_MAX", 2)
    device.kernels.shape_uses.clear()
    device.kernels.fixed_shapes.clear()
    for shape in [(16, 12, 20), (32, 12, 8), (48, 4, 24)]:
        for use in range(products.HOT_SHAPE_USES + 2):
            _check_matmul(device, *shape, seed=use)
    fixed = {key[2:5] for key in device.kernels.fixed_shapes if key[0] == "product"}
    assert fixed == {(16, 20, 12), (32, 8, 12)}  # (m, n, k) of the first two; the third not


def test_a_captured_product_takes_constant_sizes_at_once(device):
    """A capture is replayed: its products take the kernels of their own from the first use
    (replays right against float64)."""
    device.kernels.shape_uses.clear()
    device.kernels.fixed_shapes.clear()
    rng = np.random.default_rng(5)
    a = pydiff.tensor(rng.standard_normal((24, 8)).astype(np.float32), device=device)
    b = pydiff.tensor(rng.standard_normal((8, 28)).astype(np.float32), device=device)
    out = {}

    def step():
        out["c"] = ops.matmul(a, b)

    captured = pydiff.capture(step)
    assert any(key[2:5] == (24, 28, 8) for key in device.kernels.fixed_shapes)
    for seed in range(3):
        new_a = np.random.default_rng(seed).standard_normal((24, 8)).astype(np.float32)
        a.copy_from_numpy(new_a)
        captured.replay()
        np.testing.assert_allclose(
            out["c"].numpy(), new_a.astype(np.float64) @ b.numpy(), rtol=1e-5, atol=1e-4
        )


def test_a_shape_turning_hot_keeps_its_results_bitwise(device):
    """The uniform-size and constant-size kernels are separate compiles of one arithmetic:
    a training loop whose shape turns hot mid-way gets the same bits before and after
    (determinism promises the same gradients run to run), forward and backward."""
    device.kernels.shape_uses.clear()
    device.kernels.fixed_shapes.clear()
    rng = np.random.default_rng(11)
    xa = rng.standard_normal((40, 24)).astype(np.float32)
    layer = pydiff.nn.Linear(24, 12, seed=4, activation="relu", device=device)
    runs = []
    for _ in range(products.HOT_SHAPE_USES + 2):
        x = pydiff.tensor(xa, device=device, requires_grad=True)
        layer.weight.grad.zero_()
        with pydiff.Tape() as tape:
            y = layer(x)
            loss = ops.sum(y * y)
        tape.backward(loss)
        runs.append((y.numpy(), x.grad.numpy(), layer.weight.grad.numpy()))
    assert any(key[0] == "product" for key in device.kernels.fixed_shapes)  # it did turn hot
    for later in runs[1:]:
        for got, first in zip(later, runs[0]):
            assert got.tobytes() == first.tobytes()
    w = layer.weight.numpy().astype(np.float64)
    want = np.maximum(xa.astype(np.float64) @ w.T + layer.bias.numpy(), 0.0)
    np.testing.assert_allclose(runs[0][0], want, rtol=1e-5, atol=1e-5)
