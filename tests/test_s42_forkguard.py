"""fork() in a process with a pydiff device open: never a hang (pydiff/forkguard.py).

Before: a forked child hung at exit in SlangPy's atexit callback closing the inherited
device (``sgl::Device::close_all_devices`` -> ``CommandQueueImpl::waitOnHost``: lavapipe's
queue thread stays in the parent), and on any use of an inherited tensor; with that callback
gone, in SlangPy's module teardown (``sgl::static_shutdown``) and Mesa's exit handler
(``util_queue``'s, joining the parent's shader-cache threads). Now an inherited tensor raises
``DeviceUnavailableError`` saying what to do, a new device in the child works, and every
child exits with its status.

Every case runs in a subprocess (a hang is a failure, not a stuck suite), whose script
forks with a deadline of its own and kills a child past it. Mesa's shader cache is a fresh
folder per script: the parent's compiles then grow lavapipe's cache-writer threads, the
state in which Mesa's exit handler hung. Values are checked against NumPy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pydiff import slangpy_loader

# Helpers every script starts with: a device and tensor in the parent, `fork_run(fn)`
# (runs fn in a forked child that reports a JSON result on a pipe, then leaves as fn says;
# a child past the deadline is killed and reported as hung).
PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time, traceback
    import numpy as np
    FIRST = os.environ.get("FG_FIRST")
    if FIRST:
        __import__(FIRST)            # e.g. slangpy before pydiff
    import pydiff
    from pydiff import ops
    dev = pydiff.create_device("vulkan", cache_dir=os.environ["FG_CACHE"])
    x = pydiff.tensor(np.array([0.5, 1.0, 2.0], np.float32), device=dev)
    assert np.allclose(ops.exp(x).numpy(), np.exp([0.5, 1.0, 2.0]), rtol=1e-6)
    results = {}

    def fork_run(name, fn, leave="sys.exit", deadline=float(os.environ.get("FG_DEADLINE", 90))):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                out = fn()
            except Exception as exc:
                out = {"error": type(exc).__name__, "message": str(exc),
                       "trace": traceback.format_exc()[-1500:]}
            os.write(w, json.dumps(out).encode())
            os.close(w)
            if leave == "sys.exit":
                sys.exit(7)
            return  # (leave == "return": the child runs the rest of the script, then exits)
        os.close(w)
        end = time.monotonic() + deadline
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > end:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                status = None
                break
            time.sleep(0.05)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.close(r)
        code = None if status is None else os.waitstatus_to_exitcode(status)
        results[name] = {"status": code, "hung": status is None,
                         "out": json.loads(data) if data else None}
    """
)

FORKS = PRELUDE + textwrap.dedent(
    """
    SRC = "[Differentiable] float sq(float v) { return v * v; }"
    m = pydiff.load_module_from_source("fg_sq", SRC, device=dev)
    assert np.allclose(m.sq(v=x, _result="tensor").numpy(), [0.25, 1.0, 4.0])

    def nothing():
        return {"ok": True}

    def use_inherited():
        errors = {}
        for what, use in [
            ("numpy", lambda: x.numpy()),
            ("exp", lambda: ops.exp(x).numpy()),
            ("add", lambda: (x + 1.0).numpy()),
            ("device.flush", lambda: x.device.flush()),
            ("new tensor on it", lambda: pydiff.tensor([1.0], device=dev).numpy()),
            ("module call", lambda: m.sq(v=x, _result="tensor").numpy()),
        ]:
            try:
                use()
                errors[what] = None
            except pydiff.DeviceUnavailableError as exc:
                errors[what] = str(exc)
        return {"errors": errors, "repr": repr(dev), "isinstance": isinstance(dev, pydiff.Device)}

    def new_device():
        d2 = pydiff.default_device()           # a device of this process, not the parent's
        d3 = pydiff.create_device("vulkan", cache_dir=os.environ["FG_CACHE"])  # parent's cache
        a = np.array([0.25, -1.5, 3.0], np.float32)
        y = pydiff.tensor(a, device=d2, requires_grad=True)
        with pydiff.Tape() as tape:
            z = ops.exp(y)
        tape.backward(z, grad=np.ones(3, np.float32))
        w = ops.sin(pydiff.tensor(a, device=d3)).numpy()
        return {"fresh": d2 is not dev and d3 is not dev, "exp": z.numpy().tolist(),
                "caches": [d2.cache_paths, d3.cache_paths],
                "grad": y.grad.numpy().tolist(), "sin": w.tolist()}

    def grandchild():
        fork_run("grandchild", nothing)
        return results["grandchild"]

    fork_run("exit", nothing)
    fork_run("use", use_inherited)
    fork_run("new", new_device)
    fork_run("nested", grandchild)
    fork_run("return", nothing, leave="return")   # the child runs on to the script's end
    if "return" in results:                        # (the parent: the child ended above)
        results["parent"] = ops.exp(x).numpy().tolist()
        results["parent_type"] = type(dev).__name__
        print("RESULTS " + json.dumps(results))
    """
)


