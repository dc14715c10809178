"""Breaker 19 reproducers: pydiff.distributed cases that failed before the fixes (the reasons
kept in MISMATCH_REASONS and the tests' docstrings say what happened then). Public API only.

Two ranks on loopback gloo, each on its own lavapipe device, as in
tests/test_breaker_issue19_ok.py: this file run as a script (``python
tests/test_breaker_issue19.py SCENARIO OUT``); each rank writes OUT/rank{r}.json."""

from __future__ import annotations

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


def _grad_tensor(values, dtype="float"):
    t = pydiff.tensor(np.ones(np.shape(values)), dtype=dtype, requires_grad=True)
    t.grad.copy_from_numpy(np.asarray(values, np.float16 if dtype == "half" else np.float32))
    return t


def _scenario_single_tensor(me, world):
    """broadcast(x) with x one Tensor (not a list): x must take rank 0's values, or raise."""
    x = pydiff.tensor(np.array([1.0, 2.0, 3.0], np.float32) * (me + 1))
    res = {"r": _attempt(lambda: dist.broadcast(x))}
    res["x"] = x.numpy().tolist()
    return res


def _scenario_mismatch(me, world):
    """The ranks list different tensors; each must raise (no abort, no silent divergence)."""
    kind = os.environ["B19_KIND"]
    if kind == "order":  # the same two tensors, listed in another order on rank 1
        b, c = _grad_tensor(np.full(4, 10.0 * (me + 1))), _grad_tensor(np.full(6, 100.0 * (me + 1)))
        ts = [b, c] if me == 0 else [c, b]
    elif kind == "shape":  # (2, 3) on rank 0, (3, 2) on rank 1
        ts = [_grad_tensor(np.full((2, 3) if me == 0 else (3, 2), 1.0 + me))]
    elif kind == "count":  # one tensor on rank 0, two on rank 1, one per bucket
        ts = [_grad_tensor(np.full(4, 1.0 + me)) for _ in range(1 + me)]
    elif kind == "size":  # 4 elements on rank 0, 8 on rank 1
        ts = [_grad_tensor(np.full(4 + 4 * me, 1.0 + me))]
    elif kind == "dtype":  # float on rank 0, half on rank 1
        ts = [_grad_tensor(np.full(4, 1.0 + me), "float" if me == 0 else "half")]
    else:  # "op": mean on rank 0, sum on rank 1
        ts = [_grad_tensor(np.full(4, 1.0 + me))]
    op = "sum" if kind == "op" and me == 1 else "mean"
    bucket = 16 if kind == "count" else 2**20
    res = {"r": _attempt(lambda: dist.all_reduce_grads(ts, op=op, bucket_bytes=bucket))}
    res["grads"] = [t.grad.numpy().ravel().tolist() for t in ts]
    return res


def _scenario_overflow(me, world):
    """mean of finite gradients whose sum overflows but whose mean does not."""
    h = _grad_tensor([40000.0, 60000.0], "half")
    f = _grad_tensor([3e38, -3e38])
    res = {"r": _attempt(lambda: dist.all_reduce_grads([h, f], op="mean"))}
    res["h"], res["f"] = h.grad.numpy().tolist(), f.grad.numpy().tolist()
    return res


def worker(scenario: str, out: Path) -> None:
    scenario_worker(globals(), scenario, out)


# --- the tests ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def launch(scenario: str, out: Path, timeout: float, wait: float = 30.0, extra=None):
    """Run ``scenario`` in 2 ranks; returns [(returncode or 'hung', log, result or None)]."""
    env = {"B19_TIMEOUT": str(timeout), **(extra or {})}
    return launch_scenario(__file__, scenario, out, env, wait)


def test_broadcast_of_a_single_tensor_updates_it_or_refuses(tmp_path):
    (c0, l0, r0), (c1, l1, r1) = launch("single_tensor", tmp_path, timeout=10.0)
    assert c0 == 0 and c1 == 0, (l0, l1)
    if "raised" in r1["r"]:
        assert r1["r"]["raised"] == "TypeError" and "list" in r1["r"]["msg"], r1
    else:
        assert r1["x"] == [1.0, 2.0, 3.0], r1  # rank 0's values


def test_all_reduce_of_a_single_tensor_error_is_about_the_list(device):
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
        x.grad.copy_from_numpy(np.full(4, 2.0, np.float32))
        try:
            dist.all_reduce_grads(x)
        except (TypeError, ValueError) as exc:
            assert "no gradient" not in str(exc), str(exc)
        else:
            assert x.grad.numpy().tolist() == [2.0] * 4
    finally:
        torch.distributed.destroy_process_group()


