"""Session 43 (lmdb43): the shader cache's LMDB reader table cleared of dead processes' slots
(no more MDB_READERS_FULL while one process keeps the cache open), module-level locks renewed
in a forked child, and a backend-aware refusal of a device inherited through fork().

Every case runs pydiff in fresh processes with a private cache folder (PYDIFF_CACHE_DIR under
tmp_path), never the shared ~/.cache/pydiff; values are checked against closed forms."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240
FULL = "maxreaders limit reached"  # (SlangPy's error for each lookup and store)

# LMDB's lock-file layout as liblmdb 0.9.22+ defines it (MDB_txninfo/MDB_reader), written out
# here independently of pydiff: the reader count at 16, 64-byte records from 128, pid at +8.
NUMREADERS_AT, HEADER, SLOT, PID_AT = 16, 128, 64, 8

# f(x) = 3 x^2 + c: value and derivative in closed form.
COMPUTE = """
def compute(c):
    m = pydiff.load_module_from_source(
        f"m{int(c)}", f"[Differentiable] float f(float x) {{ return 3.0 * x * x + {c}; }}"
    )
    x = pydiff.tensor([2.0, -1.0], requires_grad=True)
    y = m.f(x, _result="tensor")
    m.f.bwds(x, _result=y.with_grads(ones=True))
    return [y.numpy().tolist(), x.grad.numpy().tolist()]