def _run(script: str, tmp_path, env_extra: dict | None = None, timeout: float = 400) -> dict:
    path = tmp_path / "fg_script.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYDIFF_CACHE")}
    mesa = tmp_path / "mesa-cache"
    mesa.mkdir(exist_ok=True)
    env.update(MESA_SHADER_CACHE_DIR=str(mesa), FG_CACHE=str(tmp_path / "cache"))
    env.update(env_extra or {})
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/",  # not the checkout: pydiff comes from PYTHONPATH / the installed package
        start_new_session=True,  # (a timeout kills the script and any child it left)
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the script hung past {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    lines = [line for line in out.splitlines() if line.startswith("RESULTS ")]
    assert lines, f"no results\n{out[-2000:]}\n{err[-3000:]}"
    assert "MDB_" not in err and "Failed to" not in err, err[-3000:]
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.fixture(scope="module")
def forks(tmp_path_factory, device):
    if device.type != "vulkan":
        pytest.skip("the forked children open Vulkan devices (lavapipe here)")
    return _run(FORKS, tmp_path_factory.mktemp("forks"))


def _ended(result: dict, status: int = 7) -> dict:
    assert not result["hung"], result
    assert result["status"] == status, result
    return result["out"]


@pytest.mark.slow
def test_a_child_that_never_uses_pydiff_exits_with_its_status(forks):
    assert _ended(forks["exit"]) == {"ok": True}


@pytest.mark.slow
def test_an_inherited_tensor_raises_saying_what_to_do(forks):
    out = _ended(forks["use"])
    assert "error" not in out, out
    for what, message in out["errors"].items():
        assert message is not None, f"{what} ran on the parent's device"
        assert "before this process was forked" in message, message
        assert "pydiff.create_device" in message and "'spawn'" in message, message
    assert out["isinstance"] and "before fork()" in out["repr"], out


@pytest.mark.slow
def test_a_new_device_in_the_child_computes_right(forks):
    out = _ended(forks["new"])
    assert "error" not in out, out
    a = np.array([0.25, -1.5, 3.0])
    assert out["fresh"]
    # No persistent cache in a forked child: one that ends without closing its device would
    # keep its reader slots in the shared shader database (MDB_READERS_FULL for every process
    # after about a hundred such children, while the parent kept the database open).
    assert out["caches"] == [None, None]
    np.testing.assert_allclose(out["exp"], np.exp(a), rtol=1e-6)
    np.testing.assert_allclose(out["grad"], np.exp(a), rtol=1e-6)  # d/dy exp(y)
    np.testing.assert_allclose(out["sin"], np.sin(a), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_child_of_a_child_exits(forks):
    inner = _ended(forks["nested"])
    assert inner["status"] == 7 and not inner["hung"], inner


@pytest.mark.slow
def test_a_child_that_runs_to_the_end_of_the_script_exits(forks):
    assert _ended(forks["return"], status=0) == {"ok": True}


@pytest.mark.slow
def test_the_parent_keeps_working_after_its_children(forks):
    np.testing.assert_allclose(forks["parent"], np.exp([0.5, 1.0, 2.0]), rtol=1e-6)
    assert forks["parent_type"] == "Device"  # (the class changes in children only)


POOL = PRELUDE + textwrap.dedent(
    """
    import multiprocessing as mp

    def square(v):
        return v * v

    def inherited(v):
        return ops.exp(x).numpy().tolist()

    def own_device(v):
        return ops.exp(pydiff.tensor(np.full(2, v, np.float32))).numpy().tolist()

    ctx = mp.get_context("fork")
    with ctx.Pool(2) as pool:
        results["squares"] = pool.map(square, range(8))
        results["own"] = pool.map(own_device, [0.5, 1.5])
        try:
            pool.map(inherited, [0])
            results["inherited"] = None
        except pydiff.DeviceUnavailableError as exc:
            results["inherited"] = str(exc)
    def exits():
        p = ctx.Process(target=square, args=(3,))
        p.start()
        p.join(60)
        return p.exitcode
    results["process_exitcode"] = exits()
    results["parent"] = ops.exp(x).numpy().tolist()
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.mark.slow
def test_multiprocessing_fork_workers(tmp_path, device):
    if device.type != "vulkan":
        pytest.skip("the workers open Vulkan devices (lavapipe here)")
    out = _run(POOL, tmp_path)
    assert out["squares"] == [v * v for v in range(8)]
    np.testing.assert_allclose(out["own"], np.exp([[0.5, 0.5], [1.5, 1.5]]), rtol=1e-6)
    assert out["inherited"] and "before this process was forked" in out["inherited"]
    assert out["process_exitcode"] == 0
    np.testing.assert_allclose(out["parent"], np.exp([0.5, 1.0, 2.0]), rtol=1e-6)


LOADER = PRELUDE + textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Plain(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return torch.tensor([float(i), float(i) ** 2])

    batches = DataLoader(Plain(), batch_size=4, num_workers=2)
    results["sum"] = float(sum(b.sum() for b in batches))
    results["parent"] = ops.exp(x).numpy().tolist()
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.mark.slow
def test_torch_dataloader_workers_after_a_device_opened(tmp_path, device):
    pytest.importorskip("torch")
    if device.type != "vulkan":
        pytest.skip("Vulkan (lavapipe) here")
    out = _run(LOADER, tmp_path)
    assert out["sum"] == sum(i + i * i for i in range(16))
    np.testing.assert_allclose(out["parent"], np.exp([0.5, 1.0, 2.0]), rtol=1e-6)


# A native exit handler of the parent that never returns in a child, as Mesa's may not
# (util_queue's: it wakes and joins the parent's lavapipe cache-writer threads, which the
# child does not have; whether it hangs depends on their state at the fork, hence this
# stand-in): pause() until a signal. The parent itself leaves with os._exit.
NATIVE_EXIT = PRELUDE + textwrap.dedent(
    """
    import ctypes
    libc = ctypes.CDLL(None)
    libc.on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]  # (glibc's atexit with status)
    libc.on_exit(ctypes.cast(libc.pause, ctypes.c_void_p), None)

    def new_device():
        d2 = pydiff.create_device("vulkan", cache_dir=False)
        return ops.exp(pydiff.tensor([1.0], device=d2)).numpy().tolist()

    fork_run("exit", lambda: {"ok": True})
    fork_run("new", new_device)
    results["parent"] = ops.exp(x).numpy().tolist()
    print("RESULTS " + json.dumps(results), flush=True)
    os._exit(0)
    """
)


@pytest.mark.slow
def test_the_childs_exit_skips_native_exit_handlers_of_the_parent(tmp_path, device):
    if device.type != "vulkan":
        pytest.skip("Vulkan (lavapipe) here")
    out = _run(NATIVE_EXIT, tmp_path)
    assert _ended(out["exit"]) == {"ok": True}
    np.testing.assert_allclose(_ended(out["new"]), [np.e], rtol=1e-6)
    np.testing.assert_allclose(out["parent"], np.exp([0.5, 1.0, 2.0]), rtol=1e-6)


EXIT_ONLY = PRELUDE + textwrap.dedent(
    """
    fork_run("exit", lambda: {"ok": True})
    results["parent"] = ops.exp(x).numpy().tolist()
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.mark.slow
def test_slangpy_imported_before_pydiff(tmp_path, device):
    """SlangPy's exit callback is then found among all objects, not as SlangPy loads."""
    if device.type != "vulkan":
        pytest.skip("Vulkan (lavapipe) here")
    out = _run(EXIT_ONLY, tmp_path, {"FG_FIRST": "slangpy"})
    assert _ended(out["exit"]) == {"ok": True}
    np.testing.assert_allclose(out["parent"], np.exp([0.5, 1.0, 2.0]), rtol=1e-6)


def test_slangpys_exit_callback_is_known():
    hook = slangpy_loader.exit_hook()
    assert hook is not None and type(hook).__name__ == "nb_func"
    assert hook.__nb_signature__ == (("def () -> None", None, None),)