MISMATCH_REASONS = {
    "order": "tensors listed in another order on rank 1 (4 and 6 elements, same total): "
    "no error, the ranks silently end with different gradients "
    "(mean: b=105 on rank 0, 60 on rank 1)",
    "shape": "a (2, 3) gradient on rank 0 and a (3, 2) one on rank 1 are summed element by "
    "element without a word (DDP checks parameter shapes across ranks)",
    "count": "1 tensor on rank 0, 2 on rank 1 (a bucket each): rank 0 returns normally, "
    "its bucket paired with rank 1's first one; only rank 1 raises",
    "size": "4 elements on rank 0, 8 on rank 1: rank 0 is killed by SIGABRT in gloo "
    "(gloo::EnforceNotMet 'Received data size doesn't match'), no Python exception",
    "dtype": "float on rank 0, half on rank 1: rank 1 is killed by SIGABRT in gloo, no "
    "Python exception",
    "op": "op='mean' on rank 0, op='sum' on rank 1: no error, the ranks end with "
    "different gradients (1.5 vs 3.0)",
}


@pytest.mark.parametrize(
    "kind",
    [pytest.param(k, id=k) for k in MISMATCH_REASONS],
)
def test_ranks_listing_different_tensors_both_raise(tmp_path, kind):
    results = launch("mismatch", tmp_path, timeout=6.0, extra={"B19_KIND": kind})
    for code, log, res in results:
        assert code == 0 and res is not None, (code, log)  # no abort, no hang
        assert res["r"].get("raised") in ("DistributedError", "ValueError"), res
        assert res["r"]["s"] < 6.0 + 4


def test_mean_of_finite_gradients_does_not_overflow(tmp_path):
    (c0, l0, r0), (c1, l1, r1) = launch("overflow", tmp_path, timeout=10.0)
    assert c0 == 0 and c1 == 0, (l0, l1)
    for r in (r0, r1):
        assert r["h"] == [40000.0, 60000.0], r
        np.testing.assert_allclose(r["f"], [3e38, -3e38], rtol=1e-6)


# --- one process: bad arguments must name the parameter ------------------------------------


def _init_bad_timeout(timeout):
    dist.init_process_group(
        timeout=timeout, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    torch.distributed.destroy_process_group()  # accepted: fine too


BAD_ARGS = {
    "bucket_bytes=None": ("bucket_bytes", lambda x: dist.all_reduce_grads([x], bucket_bytes=None)),
    "bucket_bytes='8'": ("bucket_bytes", lambda x: dist.all_reduce_grads([x], bucket_bytes="8")),
    "src='0'": ("src", lambda x: dist.broadcast([x], src="0")),
    "src=0.0": ("src", lambda x: dist.broadcast([x], src=0.0)),  # torch's pybind TypeError
    "seed=None": (
        "seed",
        lambda x: list(
            dist.ShardedLoader(np.arange(8), batch_size=4, seed=None, rank=0, world_size=1)
        ),
    ),
    "seed=-1": (
        "seed",
        lambda x: list(
            dist.ShardedLoader(np.arange(8), batch_size=4, seed=-1, rank=0, world_size=1)
        ),
    ),
    "batch_size=2.0": (
        "batch_size",
        lambda x: dist.ShardedLoader(np.arange(8), batch_size=2.0, rank=0, world_size=1),
    ),
    "set_epoch(-1)": ("epoch", lambda x: _epoch(-1)),
    "0-d array": (
        "arrays",
        lambda x: dist.ShardedLoader(np.float32(3), batch_size=1, rank=0, world_size=1),
    ),
}
BAD_TIMEOUTS = {"timeout=None": None, "timeout='60'": "60", "timeout=inf": float("inf")}


def _epoch(epoch):
    loader = dist.ShardedLoader(np.arange(8), batch_size=4, rank=0, world_size=1)
    loader.set_epoch(epoch)
    list(loader)


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_arguments_name_the_parameter(device, case):
    name, call = BAD_ARGS[case]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        x = pydiff.tensor(np.ones(4, np.float32), device=device, requires_grad=True)
        with pytest.raises((TypeError, ValueError), match=name):
            call(x)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("case", list(BAD_TIMEOUTS))
def test_bad_timeout_types_name_the_parameter(case):
    try:
        _init_bad_timeout(BAD_TIMEOUTS[case])
    except (TypeError, ValueError) as exc:
        assert "timeout" in str(exc), str(exc)


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