"""

# Opens the default device, computes, then waits for commands on stdin: "compute C" (a new
# module: cache lookups and stores while the table is being cleared around it), "end".
HOLDER = (
    "import json, os, sys\nimport pydiff\n"
    + COMPUTE
    + textwrap.dedent(
        """
    print(json.dumps(["ready", os.getpid(), compute(1.0)]), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "compute":
            print(json.dumps(["done", compute(float(cmd[1]))]), flush=True)
        else:
            break
    """
    )
)

# Computes, then dies without closing its device.
DIES = (
    "import os, signal, sys\nimport pydiff\n"
    + COMPUTE
    + textwrap.dedent(
        """
    compute(1.0)
    sys.stdout.flush()
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)
    """
    )
)

FRESH = (
    "import json, warnings\nwarnings.simplefilter('always')\nimport pydiff\n"
    + COMPUTE
    + "print(json.dumps(compute(5.0)))\n"
)


def _expected(c: float) -> list:
    return [[12.0 + c, 3.0 + c], [12.0, -6.0]]


def _env(cache: Path) -> dict:
    env = {**os.environ, "PYDIFF_CACHE_DIR": str(cache), "PYDIFF_DEVICE": "vulkan"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PYDIFF_CACHE", None)
    return env


def _run(code: str, cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=_env(cache),
        timeout=TIMEOUT,
        cwd="/",
    )


def _lock_file(cache: Path) -> Path:
    found = sorted(cache.glob("slangpy-*/vulkan/shaders/*/lock.mdb"))
    assert found, f"no shader database under {cache}"
    return found[0]


def _read_table(lock: Path) -> tuple[int, int, list[int]]:
    data = lock.read_bytes()
    used = struct.unpack_from("<I", data, NUMREADERS_AT)[0]
    slots = (len(data) - HEADER) // SLOT
    pids = [struct.unpack_from("<i", data, HEADER + SLOT * i + PID_AT)[0] for i in range(used)]
    return slots, used, pids


def _dead_pids(n: int) -> list[int]:
    """Pids of processes that have ended and been reaped (held by no process now)."""
    pids = []
    for _ in range(n):
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        pids.append(p.pid)
    return pids


def _fill_with(lock: Path, pids: list[int]) -> int:
    """Every free slot of the table taken by one of ``pids`` (as processes that died holding
    their slots leave it), the reader count at the table's size; returns the slots filled."""
    import mmap

    with open(lock, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        used = struct.unpack_from("<I", m, NUMREADERS_AT)[0]
        slots, filled = (len(m) - HEADER) // SLOT, 0
        for i in range(slots):
            at = HEADER + SLOT * i
            if i >= used or struct.unpack_from("<i", m, at + PID_AT)[0] == 0:
                struct.pack_into("<Qi", m, at, 2**64 - 1, pids[filled % len(pids)])
                filled += 1
        struct.pack_into("<I", m, NUMREADERS_AT, slots)
        m.close()
    return filled


class Holder:
    """A process that keeps its device (and so the shader database) open."""

    def __init__(self, cache: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(cache),
            cwd="/",
        )
        tag, self.pid, values = self.read()
        assert tag == "ready" and values == _expected(1.0)

    def read(self):
        deadline = time.monotonic() + TIMEOUT
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                line = self.proc.stdout.readline()
                assert line, self.finish()
                return json.loads(line)
            assert self.proc.poll() is None, self.finish()
        raise AssertionError("holder timed out")

    def compute(self, c: float):
        self.proc.stdin.write(f"compute {c}\n")
        self.proc.stdin.flush()
        return self.read()

    def finish(self) -> str:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("end\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read()


@pytest.fixture
def holder(tmp_path):
    h = Holder(tmp_path / "cache")
    yield h
    h.finish()


def _leave_dead_readers(cache: Path, holder: Holder) -> tuple[Path, list[int]]:
    """Real processes that die without closing their device (SIGKILL, os._exit): their slots
    stay taken while the holder keeps the database open."""
    lock = _lock_file(cache)
    for how in ("kill", "exit"):
        out = _run(DIES, cache, how)
        assert out.returncode == (-signal.SIGKILL if how == "kill" else 0), out.stderr[-2000:]
    slots, used, pids = _read_table(lock)
    assert slots == 126 and holder.pid in pids  # the layout read as liblmdb defines it
    dead = sorted({p for p in pids if p != holder.pid})
    assert len(dead) == 2, pids
    return lock, dead


def test_readers_of_live_and_dead_processes_told_apart(tmp_path, holder):
    from pydiff import lmdb_readers

    lock, dead = _leave_dead_readers(tmp_path / "cache", holder)
    table = lmdb_readers.inspect(lock)
    assert table is not None and table.open and table.slots == 126
    assert set(table.live) == {holder.pid} and sorted(table.dead) == dead
    assert table.free == 126 - sum(table.live.values()) - sum(table.dead.values()) > 100
    assert lmdb_readers.make_room(lock.parent.parent).cleared == 0  # (room enough: untouched)
    assert lmdb_readers.clear_dead(lock) == sum(table.dead.values())
    after = lmdb_readers.inspect(lock)
    assert after.live == table.live and after.dead == {}


def test_dead_readers_are_cleared_so_a_new_process_uses_the_cache(tmp_path, holder):
    cache = tmp_path / "cache"
    lock, dead = _leave_dead_readers(cache, holder)

    # Dead readers fill the table (what about a hundred workers dying leave).
    _fill_with(lock, dead + _dead_pids(3))
    assert _read_table(lock)[1] == 126 and 0 not in _read_table(lock)[2]

    out = _run(FRESH, cache)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == _expected(5.0)
    assert FULL not in out.stderr, out.stderr[-3000:]
    assert "CacheWarning" not in out.stderr  # (cleared: the same database, no spare)
    _, _, pids = _read_table(lock)
    assert holder.pid in pids and not set(pids) & set(dead)  # only the dead ones freed

    # The process that kept the database open meanwhile still looks up and stores.
    assert holder.compute(7.0) == ["done", _expected(7.0)]
    err = holder.finish()
    assert "MDB_" not in err, err[-3000:]


def test_a_table_full_of_live_readers_moves_the_process_to_a_spare_folder(tmp_path, holder):
    """Slots of live processes are never cleared: a new process takes a spare folder, with
    one warning, rather than failing every lookup."""
    cache = tmp_path / "cache"
    lock = _lock_file(cache)
    # A live process that holds its pid's byte of the lock file, as LMDB's readers do.
    code = textwrap.dedent(
        f"""
        import fcntl, os, sys
        fd = os.open({str(lock)!r}, os.O_RDWR)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, os.getpid())
        print(os.getpid(), flush=True)
        sys.stdin.read()
        """
    )
    live = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        live_pid = int(live.stdout.readline())
        _fill_with(lock, [live_pid])
        before = _read_table(lock)
        out = _run(FRESH, cache)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1]) == _expected(5.0)
        assert FULL not in out.stderr, out.stderr[-3000:]
        assert "reader slots free" in out.stderr and "shaders-spare1" in out.stderr
        assert _read_table(lock) == before  # nothing of a live process cleared
        assert (lock.parent.parent.with_name("shaders-spare1") / "rhi" / "data.mdb").exists()
    finally:
        live.stdin.close()
        live.wait(timeout=30)


