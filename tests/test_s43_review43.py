"""Session 43 review (review43): the LMDB reader-table clearing (pydiff.lmdb_readers) on a
lock file built here independently of pydiff, with a real glibc robust process-shared mutex
where LMDB keeps its reader-table mutex (byte 24), and the edges of the mutex: held by a live
process (no hang), left by a dead one (EOWNERDEAD recovered), an error while it is held after
EOWNERDEAD (the mutex must stay usable by LMDB), readers alive in another pid namespace (an
fcntl lock at their pid's byte, no such process here)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pydiff import lmdb_readers

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or struct.calcsize("P") != 8,
    reason="LMDB's lock layout as checked here: x86-64 Linux",
)

# LMDB 0.9.22+'s lock file, written out here: magic, format, txnid u64 at 8, numreaders u32 at
# 16, the reader mutex (glibc pthread_mutex_t, 40 bytes) at 24, the writer mutex's block at
# 64, 64-byte reader records from 128 (txnid u64, pid i32 at +8, tid u64 at +16).
MAGIC, FORMAT = 0xBEEFC0DE, 0x2C2F6002
RMUTEX_AT, HEADER, SLOT = 24, 128, 64
SLOTS = 126


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    for name in (
        "pthread_mutexattr_init",
        "pthread_mutexattr_setpshared",
        "pthread_mutexattr_setrobust",
        "pthread_mutex_init",
        "pthread_mutex_lock",
        "pthread_mutex_trylock",
        "pthread_mutex_unlock",
        "pthread_mutex_consistent",
    ):
        getattr(libc, name).restype = ctypes.c_int
    return libc


def make_lock_file(path: Path, pids: list[int]) -> None:
    """A lock.mdb of ``SLOTS`` records, ``pids`` in the first ones, its reader mutex
    initialised as LMDB does (robust, process-shared)."""
    size = HEADER + SLOT * SLOTS
    data = bytearray(size)
    struct.pack_into("<IIQI", data, 0, MAGIC, FORMAT, 7, len(pids))
    for i, pid in enumerate(pids):
        struct.pack_into("<qi", data, HEADER + SLOT * i, -1, pid)
    path.write_bytes(bytes(data))
    libc = _libc()
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, size)
        anchor = ctypes.c_char.from_buffer(mapped)
        attr = ctypes.create_string_buffer(8)
        assert libc.pthread_mutexattr_init(attr) == 0
        assert libc.pthread_mutexattr_setpshared(attr, 1) == 0  # PTHREAD_PROCESS_SHARED
        assert libc.pthread_mutexattr_setrobust(attr, 1) == 0  # PTHREAD_MUTEX_ROBUST
        for at in (RMUTEX_AT, 64):
            assert (
                libc.pthread_mutex_init(ctypes.c_void_p(ctypes.addressof(anchor) + at), attr) == 0
            )
        del anchor
        mapped.close()
    finally:
        os.close(fd)
    # (what LMDB's lock files hold there: the kind of a robust shared mutex, 0x90)
    assert struct.unpack_from("<i", path.read_bytes(), RMUTEX_AT + 16)[0] == 0x90


def pids_in(path: Path) -> list[int]:
    data = path.read_bytes()
    used = struct.unpack_from("<I", data, 16)[0]
    return [struct.unpack_from("<i", data, HEADER + SLOT * i + 8)[0] for i in range(used)]


def lock_rc(path: Path) -> int:
    """pthread_mutex_trylock's result on the reader mutex (unlocked again where taken)."""
    libc = _libc()
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, os.fstat(fd).st_size)
        anchor = ctypes.c_char.from_buffer(mapped)
        mutex = ctypes.c_void_p(ctypes.addressof(anchor) + RMUTEX_AT)
        rc = libc.pthread_mutex_trylock(mutex)
        if rc == errno.EOWNERDEAD:
            libc.pthread_mutex_consistent(mutex)
        if rc in (0, errno.EOWNERDEAD):
            libc.pthread_mutex_unlock(mutex)
        del anchor
        mapped.close()
        return rc
    finally:
        os.close(fd)


# A process that holds fcntl locks as a live LMDB reader does (byte 0 shared, its pid's byte
# written; ``pid`` given: the byte of a pid of another namespace), optionally takes the reader
# mutex, says "ready", then waits for stdin to close or exits holding the mutex.
HOLDER = textwrap.dedent(
    """
    import ctypes, fcntl, mmap, os, struct, sys
    path, byte, take, then = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    byte = os.getpid() if byte < 0 else byte
    fd = os.open(path, os.O_RDWR)
    fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack("hhqqi4x", fcntl.F_RDLCK, 0, 0, 1, 0))
    fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, byte, 1, 0))
    if take:
        libc = ctypes.CDLL(None)
        mapped = mmap.mmap(fd, os.fstat(fd).st_size)
        anchor = ctypes.c_char.from_buffer(mapped)
        assert libc.pthread_mutex_lock(ctypes.c_void_p(ctypes.addressof(anchor) + 24)) == 0
    print("ready", flush=True)
    if then == "exit":
        os._exit(0)
    if then == "release":  # (on a line from stdin)
        sys.stdin.readline()
        libc.pthread_mutex_unlock(ctypes.c_void_p(ctypes.addressof(anchor) + 24))
        take = False
        print("released", flush=True)
    sys.stdin.read()
    if take:  # (before the mapping goes: unlocked, not left to the robust list)
        libc.pthread_mutex_unlock(ctypes.c_void_p(ctypes.addressof(anchor) + 24))
    os._exit(0)
    """
)


