"""Memory stays flat in a long training loop (issue 15, class 18), and every per-device cache
is bounded: kernels, bound shader objects, the buffer pool, ``device.scratch`` and
``device.cached``.

The long loop runs in a subprocess (its resident set size is its own). Before the caches were
bounded, the loop below grew by about 90 MB per 1,000 steps (the bound shader objects of
temporaries that never came back); the bound here leaves room for allocator noise only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pydiff
from pydiff import bound_objects, buffer_pool, kernels

# Ops + tape + AdamW on tiny tensors; prints {"rss": [...MB after each chunk], "sizes": ...}.
LOOP = r"""
import gc, json, os, sys
import numpy as np
import pydiff
from pydiff import ops, optim

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

dev_type, warmup, steps, chunks = sys.argv[1], *map(int, sys.argv[2:5])
dev = pydiff.create_device(dev_type)
rng = np.random.default_rng(0)
l1 = pydiff.nn.Linear(8, 16, device=dev, seed=0, activation="relu")
l2 = pydiff.nn.Linear(16, 5, device=dev, seed=1)
g = pydiff.tensor(np.ones(5), device=dev, requires_grad=True)
opt = optim.AdamW(l1.parameters() + l2.parameters() + [g], lr=1e-3)
xs = rng.standard_normal((4, 8)).astype(np.float32)
ys = rng.standard_normal((4, 5)).astype(np.float32)
labels = np.array([0, 1, 2, 4])

def step():
    x = pydiff.tensor(xs, device=dev)
    y = pydiff.tensor(ys, device=dev)
    opt.zero_grad()
    with pydiff.Tape() as tape:
        out = ops.layer_norm(l2(l1(x)), g)
        loss = ops.add(ops.mse_loss(ops.tanh(out), y), ops.cross_entropy(out, labels))
    tape.backward(loss)
    opt.step()

for _ in range(warmup):
    step()