def test_processes_opening_at_once_on_a_table_of_dead_readers_all_use_the_cache(
    tmp_path, holder, monkeypatch
):
    """Several processes find the table full at once: one clears it, the others find it
    cleared (none moves to a spare folder, none fails a lookup)."""
    from pydiff import lmdb_readers

    cache = tmp_path / "cache"
    lock = _lock_file(cache)
    # Deterministically: the slots freed by another process between the look and the clear.
    _fill_with(lock, _dead_pids(2))
    real = lmdb_readers.clear_dead

    def cleared_by_another(path, *args):
        real(path, *args)
        return 0

    monkeypatch.setattr(lmdb_readers, "clear_dead", cleared_by_another)
    outcome = lmdb_readers.make_room(lock.parent.parent)
    assert not outcome.full and outcome.table.free > 100
    monkeypatch.undo()

    for _ in range(2):
        _fill_with(lock, _dead_pids(3))
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", FRESH],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(cache),
                cwd="/",
            )
            for _ in range(3)
        ]
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, err[-3000:]
            assert json.loads(out.strip().splitlines()[-1]) == _expected(5.0)
            assert FULL not in err and "reader slots free" not in err, err[-3000:]
    assert holder.compute(9.0) == ["done", _expected(9.0)]


@pytest.mark.parametrize(
    "damage", ["format", "magic", "short", "odd_size", "too_many_readers", "empty"]
)
def test_a_lock_file_of_another_layout_is_left_alone(tmp_path, damage):
    from pydiff import lmdb_readers

    shaders = tmp_path / "shaders"
    (shaders / "rhi").mkdir(parents=True)
    lock = shaders / "rhi" / "lock.mdb"
    data = bytearray(HEADER + SLOT * 126)
    struct.pack_into("<IIQI", data, 0, 0xBEEFC0DE, lmdb_readers.LOCK_FORMAT, 5, 126)
    for i, pid in enumerate(_dead_pids(1) * 126):
        struct.pack_into("<Qi", data, HEADER + SLOT * i, 2**64 - 1, pid)
    if damage == "format":
        struct.pack_into("<I", data, 4, 0x10001)  # LMDB before 0.9.22: another header
    elif damage == "magic":
        struct.pack_into("<I", data, 0, 0xDEADBEEF)
    elif damage == "short":
        data = data[:100]
    elif damage == "odd_size":
        data += b"\0" * 7
    elif damage == "too_many_readers":
        struct.pack_into("<I", data, NUMREADERS_AT, 127)
    else:
        data = bytearray()
    lock.write_bytes(bytes(data))
    assert lmdb_readers.inspect(lock) is None
    assert lmdb_readers.clear_dead(lock) is None
    outcome = lmdb_readers.make_room(shaders)
    assert outcome.cleared == 0 and not outcome.full
    assert lock.read_bytes() == bytes(data)


def test_a_database_no_process_has_open_is_left_to_lmdb(tmp_path):
    """LMDB resets the reader table itself when it opens a database no other process has
    open: nothing to clear then (and nothing written)."""
    from pydiff import lmdb_readers

    shaders = tmp_path / "shaders"
    (shaders / "rhi").mkdir(parents=True)
    lock = shaders / "rhi" / "lock.mdb"
    data = bytearray(HEADER + SLOT * 126)
    struct.pack_into("<IIQI", data, 0, 0xBEEFC0DE, lmdb_readers.LOCK_FORMAT, 5, 126)
    for i, pid in enumerate(_dead_pids(1) * 126):
        struct.pack_into("<Qi", data, HEADER + SLOT * i, 2**64 - 1, pid)
    lock.write_bytes(bytes(data))
    table = lmdb_readers.inspect(lock)
    assert table is not None and not table.open and sum(table.dead.values()) == 126
    outcome = lmdb_readers.make_room(shaders)
    assert outcome.cleared == 0 and not outcome.full
    assert lock.read_bytes() == bytes(data)