def start_holder(path: Path, byte: int | None = None, take: bool = False, then: str = "wait"):
    """``byte`` None: its own pid's byte, as LMDB locks it."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLDER,
            str(path),
            str(-1 if byte is None else byte),
            str(int(take)),
            then,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def dead_pid() -> int:
    """A pid no process has here (one that just ended)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    pid = proc.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


def unused_pid_of_other_namespace() -> int:
    """A pid number no process has here, as a live reader in another pid namespace has it."""
    for pid in range(4_000_000, 100_000, -7919):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            continue
    pytest.skip("no unused pid found")


@pytest.fixture
def lock(tmp_path):
    return tmp_path / "lock.mdb"


def test_dead_cleared_live_kept_including_another_namespaces(lock):
    """Dead: no fcntl lock at its byte and no such process. A reader of another pid namespace
    (its byte locked, its pid not a process here) and a live local reader are kept."""
    gone, other = dead_pid(), unused_pid_of_other_namespace()
    make_lock_file(lock, [gone, other, gone, 0])
    local = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        # the local reader's slot: its pid (no fcntl lock of its own: a pid reused here)
        make_lock_file(lock, [gone, other, gone, local.pid])
        holder = start_holder(lock, byte=other)  # holds byte 0 and the other namespace's pid
        try:
            table = lmdb_readers.inspect(lock)
            assert table is not None and table.open
            assert table.dead == {gone: 2}
            assert table.live == {other: 1, local.pid: 1}
            assert lmdb_readers.clear_dead(lock) == 2
            assert pids_in(lock) == [0, other, 0, local.pid]
            assert lock_rc(lock) == 0
        finally:
            holder.stdin.close()
            holder.wait(30)
    finally:
        local.stdin.close()
        local.wait(30)


def test_a_mutex_held_by_a_live_process_is_waited_for_then_given_up(lock):
    gone = dead_pid()
    make_lock_file(lock, [gone])
    holder = start_holder(lock, byte=None, take=True)
    try:
        t0 = time.monotonic()
        assert lmdb_readers.clear_dead(lock, wait_s=0.5) is None
        took = time.monotonic() - t0
        assert 0.4 < took < 5.0, took
        assert pids_in(lock) == [gone]  # untouched
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert lock_rc(lock) == 0


def test_a_mutex_left_by_a_dead_holder_is_recovered(lock):
    gone = dead_pid()
    make_lock_file(lock, [gone])
    holder = start_holder(lock, byte=None, take=True, then="exit")
    holder.wait(30)
    assert lmdb_readers.clear_dead(lock) == 1
    assert pids_in(lock) == [0]
    assert lock_rc(lock) == 0  # consistent again: LMDB takes it as usual


def test_an_error_after_eownerdead_leaves_the_mutex_usable(lock, monkeypatch):
    """A failure while the recovered mutex is held (here the scan's fcntl raising, as ENOLCK on
    a network file system does) must not leave it unrecoverable: glibc makes a robust mutex
    unlocked without pthread_mutex_consistent ENOTRECOVERABLE for good, and every LMDB
    process then fails to take a reader slot until all of them close the database."""
    make_lock_file(lock, [dead_pid()])
    holder = start_holder(lock, byte=None, take=True, then="exit")
    holder.wait(30)

    def failing_scan(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lmdb_readers, "_scan", failing_scan)
    assert lmdb_readers.clear_dead(lock) is None
    rc = lock_rc(lock)
    assert rc != errno.ENOTRECOVERABLE, "the reader mutex was left unrecoverable"
    assert rc in (0, errno.EOWNERDEAD)


