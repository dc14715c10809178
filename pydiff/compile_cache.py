"""Persistent compile caches: where SlangPy keeps compiled Slang modules and shaders between
processes, so a script's second run skips the compiler.

On by default, in the platform's per-user cache folder (``~/.cache/pydiff`` on Linux,
``~/Library/Caches/pydiff`` on macOS, ``%LOCALAPPDATA%\\pydiff\\Cache`` on Windows).

    PYDIFF_CACHE_DIR=/fast/disk/pydiff-cache    # another folder
    PYDIFF_CACHE=0                              # no persistent cache
    PYDIFF_CACHE_MAX_MB=512                     # the bound on each cache (default 1024)
    pydiff.create_device("vulkan", cache_dir=False)     # per device; a path works too
    pydiff cache clear                          # the command line empties them

A folder that cannot be written means running without the cache, with one warning.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import slangpy as spy

from . import lmdb_readers
from .errors import CacheWarning, EnvironmentSettingError, env_flag

ENV_DIR = "PYDIFF_CACHE_DIR"
ENV_SWITCH = "PYDIFF_CACHE"
ENV_MAX_MB = "PYDIFF_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
_warned: set[str] = set()
_in_forked_child = False  # (see forget_held)
_created: set[str] = set()  # type folders this process made (see discard_new)
# Shader databases (LMDB) this process has handed to a device: LMDB must never be opened twice
# in one process, nor its lock file opened and closed by anyone else in it (that drops the
# process's locks, and another process then resets the reader table under it: every later
# lookup and store of this process fails with MDB_BAD_RSLOT). See shader_slot.
_held_shaders: set[str] = set()


def default_root() -> Path:
    """The platform's per-user cache folder for pydiff."""
    home = Path.home()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return Path(base) / "pydiff" / "Cache"
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "pydiff"
    return Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "pydiff"


def root(cache_dir: str | os.PathLike | bool | None = None) -> Path | None:
    """The cache folder in force: ``cache_dir`` if given (False: none), else
    ``$PYDIFF_CACHE_DIR``, else the platform's; None when caching is switched off.

    >>> pydiff.compile_cache.root()
    PosixPath('/root/.cache/pydiff')
    """
    if cache_dir is False:
        return None
    if cache_dir is not None and cache_dir is not True:
        return Path(cache_dir).expanduser()
    if not env_flag(ENV_SWITCH, True):
        return None
    env = os.environ.get(ENV_DIR, "").strip()
    return Path(env).expanduser() if env else default_root()


def max_bytes() -> int:
    """The size bound of each cache, from ``$PYDIFF_CACHE_MAX_MB`` (default 1024 MB; fractions
    taken, at least 1 MB used); anything but a positive number raises ``ValueError`` naming it.

    >>> pydiff.compile_cache.max_bytes()
    1073741824
    """
    raw = os.environ.get(ENV_MAX_MB, "")
    if not raw.strip():
        return DEFAULT_MAX_MB << 20
    try:
        mb = float(raw.strip().replace("_", ""))
    except ValueError:
        mb = math.nan
    if not (0 < mb < math.inf):
        raise EnvironmentSettingError(
            f"{ENV_MAX_MB}={raw!r}: expected a positive number of MB (or unset)"
        )
    return max(int(mb * (1 << 20)), 1 << 20)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, CacheWarning, stacklevel=4)


def version_dir(base: Path) -> Path:
    """Caches are kept per SlangPy version: another version never reads this one's files."""
    return base / f"slangpy-{spy.__version__}"


def paths_for(base: Path, device_type: str) -> tuple[Path, Path]:
    """(module cache, shader cache) folders of one device type under ``base``."""
    here = version_dir(base) / device_type
    return here / "modules", here / "shaders"


def shader_slot(shaders: Path) -> Path:
    """The shader-cache folder for the next device this process opens on ``shaders``:
    ``shaders`` itself for the first, ``shaders-2``, ``shaders-3``... for more devices on the
    same cache (other include paths, a device opened again), so that no shader database is
    ever opened twice in this process. The same program opens its devices in the same order
    each run, so each finds its own kernels again."""
    n = 1
    while True:
        slot = shaders if n == 1 else shaders.with_name(f"{shaders.name}-{n}")
        key = os.path.realpath(slot)
        if key not in _held_shaders:
            _held_shaders.add(key)
            return slot
        n += 1