rss = []
for _ in range(chunks):
    gc.collect()
    rss.append(rss_mb())
    for _ in range(steps // chunks):
        step()
gc.collect()
rss.append(rss_mb())
sizes = dict(dev.kernels.sizes(), pool=dev.pool.sizes()["bytes"], scratch=len(dev.scratch))
print(json.dumps({"rss": rss, "sizes": sizes}))
"""


def run_loop(device_type: str, warmup: int, steps: int, chunks: int = 4) -> dict:
    """Run LOOP in a fresh interpreter; its JSON report."""
    out = subprocess.run(
        [sys.executable, "-c", LOOP, device_type, str(warmup), str(steps), str(chunks)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_training_loop_memory_is_flat(device):
    # 1,000 steps after a warm-up of 1050, in four chunks: the unbounded caches grew by
    # ~90 MB here. The first chunk may still fill the shader-object cache (~3 MB); the
    # other three (750 steps) must be flat: within 6 MB (malloc's arenas move by ~3 MB from run
    # to run on a loaded machine; the leak this guards against is ~65 MB over 750 steps).
    # (the warm-up goes past 1000 steps: a call plan takes pydiff's generated kernel on
    # lavapipe from its 1000th run on, built once, ~12 MB; tape calls take plans)
    report = run_loop(device.type, warmup=1050, steps=1000)
    rss = report["rss"]
    growth, late = rss[-1] - rss[0], rss[-1] - rss[1]
    assert growth < 8.0, f"resident memory grew by {growth:.1f} MB over 1,000 steps: {rss}"
    assert late < 6.0, f"resident memory grew by {late:.1f} MB over the last 750 steps: {rss}"
    sizes = report["sizes"]
    assert sizes["objects"] <= bound_objects.OBJECTS_MAX
    assert sizes["object_bytes"] <= bound_objects.OBJECTS_MAX_BYTES


# ---- each cache is bounded (in process, with the bounds lowered) ----


def test_bound_objects_are_lru_bounded(device, monkeypatch):
    monkeypatch.setattr(bound_objects, "OBJECTS_MAX", 8)
    dev = device
    kernel = dev.kernels.get("ops/elementwise.slang", "relu4")
    dev.kernels.release_objects()
    kept = [pydiff.tensor(np.linspace(-1, 1, 8), device=dev) for _ in range(2)]
    for k in range(40):  # fresh buffers every time: temporaries that never come back
        x = pydiff.tensor(np.full(8, k - 20.0), device=dev)
        y = pydiff.zeros((8,), device=dev)
        dev.kernels.dispatch(kernel, 2, count=2, x=x.native.storage, y=y.native.storage)
        dev.flush()
        np.testing.assert_array_equal(y.numpy(), np.maximum(np.full(8, k - 20.0), 0.0))
        # a hot pair of buffers stays cached and keeps giving the right answer
        dev.kernels.dispatch(kernel, 2, count=2, x=kept[0].native.storage, y=kept[1].native.storage)
        dev.flush()
        np.testing.assert_array_equal(
            kept[1].numpy(), np.maximum(np.linspace(-1, 1, 8, dtype=np.float32), 0)
        )
        assert dev.kernels.sizes()["objects"] <= 8
    dev.kernels.release_objects()


def test_evicted_kernel_takes_its_objects(device, monkeypatch):
    monkeypatch.setattr(kernels, "KERNELS_MAX", 1)
    dev = device
    cache = kernels.KernelCache(dev.native, dev.kernels.shader_dir, dev.queue, dev.typed_loads)
    x = pydiff.tensor(np.array([-1.0, 2.0, -3.0, 4.0]), device=dev)
    y = pydiff.zeros((4,), device=dev)
    k1 = cache.get("ops/elementwise.slang", "relu4")
    cache.dispatch(k1, 1, count=1, x=x.native.storage, y=y.native.storage)
    dev.flush()
    assert cache.sizes()["objects"] == 1
    cache.get("optim/sgd.slang", "sgd_step4")  # evicts relu4 and its bound object
    assert cache.sizes() == {"kernels": 1, "objects": 0, "object_bytes": 0}
    k1 = cache.get("ops/elementwise.slang", "relu4")  # rebuilt on demand, same result
    y2 = pydiff.zeros((4,), device=dev)
    cache.dispatch(k1, 1, count=1, x=x.native.storage, y=y2.native.storage)
    dev.flush()
    np.testing.assert_array_equal(y2.numpy(), [0.0, 2.0, 0.0, 4.0])


def test_buffer_pool_total_bytes_bounded(device, monkeypatch):
    monkeypatch.setattr(buffer_pool, "POOL_MAX_BYTES", 4096)
    pool = buffer_pool.BufferPool(device.native, device.queue)
    held = [pool.float4_buffer(n) for n in range(1, 60)]  # 16 * (1 + ... + 59) bytes asked
    assert pool.sizes()["bytes"] <= 4096
    assert all(b.size >= 16 * n for n, b in zip(range(1, 60), held))
    del held
    for n in range(60, 120):  # the free ones are released to make room
        pool.float4_buffer(n)
        assert pool.sizes()["bytes"] <= 4096
    pool.prune()
    assert pool.sizes() == {"buffers": 0, "bytes": 0}


def test_bounded_dict_keeps_most_recently_used():
    d = buffer_pool.BoundedDict(3)
    for k in "abcd":
        d[k] = k.upper()
    assert list(d) == ["b", "c", "d"]
    assert d["b"] == "B"  # a read is a use
    d["e"] = "E"
    assert list(d) == ["d", "b", "e"]
    assert "c" not in d and len(d) == 3


def test_device_memos_are_bounded(device):
    from pydiff import device_state

    assert isinstance(device.scratch, buffer_pool.BoundedDict)
    assert device.scratch.max_items == device_state.SCRATCH_MAX_ITEMS
    made = [device.cached(("test_memory", k), lambda k=k: k * k) for k in range(1100)]
    assert made == [k * k for k in range(1100)]
    assert device.cached(("test_memory", 1099), lambda: -1) == 1099**2  # still cached
    assert device.cached(("test_memory", 0), lambda: -1) == -1  # evicted, made again
    # pydiff's own memo (the library as a Module) is made again on demand after eviction
    x = pydiff.tensor(np.array([0.25, -2.0]), device=device)
    np.testing.assert_allclose(pydiff.ops.exp(x).numpy(), np.exp([0.25, -2.0]), rtol=1e-6)


# ---- many call shapes (issue 21, 2.5): broadcast-gradient scratch buffers are bounded ----

# .bwds of s * x with s a (1,) tensor broadcast over x, over three rounds of 200 shapes of
# distinct sizes (2-D and 1-D, up to ~0.8 MB of gradient each: ~80 MB a round if every one
# were kept), scratch bounded to 8 MB and the buffer pool to 16 MB here. Prints RSS (MB)
# after each round and after empty_cache, what scratch held, and s.grad against the sum of
# the sizes. glibc's mmap threshold is fixed (env) so that freed buffers leave RSS instead
# of staying in its heap, and each figure is taken after the device is idle (slang-rhi
# frees released buffers then).
SHAPES = r"""
import gc, json, os, sys
import numpy as np
from pydiff import buffer_pool, device_state
device_state.SCRATCH_MAX_BYTES = 8 * 2**20
buffer_pool.POOL_MAX_BYTES = 16 * 2**20
import pydiff

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

dev = pydiff.create_device(sys.argv[1])
m = pydiff.load_module_from_source(
    "scaled", "[Differentiable] float scaled(float s, float x) { return s * x; }", device=dev
)
s = pydiff.tensor([0.5], device=dev, requires_grad=True)
def call(shape):  # s.grad += sum(x) = its size
    m.scaled.bwds(s, pydiff.tensor(np.ones(shape, np.float32), device=dev), _result=1.0)

call((4, 4))
total, peak, rss = 16, 0, []
for round in range(3):
    for k in range(200):
        n = 1000 + 1009 * k + 3 * round
        shape = (n // 7, 7) if k % 2 else (n,)
        call(shape)
        total += int(np.prod(shape))
        peak = max(peak, dev.scratch.bytes)
    gc.collect()
    dev.native.wait()  # released buffers are freed once the work before them is done
    rss.append(rss_mb())
dev.empty_cache()
gc.collect()
rss.append(rss_mb())
print(json.dumps({"rss": rss, "peak_scratch": peak,
                  "emptied": [dev.scratch.bytes, len(dev.scratch)],
                  "grad": float(s.grad.numpy()[0]), "total": total}))
"""


def test_many_call_shapes_keep_scratch_memory_bounded(device):
    out = subprocess.run(
        [sys.executable, "-c", SHAPES, device.type],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONFAULTHANDLER": "1", "MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(report["grad"], report["total"], rtol=1e-6)
    assert 0 < report["peak_scratch"] <= 8 * 2**20 + 900_000  # the newest one is kept
    assert report["emptied"] == [0, 0]
    first, second, third, emptied = report["rss"]
    # Kept buffers would add ~80 MB a round; measured flat within 5 MB.
    assert third - first < 30, f"RSS grew over rounds of new shapes: {report}"
    assert emptied <= third + 1


def test_scratch_is_reused_by_size_not_shape(device):
    m = pydiff.load_module_from_source(
        "scaled_by_size",
        "[Differentiable] float scaled(float s, float x) { return s * x; }",
        device=device,
    )
    s = pydiff.tensor([0.5], device=device, requires_grad=True)
    device.empty_cache()
    for shape in [(24,), (4, 6), (6, 4), (2, 3, 4)]:  # one size: one buffer
        m.scaled.bwds(s, pydiff.tensor(np.full(shape, 2.0), device=device), _result=1.0)
    keys = [k for k in device.scratch if k[0] == "broadcast-grad"]
    assert len(keys) == 1, keys
    np.testing.assert_allclose(s.grad.numpy(), [4 * 24 * 2.0])


def test_bounded_dict_counts_device_bytes():
    import slangpy as spy

    dev = pydiff.default_device()
    d = buffer_pool.BoundedDict(10, max_bytes=10_000)
    d["a"] = spy.Tensor.zeros(dev.native, (1000,), "float")  # 4,000 bytes
    t = spy.Tensor.zeros(dev.native, (1000,), "float")
    d["b"] = [t, t.view((10, 100))]  # one buffer, counted once
    assert d.bytes == 8000
    d["c"] = {"x": spy.Tensor.zeros(dev.native, (1000,), "float")}
    assert list(d) == ["b", "c"] and d.bytes == 8000  # "a" evicted
    d["huge"] = spy.Tensor.zeros(dev.native, (10_000,), "float")  # over the bound alone: kept
    assert list(d) == ["huge"] and d.bytes == 40_000
    del d["huge"]
    assert d.bytes == 0
    d["n"] = 5
    assert d.pop("n") == 5 and d.bytes == 0


# ---- batch sizes (F6): one product kernel serves every batch size ----


def _ce_layer_grads(x, w, b, labels):
    """dW, db, dx of mean cross_entropy(x W^T + b, labels), float64 closed form."""
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    g = (p - np.eye(w.shape[0])[labels]) / len(labels)
    return g.T @ x, g.sum(axis=0), g @ w


def _train_layer(device, w, b, batch, seed):
    """A linear + cross_entropy step over ``batch`` rows, its gradients checked."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((batch, w.shape[1])).astype(np.float32)
    labels = rng.integers(0, w.shape[0], batch)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    for t in (w, b):
        t.zero_grad()
    with pydiff.Tape() as tape:
        loss = pydiff.ops.cross_entropy(pydiff.ops.linear(x, w, b), labels.astype(np.int32))
    tape.backward(loss)
    want = _ce_layer_grads(xs, w.numpy(), b.numpy(), labels)
    for got, expected in zip((w.grad, b.grad, x.grad), want):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_new_batch_sizes_reuse_the_compiled_product_kernels(device):
    """The products take the batch (M, or K of dW = g^T x) and the narrow backward its B as
    uniforms: a layer trained over new batch sizes compiles its kernels once. Before, each new
    batch size compiled 3-4 kernels (about 0.1-0.7 s each and 1.5-2 MB of RSS)."""
    rng = np.random.default_rng(0)
    layers = []
    for n_in, n_out in ((16, 8), (64, 10)):  # the product kernels; the narrow backward
        w = rng.standard_normal((n_out, n_in)).astype(np.float32) / 4
        layers.append(
            [pydiff.tensor(a, device=device, requires_grad=True) for a in (w, np.zeros(n_out))]
        )
    device.empty_cache()
    for seed, batch in enumerate((16, 32, 48, 80, 96, 112)):  # one register blocking
        for w, b in layers:
            _train_layer(device, w, b, batch, seed)
        if seed == 0:
            first = device.kernels.sizes()["kernels"]
    assert device.kernels.sizes()["kernels"] == first
    # Any batch size: the blocking still depends on which divisors the batch has (rows per
    # thread, KU), a bounded set, not one kernel per size (this loop compiled 160 before).
    for seed, batch in enumerate(range(1, 41)):
        _train_layer(device, *layers[0], batch, seed)
    assert device.kernels.sizes()["kernels"] <= first + 30


def test_empty_cache_releases_the_compiled_kernels(device):
    a = np.arange(32, dtype=np.float32).reshape(8, 4) / 8
    b = np.ones((4, 8), np.float32)
    c = pydiff.ops.matmul(pydiff.tensor(a, device=device), pydiff.tensor(b, device=device))
    np.testing.assert_allclose(c.numpy(), a.astype(np.float64) @ b, rtol=1e-6)
    assert device.kernels.sizes()["kernels"] > 0
    device.empty_cache()
    assert device.kernels.sizes() == {"kernels": 0, "objects": 0, "object_bytes": 0}
    c = pydiff.ops.matmul(pydiff.tensor(a, device=device), pydiff.tensor(b, device=device))
    np.testing.assert_allclose(c.numpy(), a.astype(np.float64) @ b, rtol=1e-6)


# ops.matmul over 80 new widths N (a new kernel each: N is compiled in), the kernel cache
# bounded to 4, without the persistent compile cache; RSS (MB) after 20 and after 80.
WIDTHS = r"""
import gc, json, os, sys
import numpy as np
from pydiff import kernels
kernels.KERNELS_MAX = 4
import pydiff

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

dev = pydiff.create_device(sys.argv[1], cache_dir=False)
a = pydiff.tensor(np.ones((8, 8), np.float32), device=dev)
rss = []
for i in range(80):
    n = 4 * (i + 1)
    c = pydiff.ops.matmul(a, pydiff.tensor(np.ones((8, n), np.float32), device=dev))
    assert float(c.numpy()[0, n - 1]) == 8.0
    if i + 1 in (20, 80):
        gc.collect()
        rss.append(rss_mb())
print(json.dumps({"rss": rss, "kernels": dev.kernels.sizes()["kernels"]}))
"""


def test_evicted_kernels_release_their_memory(device):
    """Kernels are compiled in Slang sessions of their own: a session keeps every module
    loaded into it, so kernels built in the device's one session kept 1.5-2.5 MB each after
    their eviction (60 evicted kernels: +90 to +150 MB here; now flat within a few MB)."""
    out = subprocess.run(
        [sys.executable, "-c", WIDTHS, device.type],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["kernels"] <= 4
    first, last = report["rss"]
    assert last - first < 40, report
