"""pydiff.distributed (issue 19): two processes on loopback gloo, each on its own lavapipe
device. After 10 AdamW steps (eager, and with the forward-backward and the optimizer step
captured apart) both ranks hold bit-identical parameters; the first step's all-reduced
gradients match a float64 NumPy backward over the whole batch; a rank that exits or hangs
makes the other raise DistributedError within the timeout. Skipped without torch.

The workers are this file run as a script (``python tests/test_distributed.py SCENARIO``),
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as torchrun sets them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import distributed as pd_dist

from ranks import free_port, needs_vulkan, run_ranks

ROOT = Path(__file__).resolve().parent.parent
IN, HIDDEN, CLASSES, SAMPLES, BATCH, STEPS = 8, 16, 4, 64, 16, 10


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(19)
    x = rng.normal(size=(SAMPLES, IN)).astype(np.float32)
    return x, rng.integers(0, CLASSES, SAMPLES).astype(np.int32)


# --- the workers ------------------------------------------------------------------------


def _model(seed: int):
    from pydiff import nn

    return [
        nn.Linear(IN, HIDDEN, seed=seed, activation="relu"),
        nn.Linear(HIDDEN, CLASSES, seed=seed + 1),
    ]


def _params(layers) -> list:
    return [p for layer in layers for p in layer.parameters()]


def _train(out: Path, me: int, captured: bool) -> None:
    from pydiff import ops, optim

    layers = _model(seed=100 + 10 * me)  # different on each rank: broadcast must fix that
    params = _params(layers)
    pd_dist.broadcast(params)
    init = [p.numpy() for p in params]
    opt = optim.AdamW(params, lr=1e-2, weight_decay=1e-2)
    xb, yb = pydiff.empty((BATCH, IN)), pydiff.empty((BATCH,), dtype="int")

    def forward_backward():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss)
        return loss

    loader = pd_dist.ShardedLoader(*data(), batch_size=BATCH, seed=3)
    fwd_bwd = update = None
    saved: dict = {}
    for step in range(STEPS):
        loader.set_epoch(step // len(loader))
        x, y = list(loader)[step % len(loader)]
        xb.copy_from_numpy(x)
        yb.copy_from_numpy(y)
        if fwd_bwd is not None:
            fwd_bwd.replay()
        elif captured and step == 1:
            fwd_bwd = pydiff.capture(forward_backward)
        else:
            forward_backward()
        sent = pd_dist.all_reduce_grads(params, bucket_bytes=600)  # 2 buckets of 2
        if step == 0:
            saved.update(x0=x, y0=y, sent=sent, grads=[p.grad.numpy() for p in params])
        if update is not None:
            update.replay()
        elif captured and step == 1:
            update = pydiff.capture(opt.step)
        else:
            opt.step()
    np.savez(
        out / f"{'captured' if captured else 'eager'}_{me}.npz",
        x0=saved["x0"],
        y0=saved["y0"],
        sent=saved["sent"],
        **{f"init{k}": a for k, a in enumerate(init)},
        **{f"grad{k}": a for k, a in enumerate(saved["grads"])},
        **{f"final{k}": p.numpy() for k, p in enumerate(params)},
    )


def worker(scenario: str, out: Path) -> None:
    on = os.environ.get("PYDIFF_TEST_RANKS_ON", "vulkan")
    pydiff.set_default_device(pydiff.create_device(on))
    me = int(os.environ["RANK"])
    timeout = float(os.environ["PYDIFF_TEST_TIMEOUT"])
    pd_dist.init_process_group("gloo", timeout=timeout)
    if scenario == "train":
        _train(out, me, captured=False)
        _train(out, me, captured=True)
        return
    params = _params(_model(seed=0))
    with pydiff.Tape() as tape:
        loss = pydiff.ops.sum(params[0])
    tape.backward(loss)
    if me == 1:
        if scenario == "exit":
            os._exit(0)  # gone without a word: the peer's collective must not wait forever
        time.sleep(120)  # "hang": alive, never joining; the test ends this process
    start = time.monotonic()
    try:
        pd_dist.all_reduce_grads(params)
        outcome = {"raised": None}
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        outcome = {"raised": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    (out / "rank0.json").write_text(json.dumps(outcome))
    os._exit(0)  # the broken group's teardown could block


# --- the tests --------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _launch(scenario: str, out: Path, timeout: float, wait: float, on: str = "vulkan") -> list:
    """Run two ranks of ``scenario`` on devices of type ``on``; wait for rank 0 (and, for
    training, rank 1) at most ``wait`` s, end the rest."""
    env = {"PYDIFF_TEST_RANKS_ON": on, "PYDIFF_TEST_TIMEOUT": str(timeout)}
    wait_for = [0, 1] if scenario == "train" else [0]
    return run_ranks(__file__, [scenario, str(out)], env=env, wait=wait, wait_for=wait_for)


def _reference_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list:
    """The MLP's gradients of the batch's mean cross-entropy, in float64 NumPy."""
    w1, b1, w2, b2 = (p.astype(np.float64) for p in params)
    pre = x.astype(np.float64) @ w1.T + b1
    h = np.maximum(pre, 0.0)
    logits = h @ w2.T + b2
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dlogits = (p - np.eye(CLASSES)[y]) / len(y)
    dh = (dlogits @ w2) * (pre > 0)
    return [dh.T @ x, dh.sum(0), dlogits.T @ h, dlogits.sum(0)]


@pytest.mark.parametrize("on", ["vulkan", "cuda"])
def test_two_ranks_train_to_bit_identical_parameters(tmp_path, on):
    """On CUDA both ranks share the one GPU (gloo) and exchange through zero-copy views."""
    if on not in pydiff.available_devices():
        pytest.skip(f"no {on} device here")
    results = _launch("train", tmp_path, timeout=60.0, wait=240, on=on)
    for code, log in results:
        assert code == 0, log[-4000:]
    for mode in ("eager", "captured"):
        r0, r1 = (np.load(tmp_path / f"{mode}_{r}.npz") for r in range(2))
        for k in range(4):
            # Broadcast: rank 1 started from rank 0's parameters (it made its own first).
            assert np.array_equal(r0[f"init{k}"], r1[f"init{k}"])
            # All-reduced gradients and 10 AdamW steps: bit-identical on both ranks.
            assert np.array_equal(r0[f"grad{k}"], r1[f"grad{k}"])
            assert r0[f"final{k}"].tobytes() == r1[f"final{k}"].tobytes(), (mode, k)
        assert not np.array_equal(r0["x0"], r1["x0"])  # the ranks saw different shards
        assert int(r0["sent"]) == 4 * (IN * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES)
    # The first step's mean of the two shards' gradients is the gradient of one process
    # over the whole batch, computed here independently (float64 NumPy).
    r0, r1 = (np.load(tmp_path / f"eager_{r}.npz") for r in range(2))
    x = np.concatenate([r0["x0"], r1["x0"]])
    y = np.concatenate([r0["y0"], r1["y0"]])
    one = pd_dist.ShardedLoader(*data(), batch_size=2 * BATCH, seed=3, rank=0, world_size=1)
    x_one, y_one = next(iter(one))
    assert np.array_equal(x, x_one) and np.array_equal(y, y_one)  # the same global batch
    ref = _reference_grads([r0[f"init{k}"] for k in range(4)], x, y)
    for k, want in enumerate(ref):
        got = r0[f"grad{k}"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # Captured steps compute what eager steps compute.
    cap = np.load(tmp_path / "captured_0.npz")
    for k in range(4):
        assert np.array_equal(cap[f"final{k}"], r0[f"final{k}"]), k


@needs_vulkan
def test_sample_matches_one_process_and_ends_bit_identical():
    out = subprocess.run(
        [sys.executable, "samples/train_mlp_distributed.py", "--epochs", "5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert out.returncode == 0, out.stderr[-3000:]
    one = re.search(r"1 process: test accuracy ([\d.]+)%", out.stdout)
    two = re.search(r"2 processes: test accuracy ([\d.]+)%", out.stdout)
    assert one and two, out.stdout
    assert float(one.group(1)) > 50 and abs(float(one.group(1)) - float(two.group(1))) <= 1.0
    assert "ranks bit-identical after training: True" in out.stdout, out.stdout
    assert "not captured" not in out.stdout  # the all-reduce sits between two captured steps


@needs_vulkan
@pytest.mark.parametrize("scenario", ["exit", "hang"])
def test_a_lost_rank_makes_the_other_raise_within_the_timeout(tmp_path, scenario):
    timeout = 8.0
    results = _launch(scenario, tmp_path, timeout=timeout, wait=120)
    assert results[0][0] == 0, results[0][1][-4000:]
    outcome = json.loads((tmp_path / "rank0.json").read_text())
    assert outcome["raised"] == "DistributedError", outcome
    assert "all_reduce_grads failed on rank 0 of 2" in outcome["message"]
    assert "timeout (8 s" in outcome["message"]
    assert outcome["seconds"] < timeout + 5, outcome


def test_without_a_process_group_the_error_names_init_process_group(device):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    for call in (
        lambda: pd_dist.all_reduce_grads([x]),
        lambda: pd_dist.broadcast([x]),
        pd_dist.rank,
        pd_dist.world_size,
        lambda: pd_dist.ShardedLoader(np.zeros(4), batch_size=2),
    ):
        with pytest.raises(pydiff.DistributedError, match="init_process_group"):
            call()


def test_wrong_arguments_are_refused(device):
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    with pytest.raises(ValueError, match=r"op='max'; expected one of \('mean', 'sum'\)"):
        pd_dist.all_reduce_grads([x], op="max")
    with pytest.raises(ValueError, match=r"tensors\[0\] has no gradient"):
        pd_dist.all_reduce_grads([pydiff.tensor([1.0], device=device)])
    with pytest.raises(TypeError, match="not a pydiff.Tensor"):
        pd_dist.broadcast([np.zeros(2)])
    with pytest.raises(ValueError, match="different lengths"):
        pd_dist.ShardedLoader(np.zeros(4), np.zeros(5), batch_size=2, rank=0, world_size=1)


def test_all_reduce_inside_a_capture_is_refused_with_the_way_out(device):
    x = pydiff.tensor(np.ones(8), device=device, requires_grad=True)

    def step():
        x.zero_grad()
        pd_dist.all_reduce_grads([x])

    with pytest.raises(pydiff.CaptureError, match="all-reduce between\\s+their replays"):
        pydiff.capture(step)


def test_loader_shards_cover_each_global_batch_once_per_epoch():
    x = np.arange(50)
    shards = [
        pd_dist.ShardedLoader(x, batch_size=4, seed=1, rank=r, world_size=3) for r in range(3)
    ]
    for loader in shards:
        loader.set_epoch(2)
    assert [len(s) for s in shards] == [4, 4, 4]  # 50 // 12, the remainder dropped
    batches = [list(s) for s in shards]
    seen = np.concatenate([b[0] for step in zip(*batches) for b in step])
    assert len(set(seen.tolist())) == 48  # no sample twice in an epoch
    again = pd_dist.ShardedLoader(x, batch_size=4, seed=1, rank=1, world_size=3)
    again.set_epoch(2)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(again, batches[1]))
    again.set_epoch(3)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(again, batches[1]))


@pytest.fixture
def group_of_one():
    """A process group of this process alone (world size 1), ended after the test."""
    pd_dist.init_process_group(
        "gloo", timeout=30.0, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def test_round_trip_through_the_buckets_keeps_every_value_in_place(device, group_of_one):
    rng = np.random.default_rng(5)
    shapes = [(3, 5), (7,), (2, 2, 3), (1,), (64,)]
    params = [pydiff.tensor(rng.normal(size=s), device=device, requires_grad=True) for s in shapes]
    grads = [rng.normal(size=s).astype(np.float32) for s in shapes]
    for p, g in zip(params, grads):
        p.grad.copy_from_numpy(g)
    for bucket_bytes in (1, 100, 10**6):  # one tensor per bucket, some, all in one
        for op in ("sum", "mean"):
            sent = pd_dist.all_reduce_grads(params, op=op, bucket_bytes=bucket_bytes)
            assert sent == 4 * sum(g.size for g in grads)
            for p, g in zip(params, grads):
                assert np.array_equal(p.grad.numpy(), g)
    labels = pydiff.tensor(np.arange(6, dtype=np.int32), device=device)
    values = [p.numpy() for p in params]
    pd_dist.broadcast([*params, labels])
    assert all(np.array_equal(p.numpy(), v) for p, v in zip(params, values))
    assert labels.numpy().tolist() == list(range(6)) and pd_dist.world_size() == 1


def test_buckets_keep_the_order_and_one_dtype_each():
    sizes = [("float32", 40), ("float16", 8), ("float32", 40), ("float32", 100), ("float32", 4)]
    assert pd_dist._buckets(sizes, 64) == [[0], [2], [3], [4], [1]]
    assert pd_dist._buckets(sizes, 1000) == [[0, 2, 3, 4], [1]]


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
