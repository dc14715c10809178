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
from pydiff import buffer_pool, kernels

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
    # 1,000 steps after a warm-up of 300, in four chunks: the unbounded caches grew by
    # ~90 MB here. The first chunk may still fill the shader-object cache (~3 MB); the
    # other three (750 steps) must be flat.
    report = run_loop(device.type, warmup=300, steps=1000)
    rss = report["rss"]
    growth, late = rss[-1] - rss[0], rss[-1] - rss[1]
    assert growth < 8.0, f"resident memory grew by {growth:.1f} MB over 1,000 steps: {rss}"
    assert late < 3.0, f"resident memory grew by {late:.1f} MB over the last 750 steps: {rss}"
    sizes = report["sizes"]
    assert sizes["objects"] <= kernels.OBJECTS_MAX
    assert sizes["object_bytes"] <= kernels.OBJECTS_MAX_BYTES


# ---- each cache is bounded (in process, with the bounds lowered) ----


def test_bound_objects_are_lru_bounded(device, monkeypatch):
    monkeypatch.setattr(kernels, "OBJECTS_MAX", 8)
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
    cache = kernels.KernelCache(dev.native, dev.kernels.shader_dir, dev.queue)
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
    from pydiff import device as device_module

    assert isinstance(device.scratch, buffer_pool.BoundedDict)
    assert device.scratch.max_items == device_module.SCRATCH_MAX_ITEMS
    made = [device.cached(("test_memory", k), lambda k=k: k * k) for k in range(1100)]
    assert made == [k * k for k in range(1100)]
    assert device.cached(("test_memory", 1099), lambda: -1) == 1099**2  # still cached
    assert device.cached(("test_memory", 0), lambda: -1) == -1  # evicted, made again
    # pydiff's own memo (the library as a Module) is made again on demand after eviction
    x = pydiff.tensor(np.array([0.25, -2.0]), device=device)
    np.testing.assert_allclose(pydiff.ops.exp(x).numpy(), np.exp([0.25, -2.0]), rtol=1e-6)