# The parent opens a device and computes; another thread then holds every module-level lock
# of pydiff's call layer while the main thread forks; the child opens its own device and runs
# a generated-kernel forward call and .bwds (generated._lock) through the full path
# (arguments._passed_lock), checked against the closed form.
FORK_WHILE_HELD = textwrap.dedent(
    """
    import importlib, json, os, sys, threading, time
    import numpy as np
    import pydiff

    SRC = "[Differentiable] float f(float x) { return 3.0 * x * x + 1.0; }"
    xs = np.linspace(-1.0, 1.0, 8192).astype(np.float32)

    def run(tag):
        m = pydiff.load_module_from_source(tag, SRC)
        x = pydiff.tensor(xs, requires_grad=True)
        y = m.f(x, _result="tensor")
        m.f.bwds(x, _result=y.with_grads(ones=True))
        ok_y = np.allclose(y.numpy(), 3.0 * xs.astype(np.float64) ** 2 + 1.0, rtol=1e-6)
        ok_g = np.allclose(x.grad.numpy(), 6.0 * xs.astype(np.float64), rtol=1e-6, atol=1e-6)
        return bool(ok_y and ok_g)

    assert run("parent")
    names = [("pydiff.generated", "_lock"), ("pydiff.arguments", "_passed_lock"),
             ("pydiff.generated_grid", "_lock")]
    held, release = threading.Event(), threading.Event()

    def hold():
        locks = [getattr(importlib.import_module(mod), n) for mod, n in names]
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in locks:
            lock.release()

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        ok = run("child")  # (hung here when the child kept the parent's held locks)
        free = not any(getattr(importlib.import_module(mod), n).locked() for mod, n in names)
        os._exit(0 if ok and free else 3)
    deadline = time.monotonic() + float(sys.argv[1])
    status = None
    while time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(st)
            break
        time.sleep(0.2)
    if status is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    release.set()
    print(json.dumps({"child": "hung" if status is None else status}))
    """
)


def test_a_forked_child_is_not_stopped_by_locks_another_parent_thread_held(tmp_path):
    out = _run(FORK_WHILE_HELD, tmp_path / "cache", "90")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"child": 0}, out.stderr[-3000:]


def test_renewed_locks_are_registered():
    from pydiff import arguments, fork_locks, generated, generated_grid, torch_passes

    found = fork_locks.registered()
    assert found["pydiff.generated._lock"] is vars(generated)["_lock"]
    assert found["pydiff.generated_grid._lock"] is vars(generated_grid)["_lock"]
    assert found["pydiff.arguments._passed_lock"] is vars(arguments)["_passed_lock"]
    assert found["pydiff.torch_passes._lock"] is vars(torch_passes)["_lock"]
    assert not any(lock.locked() for lock in found.values())


def test_the_fork_refusal_of_a_cuda_device_offers_only_new_processes():
    import pydiff
    from pydiff import forkguard

    cuda = forkguard.refusal_message("<pydiff.Device #1 cuda>", "native", "cuda")
    assert "<pydiff.Device #1 cuda>" in cuda and "(Asked for: .native)" in cuda
    assert "'spawn'" in cuda and "'forkserver'" in cuda and "no CUDA device opens here" in cuda
    assert "default_device" not in cuda and "create_device" not in cuda
    vulkan = forkguard.refusal_message("<pydiff.Device #1 vulkan>", "native", "vulkan")
    assert "pydiff.create_device(...)" in vulkan and "pydiff.default_device()" in vulkan
    assert "'spawn'" in vulkan and "CUDA" not in vulkan

    # A CUDA device as a forked child sees it (made without a GPU): every use says so.
    dev = object.__new__(forkguard.InheritedDevice)
    queue = object.__new__(forkguard.InheritedQueue)
    for obj in (dev, queue):
        object.__setattr__(obj, "forked_from", "<pydiff.Device #3 cuda>")
        object.__setattr__(obj, "forked_type", "cuda")
    object.__setattr__(dev, "type", "cuda")
    for use in (lambda: dev.native, lambda: dev.flush(), lambda: queue.flush()):
        with pytest.raises(pydiff.DeviceUnavailableError) as err:
            use()
        assert "no CUDA device opens here" in str(err.value)
        assert "pydiff.default_device()" not in str(err.value)
    assert dev.type == "cuda" and "unusable here" in repr(dev)


# A parent with a Vulkan device forks; the child's use of it names the device and offers a
# new device of the child's own (the refusal of a device that can be opened again).
FORK_REFUSAL = textwrap.dedent(
    """
    import json, os, time
    import pydiff
    x = pydiff.tensor([1.0, 2.0])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            x.numpy()
            text = "no error"
        except pydiff.DeviceUnavailableError as e:
            text = str(e)
        os.write(w, text.encode())
        os._exit(0)
    os.close(w)
    text = os.read(r, 65536).decode()
    os.waitpid(pid, 0)
    print(json.dumps(text))
    """
)


def test_the_fork_refusal_of_a_vulkan_device_offers_a_new_device(tmp_path):
    out = _run(FORK_REFUSAL, tmp_path / "cache")
    assert out.returncode == 0, out.stderr[-3000:]
    text = json.loads(out.stdout.strip().splitlines()[-1])
    assert "vulkan>" in text and "was opened before this process was forked" in text
    assert "pydiff.default_device()" in text and "CUDA" not in text