def forget_held() -> None:
    """In a forked child (``pydiff.forkguard``): its devices open with no persistent cache.
    A forked child often ends without closing its devices (multiprocessing's fork workers leave
    through ``os._exit``; a killed child), and each such child left its reader slots taken in
    the shared shader database: LMDB frees them only when no process has it open, so a parent
    that kept its device open saw every process fail with ``MDB_READERS_FULL`` after about a
    hundred children (measured: a CI run). A child compiles its kernels anew instead."""
    global _in_forked_child
    _held_shaders.clear()
    _in_forked_child = True


def prepare(base: Path | None, device_type: str) -> tuple[str, str] | None:
    """Create and check the cache folders of a device type; None (one warning) when they
    cannot be used, so the device opens without a persistent cache."""
    if base is None or _in_forked_child:
        return None
    limit = max_bytes()  # (a bad value: ValueError before any folder is made)
    modules, shaders = paths_for(base, device_type)
    shaders = shader_slot(shaders)  # one this process does not hold: safe to check and repair
    shaders = _room_for_readers(shaders)
    if shaders is None:
        return None
    if not modules.parent.exists():
        _created.add(str(modules.parent))
    if not shaders.exists():  # (a slot folder from an earlier run is kept by discard_new)
        _created.add(str(shaders))
    try:
        for folder in (modules, shaders):
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder):  # writable, not just present
                pass
    except OSError as exc:
        _warn_once(
            f"pydiff's compile cache {base} cannot be used ({exc.strerror or exc}); running "
            f"without it. Set {ENV_DIR} to a writable folder, or {ENV_SWITCH}=0 to silence this."
        )
        return None
    bad = damaged(modules, shaders)
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        _warn_once(
            f"pydiff's compile cache: {bad[0]}{more} were damaged (truncated or overwritten) and "
            "are removed; what they held is compiled again"
        )
    bound(modules, limit)
    return str(modules), str(shaders)


def _room_for_readers(shaders: Path) -> Path | None:
    """``shaders``, its LMDB reader table cleared of dead processes' slots where it is nearly
    full (``lmdb_readers.make_room``); where it stays full, a spare folder beside it (one
    warning), or None (no persistent cache) when the spares are full too."""
    room = lmdb_readers.make_room(shaders)
    if not room.full:
        return shaders
    for n in range(1, 5):
        spare = shaders.with_name(f"{shaders.name}-spare{n}")
        key = os.path.realpath(spare)
        if key not in _held_shaders and not lmdb_readers.make_room(spare).full:
            _held_shaders.discard(os.path.realpath(shaders))
            _held_shaders.add(key)
            break
    else:
        spare = None
        _held_shaders.discard(os.path.realpath(shaders))
    table = room.table  # (never None when full)
    stuck = sum(table.dead.values())
    dead = f", {stuck} of dead ones that could not be freed" if stuck else ""
    _warn_once(
        f"pydiff's compile cache: the shader database in {shaders} has {table.free} of its "
        f"{table.slots} reader slots free ({sum(table.live.values())} held by live processes"
        f"{dead}; LMDB refuses readers past them with MDB_READERS_FULL); this process "
        + (f"uses {spare} instead, compiling its kernels anew" if spare else "runs without it")
    )
    return spare


_LMDB_MAGIC = 0xBEEFC0DE
_STALE_EMPTY_S = 60.0  # an empty file this old is not one another process is writing now


def _intact_module(path: Path, size: int) -> bool:
    """A compiled Slang module is a RIFF file whose header gives its length."""
    with open(path, "rb") as f:
        head = f.read(8)
    return len(head) == 8 and head[:4] == b"RIFF" and int.from_bytes(head[4:], "little") + 8 == size


