"""Breaker 19: things tried on pydiff.distributed that WORKED (these pass on the current code).

Two (or three) ranks on loopback gloo, each with its own lavapipe device: this file run as a
script (``python tests/test_breaker_issue19_ok.py SCENARIO OUT``) with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set as torchrun sets them; each rank writes OUT/rank{r}.json.
References are float64 NumPy. Skipped without torch."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import distributed as dist

from ranks import free_port, launch_scenario, needs_vulkan, scenario_worker

pytestmark = needs_vulkan

ROOT = Path(__file__).resolve().parent.parent

# --- the workers (run in the spawned ranks) ----------------------------------------------


def _attempt(f):
    start = time.monotonic()
    try:
        return {"ok": f(), "s": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        return {"raised": type(exc).__name__, "msg": str(exc), "s": time.monotonic() - start}


def _digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


SHAPES = [
    ((3, 5), "float"),
    ((7,), "half"),
    ((4,), "float3"),
    ((1000,), "float"),
    ((2, 2, 3), "half"),
    ((1,), "float"),
]


def _values(shape, dtype, seed):
    full = shape + ((3,) if dtype == "float3" else ())
    a = np.random.default_rng(seed).normal(size=full)
    return a.astype(np.float16 if dtype == "half" else np.float32)


def _scenario_buckets(me, world):
    """Mixed dtypes (float, half, float3), every bucket size: vs float64, bit-identical."""
    out = {}
    for bb in (1, 7, 13, 100, 4096, 10**9):
        for op in ("sum", "mean"):
            ps = [pydiff.tensor(_values(s, d, 0), dtype=d, requires_grad=True) for s, d in SHAPES]
            for k, p in enumerate(ps):
                p.grad.copy_from_numpy(_values(*SHAPES[k], 100 + 10 * me + k))
            sent = dist.all_reduce_grads(ps, op=op, bucket_bytes=bb)
            errs = []
            for k, p in enumerate(ps):
                each = [
                    _values(*SHAPES[k], 100 + 10 * r + k).astype(np.float64) for r in range(world)
                ]
                scale = world if op == "mean" else 1
                want, size = sum(each) / scale, sum(np.abs(e) for e in each) / scale
                got = p.grad.numpy().astype(np.float64).reshape(want.shape)
                # relative to the sum of magnitudes: the bound of the roundings of a sum
                errs.append(float(np.max(np.abs(got - want) / size)))
            out[f"{bb}/{op}"] = {
                "sent": sent,
                "errs": errs,
                "hash": _digest(p.grad.numpy() for p in ps),
            }
    return out


def _scenario_values(me, world):
    """broadcast of int/uint/half extremes, src=1, src out of range, reshape views, duplicates."""
    sign = 1 if me == 0 else 0
    i = pydiff.tensor(np.array([7, -3, 2**31 - 1], np.int32) * sign, dtype="int")
    u = pydiff.tensor(np.array([7, 3, 2**32 - 1], np.uint32) * sign, dtype="uint")
    h = pydiff.tensor(np.array([1.5, 65504, -0.0], np.float16) * sign, dtype="half")
    f = pydiff.tensor(np.array([np.nan, -np.inf, 1e-45, -0.0], np.float32) * sign)
    res = {"bcast": _attempt(lambda: dist.broadcast([i, u, h, f], bucket_bytes=5))}
    res["i"], res["u"] = i.numpy().tolist(), u.numpy().tolist()
    res["h_bits"] = h.numpy().view(np.uint16).tolist()
    res["f_bits"] = f.numpy().view(np.uint32).tolist()
    y = pydiff.tensor(np.array([1.0, 2.0], np.float32) * (me + 1))
    res["src1"] = _attempt(lambda: dist.broadcast([y], src=1))
    res["y"] = y.numpy().tolist()
    res["src2"] = _attempt(lambda: dist.broadcast([y], src=2))
    p = pydiff.tensor(np.arange(6, dtype=np.float32).reshape(2, 3) * (me + 1), requires_grad=True)
    p.grad.copy_from_numpy(np.full((2, 3), 1.0 + me, np.float32))
    v = p.reshape(-1)  # a view sharing p's buffers: both directions write through
    res["view_bcast"] = _attempt(lambda: dist.broadcast([v]))
    res["p_after_bcast"] = p.numpy().tolist()
    res["view_reduce"] = _attempt(lambda: dist.all_reduce_grads([v], op="sum"))
    res["p_grad_after"] = p.grad.numpy().tolist()
    d = pydiff.tensor(np.ones(3, np.float32), requires_grad=True)
    d.grad.copy_from_numpy(np.full(3, 1.0 + me, np.float32))
    res["dup"] = _attempt(lambda: dist.all_reduce_grads([d, d, d], op="sum"))
    res["dup_grad"] = d.grad.numpy().tolist()
    return res


def _scenario_regression(me, world):
    """Linear least squares on ShardedLoader shards vs float64 over the whole batch; capture
    refusals on both ranks (no hang); 200 more steps: no memory growth, identical bits."""
    from pydiff import ops

    rng = np.random.default_rng(7)
    n, d, b = 40, 5, 6
    x, y = rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, 1)).astype(np.float32)
    w0 = rng.normal(size=(d, 1)).astype(np.float32)
    loader = dist.ShardedLoader(x, y, batch_size=b, seed=11)
    loader.set_epoch(3)
    res = {"len": len(loader)}
    xb, yb = next(iter(loader))
    for op in ("mean", "sum"):
        w = pydiff.tensor(w0, requires_grad=True)
        with pydiff.Tape() as tape:
            r = ops.sub(ops.matmul(pydiff.tensor(xb), w), pydiff.tensor(yb))
            loss = ops.mean(ops.mul(r, r)) if op == "mean" else ops.sum(ops.mul(r, r))
        tape.backward(loss)
        dist.all_reduce_grads([w], op=op)
        res[op] = w.grad.numpy().ravel().tolist()
    res["xb"], res["yb"] = xb.tolist(), yb.tolist()
    p = pydiff.tensor(np.ones(4, np.float32), requires_grad=True)
    res["cap_reduce"] = _attempt(lambda: pydiff.capture(lambda: dist.all_reduce_grads([p])))
    res["cap_bcast"] = _attempt(lambda: pydiff.capture(lambda: dist.broadcast([p])))
    ps = [pydiff.tensor(np.ones(m, np.float32), requires_grad=True) for m in (50_000, 7, 70_000)]
    for k, q in enumerate(ps):
        q.grad.copy_from_numpy(np.random.default_rng(me * 10 + k).normal(size=q.shape))

    def rss_mib():
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

    for _ in range(20):
        dist.all_reduce_grads(ps, bucket_bytes=100_000)
    before = rss_mib()
    for _ in range(200):
        dist.all_reduce_grads(ps, bucket_bytes=100_000)
        dist.broadcast(ps, bucket_bytes=100_000)
    res["rss_growth_mib"] = rss_mib() - before
    res["hash"] = _digest([q.grad.numpy() for q in ps] + [q.numpy() for q in ps])
    return res


def _scenario_wrong_collective(me, world):
    """Rank 0 all-reduces while rank 1 broadcasts: both raise DistributedError, no hang."""
    a = pydiff.tensor(np.arange(4, dtype=np.float32), requires_grad=True)
    if me == 0:
        return {"r": _attempt(lambda: dist.all_reduce_grads([a]))}
    return {"r": _attempt(lambda: dist.broadcast([a]))}


def _scenario_wrong_src(me, world):
    """Each rank names itself as src: both raise DistributedError after the timeout."""
    a = pydiff.tensor(np.ones(4, np.float32))
    return {"r": _attempt(lambda: dist.broadcast([a], src=me))}


def _scenario_late(me, world):
    """A peer 3 s late (timeout 6 s) is waited for; one past the timeout is an error, and
    every later call fails at once; rank() still answers."""
    a = pydiff.tensor(np.ones(4, np.float32), requires_grad=True)
    a.grad.copy_from_numpy(np.full(4, 1.0 + me, np.float32))
    if me == 1:
        time.sleep(3)
    res = {"late": _attempt(lambda: dist.all_reduce_grads([a]))}
    res["grad"] = a.grad.numpy().tolist()
    if me == 0:
        time.sleep(float(os.environ["B19_TIMEOUT"]) + 2)
    res["past"] = _attempt(lambda: dist.all_reduce_grads([a]))
    res["again"] = _attempt(lambda: dist.all_reduce_grads([a]))
    res["rank"] = dist.rank()
    return res


def worker(scenario: str, out: Path) -> None:
    scenario_worker(globals(), scenario, out)


# --- the tests ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def launch(script, scenario: str, out: Path, timeout: float, wait: float = 30.0, world=2):
    """Run ``scenario`` in ``world`` ranks; returns [(returncode, log, result or None)]."""
    return launch_scenario(script, scenario, out, {"B19_TIMEOUT": str(timeout)}, wait, world)


def _run(scenario, tmp_path, timeout=10.0, world=2):
    results = launch(__file__, scenario, tmp_path, timeout, world=world)
    for code, log, res in results:
        assert code == 0 and res is not None, (code, log)
    return [res for _, _, res in results]


def test_buckets_of_every_size_and_dtype_match_float64_and_are_bit_identical(tmp_path):
    r0, r1 = _run("buckets", tmp_path)
    nbytes = sum(
        4 * (3 if d == "float3" else 1) * np.prod(s) if d != "half" else 2 * np.prod(s)
        for s, d in SHAPES
    )
    for key, got in r0.items():
        assert got["hash"] == r1[key]["hash"], key
        assert got["sent"] == nbytes, key
        for k, err in enumerate(got["errs"]):
            assert err < (2e-3 if SHAPES[k][1] == "half" else 1e-6), (key, k, err)


def test_three_ranks_sum_bit_identical(tmp_path):
    results = _run("buckets", tmp_path, world=3)
    for key in results[0]:
        assert len({r[key]["hash"] for r in results}) == 1, key
        assert max(results[0][key]["errs"]) < 2e-3, key  # half: 2 roundings of 2^-11


def test_broadcast_values_views_duplicates_and_src(tmp_path):
    r0, r1 = _run("values", tmp_path)
    for r in (r0, r1):
        assert r["bcast"]["ok"] == 12 + 12 + 6 + 16
        assert r["i"] == [7, -3, 2**31 - 1] and r["u"] == [7, 3, 2**32 - 1]
        want_h = np.array([1.5, 65504, -0.0], np.float16).view(np.uint16).tolist()
        assert r["h_bits"] == want_h  # -0.0 kept as -0.0
        assert (
            r["f_bits"]
            == np.array([np.nan, -np.inf, 1e-45, -0.0], np.float32).view(np.uint32).tolist()
        )
        assert r["y"] == [2.0, 4.0]  # rank 1's values
        assert r["src2"]["raised"] == "ValueError" and "src=2" in r["src2"]["msg"]
        assert r["p_after_bcast"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # through the view
        assert r["p_grad_after"] == [[3.0] * 3] * 2
        assert r["dup_grad"] == [3.0] * 3  # a tensor listed 3 times: reduced once, not 3x


def test_least_squares_gradients_match_float64_and_no_memory_growth(tmp_path):
    r0, r1 = _run("regression", tmp_path, timeout=20.0)
    assert r0["len"] == r1["len"] == 40 // 12
    x = np.concatenate([r0["xb"], r1["xb"]]).astype(np.float64)
    y = np.concatenate([r0["yb"], r1["yb"]]).astype(np.float64)
    rng = np.random.default_rng(7)
    xs, ys = rng.normal(size=(40, 5)).astype(np.float32), rng.normal(size=(40, 1))
    w0 = rng.normal(size=(5, 1)).astype(np.float32).astype(np.float64)
    one = dist.ShardedLoader(
        xs, ys.astype(np.float32), batch_size=12, seed=11, rank=0, world_size=1
    )
    one.set_epoch(3)
    assert np.array_equal(next(iter(one))[0], x.astype(np.float32))  # same global batch
    grad_sum = (2 * x.T @ (x @ w0 - y)).ravel()
    for r in (r0, r1):
        np.testing.assert_allclose(r["sum"], grad_sum, rtol=1e-5)
        np.testing.assert_allclose(r["mean"], grad_sum / len(x), rtol=1e-5)
        for key in ("cap_reduce", "cap_bcast"):
            assert r[key]["raised"] == "CaptureError", r[key]
        assert r["rss_growth_mib"] < 20, r["rss_growth_mib"]
    assert r0["hash"] == r1["hash"] and r0["mean"] == r1["mean"]


@pytest.mark.parametrize("scenario", ["wrong_collective", "wrong_src"])
def test_mismatched_collectives_raise_within_the_timeout(tmp_path, scenario):
    r0, r1 = _run(scenario, tmp_path, timeout=5.0)
    for r in (r0, r1):
        assert r["r"]["raised"] == "DistributedError", r
        assert r["r"]["s"] < 5.0 + 4, r


def test_late_peer_is_waited_for_and_one_past_the_timeout_fails(tmp_path):
    r0, r1 = _run("late", tmp_path, timeout=6.0)
    assert r0["late"]["ok"] == 16 and r0["grad"] == r1["grad"] == [1.5] * 4
    assert r0["late"]["s"] > 2.5
    for r in (r0, r1):
        assert r["past"]["raised"] == "DistributedError", r["past"]
        assert "timeout (6 s" in r["past"]["msg"]
        assert r["again"]["raised"] == "DistributedError" and r["again"]["s"] < 1.0
    assert (r0["rank"], r1["rank"]) == (0, 1)


# --- one process ---------------------------------------------------------------------------


@pytest.fixture
def group_of_one():
    dist.init_process_group(
        "gloo", timeout=20.0, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def test_a_rank_that_never_joins_fails_init_within_the_timeout(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    start = time.monotonic()
    with pytest.raises(pydiff.DistributedError, match="did not form within 3 s"):
        dist.init_process_group(timeout=3.0)
    assert time.monotonic() - start < 3.0 + 5
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("timeout", [0, -1, float("nan")])
def test_bad_timeouts_are_refused(timeout):
    with pytest.raises(ValueError, match="timeout="):
        dist.init_process_group(
            timeout=timeout, init_method="tcp://127.0.0.1:1", rank=0, world_size=1
        )


def test_after_destroy_every_call_names_init_process_group(device):
    dist.init_process_group(
        "gloo", timeout=20.0, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    torch.distributed.destroy_process_group()
    x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
    for call in (lambda: dist.all_reduce_grads([x]), lambda: dist.broadcast([x]), dist.rank):
        with pytest.raises(pydiff.DistributedError, match="init_process_group"):
            call()


def test_torchs_own_init_works(device):
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
        x.grad.fill(1.0)  # (a gradient no rank wrote does not travel: 0 bytes)
        assert dist.all_reduce_grads([x]) == 16 and dist.world_size() == 1
    finally:
        torch.distributed.destroy_process_group()


def test_wrong_types_are_refused_by_index(device, group_of_one):
    x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
    x.grad.fill(1.0)  # written: it travels (16 bytes below)
    cases = [
        ([np.zeros(3, np.float32)], TypeError, r"tensors\[0\] is a ndarray"),
        ([torch.zeros(3, requires_grad=True)], TypeError, r"tensors\[0\] is a Tensor"),
        ([x, None], TypeError, r"tensors\[1\] is a NoneType"),
        ([[x]], TypeError, r"tensors\[0\] is a list"),
        ([pydiff.nn.Linear(2, 2)], TypeError, r"tensors\[0\] is a Linear"),
        ([], ValueError, "no tensors given"),
        ([pydiff.tensor(np.arange(4), dtype="int", device=device)], ValueError, "no gradient"),
    ]
    for tensors, exc, match in cases:
        with pytest.raises(exc, match=match):
            dist.all_reduce_grads(tensors)
    for op in ("MEAN", "avg", None, b"sum", torch.distributed.ReduceOp.SUM):
        with pytest.raises(ValueError, match="op="):
            dist.all_reduce_grads([x], op=op)
    for bb in (0, -1):
        with pytest.raises(ValueError, match="bucket_bytes"):
            dist.all_reduce_grads([x], bucket_bytes=bb)
    with pytest.raises(ValueError, match="src=-1"):
        dist.broadcast([x], src=-1)
    with pytest.raises(TypeError, match="bool"):
        dist.broadcast([pydiff.tensor([True, False], dtype="bool", device=device)])
    assert dist.broadcast([x], src=np.int64(0)) == 16
    assert dist.all_reduce_grads((t for t in [x]), bucket_bytes=np.int64(8)) == 16


def test_zero_policies_strict_and_reset_take_the_reduced_gradients(device, group_of_one):
    from pydiff import nn, ops, optim

    for policy in ("strict", "reset"):
        with pydiff.zero_policy(policy):
            layer = nn.Linear(4, 3, device=device)
            params = layer.parameters()
            opt = optim.AdamW(params, lr=1e-2)
            for _ in range(3):
                opt.zero_grad()
                with pydiff.Tape() as tape:
                    xin = pydiff.tensor(np.ones((2, 4), np.float32), device=device)
                    loss = ops.sum(layer(xin))
                tape.backward(loss)
                dist.all_reduce_grads(params)
                opt.step()
            np.testing.assert_allclose(params[1].grad.numpy(), [2.0, 2.0, 2.0])


def test_loader_edges():
    L = dist.ShardedLoader
    with pytest.raises(ValueError, match="5 samples make no global batch of 10"):
        L(np.arange(5), batch_size=10, rank=0, world_size=1)
    with pytest.raises(ValueError, match="make no global batch"):
        L(np.arange(5), batch_size=3, rank=0, world_size=2)
    for kw, match in [
        ({"rank": 2, "world_size": 2}, "rank=2"),
        ({"rank": -1, "world_size": 2}, "rank=-1"),
        ({"rank": 0, "world_size": 0}, "world_size=0"),
    ]:
        with pytest.raises(ValueError, match=match):
            L(np.arange(8), batch_size=2, **kw)
    with pytest.raises(ValueError, match="batch_size=0"):
        L(np.arange(8), batch_size=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="no arrays"):
        L(batch_size=2, rank=0, world_size=1)
    # uneven: 3 ranks x 3 of 10 samples: one batch each, the remainder dropped
    assert [len(L(np.arange(10), batch_size=3, rank=r, world_size=3)) for r in range(3)] == [1] * 3
    # non-contiguous inputs, no shuffle: the plain order; batches do not alias the inputs
    a, b = np.arange(16.0).reshape(8, 2)[:, 0], np.arange(8)[::-1]
    got = list(L(a, b, batch_size=2, shuffle=False, rank=1, world_size=2))
    assert [g[0].tolist() for g in got] == [[4.0, 6.0], [12.0, 14.0]]
    assert [g[1].tolist() for g in got] == [[5, 4], [1, 0]]
    got[0][0][0] = 99.0
    assert a[2] == 4.0
    # pydiff and torch tensors in, NumPy out; multi-dim samples
    assert list(
        L(pydiff.tensor(np.arange(4.0)), batch_size=4, shuffle=False, rank=0, world_size=1)
    )[0][0].tolist() == [0, 1, 2, 3]
    shapes = [
        x.shape
        for bt in L(np.zeros((10, 3, 2)), np.zeros(10), batch_size=2, rank=1, world_size=2)
        for x in bt
    ]
    assert shapes == [(2, 3, 2), (2,)] * 2


@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_ranks_together_are_one_process_every_epoch(shuffle):
    x, y = np.arange(103), np.arange(103) * 10
    ranks = [
        dist.ShardedLoader(x, y, batch_size=5, seed=4, shuffle=shuffle, rank=r, world_size=2)
        for r in range(2)
    ]
    one = dist.ShardedLoader(x, y, batch_size=10, seed=4, shuffle=shuffle, rank=0, world_size=1)
    for epoch in (0, 1, 7):
        for loader in (*ranks, one):
            loader.set_epoch(epoch)
        assert len(one) == len(ranks[0]) == len(ranks[1]) == 10
        for (a, ay), (b, by), (w, wy) in zip(*ranks, one):
            assert np.array_equal(np.concatenate([a, b]), w)
            assert np.array_equal(np.concatenate([ay, by]), wy) and np.array_equal(wy, w * 10)
        assert [t[0].tolist() for t in ranks[0]] == [t[0].tolist() for t in ranks[0]]  # re-iter
    seen = np.concatenate([b[0] for b in one])
    assert len(set(seen.tolist())) == 100


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