def other_process_lock_rc(path: Path) -> int:
    """pthread_mutex_trylock's result on the reader mutex, in another process (as LMDB's)."""
    code = textwrap.dedent(
        """
        import ctypes, errno, mmap, os, sys
        libc = ctypes.CDLL(None)
        fd = os.open(sys.argv[1], os.O_RDWR)
        mapped = mmap.mmap(fd, os.fstat(fd).st_size)
        anchor = ctypes.c_char.from_buffer(mapped)
        mutex = ctypes.c_void_p(ctypes.addressof(anchor) + 24)
        rc = libc.pthread_mutex_trylock(mutex)
        if rc == errno.EOWNERDEAD:
            libc.pthread_mutex_consistent(mutex)
        if rc in (0, errno.EOWNERDEAD):
            libc.pthread_mutex_unlock(mutex)
        print(rc)
        os._exit(0)
        """
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    return int(out.stdout)


def test_ctrl_c_while_waiting_for_the_mutex_never_leaves_it_locked(lock):
    """SIGINT arriving while clear_dead waits for the mutex: Python raises KeyboardInterrupt
    right after the C call returns, the mutex taken. Left locked, every LMDB process of the
    cache would wait for it for good (LMDB takes it without a timeout), even after this one
    ends (the mapping gone, the kernel cannot mark the owner dead)."""
    import signal
    import threading

    gone = dead_pid()
    make_lock_file(lock, [gone])
    holder = start_holder(lock, byte=None, take=True, then="release")
    main = threading.get_ident()

    def interrupt_then_release():
        time.sleep(0.3)
        signal.pthread_kill(main, signal.SIGINT)  # (during the wait)
        time.sleep(0.3)
        holder.stdin.write("go\n")
        holder.stdin.flush()

    helper = threading.Thread(target=interrupt_then_release)
    # Python's own Ctrl-C handler, whatever this process inherited: a process started in the
    # background of a shell without job control ignores SIGINT (POSIX), and Python keeps an
    # ignored SIGINT ignored ("DID NOT RAISE" in a CI run started so, session 48).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            lmdb_readers.clear_dead(lock, wait_s=10.0)
            time.sleep(5.0)  # (where clear_dead returned first: the interrupt comes here)
        helper.join()
        assert holder.stdout.readline().strip() == "released"
        deadline = time.monotonic() + 10.0
        while (rc := other_process_lock_rc(lock)) == errno.EBUSY and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rc == 0, f"the reader mutex was left locked (trylock: {errno.errorcode[rc]})"
    finally:
        signal.signal(signal.SIGINT, previous)
        holder.stdin.close()
        holder.wait(30)


def test_no_process_can_reset_the_table_while_it_is_cleared(lock, monkeypatch):
    """LMDB resets the lock file (mutexes initialised anew, the reader count 0, then new
    readers' pids written into the records) when a process opening the database takes byte 0
    of it exclusively (an fcntl write lock): no other process has it open. Every process with
    it open holds a shared lock there; clear_dead must too while it works on the table, or a
    process opening meanwhile resets it under the mutex it holds, claims slots with the new
    mutex, and a slot read as dead is cleared after a live reader took it."""
    make_lock_file(lock, [dead_pid()])
    probe = textwrap.dedent(
        """
        import fcntl, os, struct, sys
        fd = os.open(sys.argv[1], os.O_RDWR)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 1, 0))
            print("exclusive")
        except OSError:
            print("shared")
        """
    )
    seen = []
    real_scan = lmdb_readers._scan

    def scan_while_another_opens(*args):
        out = subprocess.run(
            [sys.executable, "-c", probe, str(lock)], capture_output=True, text=True
        )
        seen.append(out.stdout.strip())
        return real_scan(*args)

    monkeypatch.setattr(lmdb_readers, "_scan", scan_while_another_opens)
    assert lmdb_readers.clear_dead(lock) == 1
    assert seen == ["shared"], "a process opening the database could reset its lock file"


# --- the pool's cached SlangPy tensors (eager43) ----------------------------------------


def _drop():
    import gc

    gc.collect()


def test_a_cached_tensor_repointed_through_slangpy_is_not_handed_out():
    """``Tensor.native`` is SlangPy's tensor, whose ``point_to`` makes it refer to another
    tensor's storage in place. The pool must not hand such a tensor out again as a new
    tensor's: two live tensors would share one buffer (zeros() wiping another's values)."""
    import numpy as np

    import pydiff

    other = pydiff.tensor(np.full(8, 7.0, np.float32))
    for _ in range(3):  # (whichever pooled buffer the next one takes)
        a = pydiff.tensor(np.arange(8, dtype=np.float32))
        a.native.point_to(other.native)
        del a
        _drop()
        b = pydiff.zeros((8,))
        np.testing.assert_array_equal(b.numpy(), np.zeros(8))
        np.testing.assert_array_equal(other.numpy(), np.full(8, 7.0))
        assert b.native.storage is not other.native.storage
        del b


def test_a_cached_tensor_given_gradients_through_slangpy_is_not_handed_out():
    """SlangPy's ``grad_in``/``grad_out`` setters change a tensor in place: a pooled tensor
    that was given another tensor's buffers as its gradients must not come back as a new
    tensor's (it would carry them: a new tensor with a gradient it never asked for)."""
    import numpy as np

    import pydiff

    g = pydiff.tensor(np.full(8, 3.0, np.float32))
    for _ in range(3):
        a = pydiff.tensor(np.arange(8, dtype=np.float32))
        a.native.grad_out = g.native
        a.native.grad_in = g.native
        del a
        _drop()
        b = pydiff.zeros((8,))
        assert b.native.grad_out is None and b.native.grad_in is None
        np.testing.assert_array_equal(b.numpy(), np.zeros(8))
        del b
