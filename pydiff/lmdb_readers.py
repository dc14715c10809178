"""Dead readers in the reader table of SlangPy's shader cache (an LMDB database), cleared the
way LMDB's own ``mdb_reader_check`` does before a device opens on it.

LMDB gives each thread that reads the database a slot in ``lock.mdb`` (126 in all) and frees
it when the environment is closed. A process that dies without closing its device (SIGKILL,
``os._exit`` in a worker, a crash) keeps its slots; LMDB resets the table only when a process
opens the database while no other has it open, and SlangPy never calls ``mdb_reader_check``.
So while one process keeps its device open (a long test run, a training job's parent), about a
hundred dead workers fill the table, and then every process fails each cache lookup and store
with ``MDB_READERS_FULL`` (seen in a CI run).

The lock file's layout (LMDB 0.9.22 and later, as built into SlangPy 0.43.1 for x86-64 Linux,
checked against lock files SlangPy wrote with live and dead readers): a 64-byte header
(``mtb_magic`` u32 = ``0xBEEFC0DE``, ``mtb_format`` u32, ``mtb_txnid`` u64 at 8,
``mtb_numreaders`` u32 at 16, the reader-table mutex, a glibc robust process-shared
``pthread_mutex_t`` of 40 bytes, at 24), the writer mutex's 64 bytes, then 64-byte reader
records from byte 128 (``mrb_txnid`` u64, ``mrb_pid`` i32 at +8, ``mrb_tid`` at +16).
``mtb_format`` encodes LMDB's lock version and a hash of that layout: any other value, or a
file of another size, and nothing here touches the file.

A reader is dead as LMDB decides it: each process reading the database holds an ``fcntl``
write lock on the byte of the lock file at its pid, so no lock there (``F_GETLK``) means its
process is gone, whatever the pid namespace; pydiff also asks that ``os.kill(pid, 0)`` find no
such process (a pid reused here keeps its slot). Slots are cleared (``mrb_pid`` set to 0, what
``mdb_reader_check`` does) only under the reader-table mutex, which every LMDB process takes
to claim a slot (while holding byte 0 shared, as LMDB's processes do, so that none resets the
table meanwhile; ``pthread_mutex_timedlock``; a holder that died is handled much as LMDB
does: ``EOWNERDEAD``, ``pthread_mutex_consistent`` at once, the check). Where that cannot be
done (the mutex busy for seconds, no such C functions) ``make_room`` says so and the device
takes another shader-cache folder (``compile_cache.prepare``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = 0xBEEFC0DE
#: ``mtb_format`` of the lock files SlangPy 0.43.1's LMDB writes on x86-64 Linux (measured).
LOCK_FORMAT = 0x2C2F6002
HEADER = 128  # the two cache-line-padded mutex blocks
SLOT = 64  # one reader record, padded to a cache line
NUMREADERS_AT = 16
RMUTEX_AT = 24
PID_AT = 8  # in a record
#: Clear dead readers when fewer slots than this are free (a process takes one per thread).
ROOM = 32
LOCK_WAIT_S = 2.0
_F_UNLCK = 2  # (Linux)


@dataclass
class ReaderTable:
    """What ``lock.mdb``'s reader table holds: ``slots`` in all, ``used`` ever taken
    (``mtb_numreaders``), readers per pid of ``live`` and ``dead`` processes, ``open``:
    whether any process has the database open now."""

    slots: int
    used: int
    live: dict[int, int] = field(default_factory=dict)
    dead: dict[int, int] = field(default_factory=dict)
    open: bool = True

    @property
    def free(self) -> int:
        """Slots a new reader can take now."""
        return self.slots - sum(self.live.values()) - sum(self.dead.values())


def _layout_ok(head: bytes, size: int) -> bool:
    if len(head) < HEADER or size < HEADER + SLOT or (size - HEADER) % SLOT:
        return False
    magic, fmt = struct.unpack_from("<II", head, 0)
    used = struct.unpack_from("<I", head, NUMREADERS_AT)[0]
    return magic == MAGIC and fmt == LOCK_FORMAT and used <= (size - HEADER) // SLOT


def _locked_by_other(fd: int, offset: int) -> bool:
    """Whether another process holds an fcntl lock on byte ``offset`` (LMDB's pid check)."""
    import fcntl

    probe = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    kind = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, probe))[0]
    return kind != _F_UNLCK