def _intact_lmdb(data: Path, lock: Path) -> bool:
    """SlangPy's shader cache is an LMDB database: its files start with LMDB's magic."""
    for path, at in ((data, 16), (lock, 0)):
        if path.exists():
            with open(path, "rb") as f:
                f.seek(at)
                if int.from_bytes(f.read(4), "little") != _LMDB_MAGIC:
                    return False
    return True


def damaged(modules: Path, shaders: Path) -> list[str]:
    """Find and remove damaged cache files (SlangPy itself would recompile silently, or
    fail); returns what was removed. Files another process is creating right now are spared.
    ``shaders`` must be a folder no device of this process has open (see shader_slot):
    opening and closing its ``lock.mdb`` here would drop this process's LMDB locks."""
    now, removed = time.time(), []
    for _, size, path in _files(modules):
        if path.suffix != ".slang-module":
            continue
        try:
            young_and_empty = size == 0 and now - path.stat().st_mtime < _STALE_EMPTY_S
            if not young_and_empty and not _intact_module(path, size):
                path.unlink()
                removed.append(str(path))
        except OSError:
            continue
    for data in shaders.rglob("data.mdb"):
        lock = data.with_name("lock.mdb")
        try:
            empty = data.stat().st_size == 0
            if empty and now - data.stat().st_mtime < _STALE_EMPTY_S:
                continue
            if empty or not _intact_lmdb(data, lock):
                data.unlink()
                lock.unlink(missing_ok=True)
                removed.append(str(data))
        except OSError:
            continue
    return removed


def discard_new(paths: tuple[str, str] | None) -> None:
    """Remove the cache folders ``prepare`` made for a device that then failed to open (SlangPy
    creates its shader database even then); folders that existed before are kept, and so are
    those of another device of this process that opened on them."""
    if paths is not None:
        shaders = Path(paths[1])
        _held_shaders.discard(os.path.realpath(shaders))  # (never opened: free again)
        type_dir = shaders.parent
        inside = os.path.realpath(type_dir) + os.sep
        if any(held.startswith(inside) for held in _held_shaders):
            if str(shaders) in _created:  # only the failed device's new database
                shutil.rmtree(shaders, ignore_errors=True)
        elif str(type_dir) in _created:
            shutil.rmtree(type_dir, ignore_errors=True)


def _files(folder: Path) -> list[tuple[float, int, Path]]:
    found = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = Path(dirpath) / name
            try:
                st = path.stat()
            except OSError:  # removed meanwhile by another process
                continue
            found.append((max(st.st_atime, st.st_mtime), st.st_size, path))
    return found


def size_of(folder: Path) -> int:
    """Bytes under ``folder`` (0 when it does not exist)."""
    return sum(size for _, size, _ in _files(folder))


def bound(folder: Path, limit: int | None = None) -> int:
    """Remove the least recently used files under ``folder`` until it holds at most ``limit``
    bytes (default ``max_bytes()``); returns the bytes removed."""
    limit = max_bytes() if limit is None else limit
    files = sorted(_files(folder))
    total = sum(size for _, size, _ in files)
    removed = 0
    for _, size, path in files:
        if total - removed <= limit:
            break
        try:
            path.unlink()
            removed += size
        except OSError:
            pass
    return removed


def usage(base: Path | None = None) -> dict:
    """Where the caches are and how big: for ``pydiff info``.

    >>> pydiff.compile_cache.usage()["bytes"]
    """
    base = root() if base is None else base
    if base is None:
        return {"enabled": False, "path": None, "bytes": 0, "max_bytes": max_bytes()}
    usable = not base.exists() or base.is_dir()
    return {
        "enabled": True,
        "path": str(base),
        "bytes": size_of(base) if usable and base.exists() else 0,
        "max_bytes": max_bytes(),
        "problem": None if usable else "not a folder: devices open without the cache",
    }


def clear(base: Path | None = None) -> int:
    """Empty the cache folder (``pydiff cache clear``); returns the bytes removed.

    >>> pydiff.compile_cache.clear()
    """
    base = root() if base is None else base
    if base is None or not base.exists():
        return 0
    size = size_of(base)
    for child in base.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    return size