def _gone(fd: int, pid: int) -> bool:
    if pid == os.getpid() or _locked_by_other(fd, pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (EPERM: a process of another user has this pid)
        return False
    return False


def _scan(buf, fd: int, size: int) -> ReaderTable:
    used = struct.unpack_from("<I", buf, NUMREADERS_AT)[0]
    table = ReaderTable(slots=(size - HEADER) // SLOT, used=used)
    table.open = _locked_by_other(fd, 0)  # (every process with it open holds byte 0)
    for i in range(used):
        pid = struct.unpack_from("<i", buf, HEADER + SLOT * i + PID_AT)[0]
        if pid > 0:
            kind = table.dead if _gone(fd, pid) else table.live
            kind[pid] = kind.get(pid, 0) + 1
    return table


def _supported() -> bool:
    return sys.platform.startswith("linux") and struct.calcsize("P") == 8


def inspect(lock: Path) -> ReaderTable | None:
    """The reader table of ``lock`` (a ``lock.mdb``), read only; None when there is none or
    its layout is not the one described above. ``lock`` must belong to a database this process
    has not opened: closing the file here would drop its LMDB locks."""
    if not _supported():
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER, 0)
        if not _layout_ok(head, size):
            return None
        return _scan(os.pread(fd, size, 0), fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def _libc_mutex():
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        lock, unlock = libc["pthread_mutex_timedlock"], libc["pthread_mutex_unlock"]
        consistent = libc["pthread_mutex_consistent"]
    except AttributeError:
        return None
    for f in (lock, unlock, consistent):
        f.restype = ctypes.c_int
    lock.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    unlock.argtypes = consistent.argtypes = [ctypes.c_void_p]
    return lock, unlock, consistent


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def clear_dead(lock: Path, wait_s: float = LOCK_WAIT_S) -> int | None:
    """Free the slots of dead readers in ``lock`` under LMDB's reader-table mutex; the number
    freed, or None when that could not be done safely (unknown layout, the mutex not taken in
    ``wait_s`` seconds or not recoverable, no such C functions). Same caveat as ``inspect``.

    The work runs in a thread of its own, which Python's signal handlers never interrupt: a
    KeyboardInterrupt raised in the caller's (main) thread just after the mutex was taken would
    leave it locked, and every LMDB process of the cache waiting for it for good (LMDB takes it
    without a timeout; with this process's mapping gone, not even its end would free it). An
    interrupt of the caller's wait leaves the thread to finish and unlock."""
    done: list = []

    def work() -> None:
        try:
            done.append(_clear_dead(lock, wait_s))
        except BaseException:  # (reported as "could not be done")
            done.append(None)

    worker = threading.Thread(target=work, name="pydiff-lmdb-readers")
    try:
        worker.start()
    except RuntimeError:  # (no new threads: at interpreter shutdown)
        return None
    worker.join()
    return done[0] if done else None


def _clear_dead(lock: Path, wait_s: float) -> int | None:
    funcs = _libc_mutex() if _supported() else None
    if funcs is None:
        return None
    mutex_lock, mutex_unlock, mutex_consistent = funcs
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if not _layout_ok(os.pread(fd, HEADER, 0), size) or not _share_byte_0(fd):
            return None
        mapped = mmap.mmap(fd, size)  # MAP_SHARED: LMDB's own mapping of the table
        try:
            return _clear_locked(
                mapped, fd, size, wait_s, mutex_lock, mutex_unlock, mutex_consistent
            )
        finally:
            mapped.close()
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _share_byte_0(fd: int) -> bool:
    """Hold a shared fcntl lock on byte 0, as every process with the database open does (until
    ``fd`` is closed): no process opening it meanwhile takes it exclusively and resets the
    table (new mutexes, then new readers' pids in the records this one clears). False where a
    process holds it exclusively now (one setting the table up)."""
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack("hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 0, 1, 0))
    except OSError:
        return False
    return True


def _clear_locked(mapped, fd, size, wait_s, mutex_lock, mutex_unlock, mutex_consistent):
    if not _layout_ok(mapped[:HEADER], size):  # (the file may have changed since)
        return None
    anchor = ctypes.c_char.from_buffer(mapped)
    try:
        mutex = ctypes.addressof(anchor) + RMUTEX_AT
        deadline = time.clock_gettime(time.CLOCK_REALTIME) + wait_s
        until = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        rc = mutex_lock(mutex, ctypes.byref(until))
        if rc not in (0, errno.EOWNERDEAD):  # ETIMEDOUT, ENOTRECOVERABLE, ...
            return None
        if rc == errno.EOWNERDEAD:
            # (a process died holding it) Made consistent at once, before anything that can
            # raise: glibc makes a robust mutex unlocked without it ENOTRECOVERABLE for good,
            # and LMDB could then take no reader slot. A dead holder was at most claiming a
            # slot (single stores): the table is checked below all the same.
            mutex_consistent(mutex)
        try:
            table = _scan(mapped, fd, size)
            cleared = 0
            for i in range(table.used):
                at = HEADER + SLOT * i + PID_AT
                pid = ctypes.c_int.from_buffer(mapped, at)
                if pid.value in table.dead:
                    pid.value = 0  # (one aligned store, as mdb_reader_check's)
                    cleared += 1
                del pid
        finally:
            mutex_unlock(mutex)
        return cleared
    finally:
        del anchor


@dataclass
class Outcome:
    """What ``make_room`` found and did: ``cleared`` dead readers' slots freed; ``full``: the
    table still has too little room (live readers, or dead ones that could not be cleared)."""

    table: ReaderTable | None = None
    cleared: int = 0
    full: bool = False


def make_room(shaders: Path) -> Outcome:
    """Before a device opens on the shader-cache folder ``shaders`` (one this process has not
    opened): where its reader table has fewer than ``ROOM`` free slots, clear those of dead
    processes; ``full`` when fewer than ``ROOM // 4`` remain free after that."""
    outcome = Outcome()
    for lock in sorted(shaders.glob("*/lock.mdb")) if shaders.is_dir() else ():  # (rhi/)
        table = inspect(lock)
        if table is None or not table.open or table.free >= ROOM:
            continue  # (a database nobody has open is reset by LMDB when it opens)
        cleared = (clear_dead(lock) or 0) if table.dead else 0
        after = inspect(lock) or table  # (read again: another process may have cleared it)
        outcome = Outcome(after, outcome.cleared + cleared, outcome.full or after.free < ROOM // 4)
    return outcome
