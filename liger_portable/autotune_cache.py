"""Tuned-config cache: lookup in the user autotune cache, then the cache files shipped with the
package; and safe writing of tuned results into the user cache.

File format (one JSON file per device model, named by :attr:`DeviceInfo.model_slug`, e.g.
``NVIDIA_H200.json``)::

    {
      "format": 1,
      "device": "NVIDIA H200",
      "entries": {
        "<kernel>|<kernel version>|triton<major.minor>|<dtype>|<problem bucket>": {
          "config": {"num_warps": 8, "BLOCK_M": 1, ...},
          "time_ms": 0.081, "default_ms": 0.090,
          "measured_at": "2026-12-02T12:00:00Z", "versions": {"torch": "...", "triton": "..."}
        }
      }
    }

The key holds everything that invalidates a tuned result: the kernel's source version (a change of
one kernel drops only its entries), Triton's major.minor, the dtype and the problem bucket the
kernel declares (:class:`~liger_portable.specs.KernelSpec.bucket`).

Robustness rules (no cache problem ever stops training):

* A corrupt, truncated or older-format file is skipped with one warning per file and process;
  the next :func:`record` into it replaces it (nothing of it is kept). A file of a newer format
  (another install sharing the folder) or one this process cannot read is skipped and never
  replaced: the entry stays in memory.
* :func:`record` takes an exclusive ``fcntl.flock`` on the sidecar ``<file>.lock`` (waiting at most
  :data:`WRITE_LOCK_TIMEOUT_S`), re-reads the file, merges, writes a temporary file in the same
  folder, fsyncs it and ``os.replace``-s it over the cache file: concurrent writers lose nothing
  and a reader never sees half a file. (Where ``flock`` does not reach other hosts, an NFS mount
  with ``nolock`` say, writers on different nodes can drop each other's entries: a re-tune, never a
  wrong config; a file system that does not lock, or an NFS mount refusing to lock another user's
  lock file opened to read, keeps the entry in memory.) Without ``fcntl`` (Windows) writes go
  unlocked, with one warning. Files are
  created with the permissions the umask leaves, so a team's group-writable folder is shared.
* An unwritable location degrades to an in-memory overlay (one warning); lookups see it first,
  and the next successful write saves it.

Run-time tuning across processes (:func:`liger_portable.tuning.runtime.autotune_miss`) serialises
on a second lock file per device model, ``<file>.tune.lock`` (:func:`tuning_lock`), held while one
process tunes one problem: the others wait, re-read the cache (:func:`reread`) and take the
recorded entry. ``flock`` locks belong to the open file, so a process that dies releases its locks
at once; a lock file left on disk by a dead process is therefore never stale.

Lock files are opened without following links and must be regular files (a link planted in a
shared cache folder would have its target written). The locks are written here over ``fcntl``
rather than with the ``filelock`` package that PyTorch installs: the tuning lock's holder writes
``host pid N`` into the file it holds, which a waiter's timeout message names
(:func:`lock_holder`), and ``filelock`` offers no supported way to write into its held file; its
other gain, locking on Windows, does not apply (no Triton wheels there: nothing is tuned).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import stat
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from . import _paths
from .hardware import DeviceInfo, platform
from .specs import KernelSpec
from ._warn import warn

try:  # POSIX only
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

FORMAT = 1


def triton_major_minor() -> str:
    v = platform().triton_version or "0.0"
    return ".".join(v.split(".")[:2])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entry_key(spec: KernelSpec, named_problem: Mapping[str, int], dtype: torch.dtype) -> str:
    """The cache key of one tuned result (see the module docstring)."""
    bucket = ",".join(f"{k}={v}" for k, v in spec.bucket(dict(named_problem)))
    return f"{spec.name}|{spec.version}|triton{triton_major_minor()}|{dtype_name(dtype)}|{bucket}"


# --------------------------------------------------------------------------- reading

_state_lock = threading.RLock()
_memo: dict[str, dict] = {}  # path -> entries as last read
_overlay: dict[str, dict] = {}  # path -> entries kept in memory because the file is unwritable
_warned: set[str] = set()
_write_hooks: list[Callable[[], None]] = []


def _warn_once(tag: str, msg: str) -> None:
    with _state_lock:
        if tag in _warned:
            return
        _warned.add(tag)
    warn(msg, RuntimeWarning)


def parse(p: Path) -> dict:
    """The entries of cache file ``p``; ``{}`` if it is missing, or (with one warning) unreadable
    or of another format. Never raises."""
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except OSError as e:  # (not replaced by a write either: see _entries_to_keep)
        _warn_once(
            f"bad:{p}",
            f"liger_portable: skipping unreadable autotune cache {p}: {e}; the table defaults apply. "
            "Fix: make the file readable (group-readable and writable in a shared folder), or delete it.",
        )
        return {}
    except ValueError as e:
        _warn_once(
            f"bad:{p}",
            f"liger_portable: skipping unreadable autotune cache {p}: {e}; the table defaults apply. "
            "The next tuned result written there replaces the file (or delete it).",
        )
        return {}
    except Exception as e:  # noqa: BLE001 - never let the cache stop a run
        _warn_once(f"bad:{p}", f"liger_portable: skipping unreadable autotune cache {p}: {e!r}")
        return {}
    if _newer_format(data):
        _warn_once(
            f"bad:{p}",
            f"liger_portable: skipping autotune cache {p}: written by a newer liger-portable (format "
            f"{data['format']}, this one reads {FORMAT}); the table defaults apply, and the file is kept",
        )
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        _warn_once(
            f"bad:{p}",
            f"liger_portable: skipping autotune cache {p}: not format {FORMAT} (written by another "
            "version); it is rebuilt by `liger-portable warmup` (the next tuned result replaces it)",
        )
        return {}
    return data["entries"]


def _newer_format(data: object) -> bool:
    """Whether parsed cache ``data`` says it was written by a newer version (a format above ours)."""
    fmt = data.get("format") if isinstance(data, dict) else None
    return isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > FORMAT


def read(path: str) -> dict:
    """Memoized :func:`parse` (one read per file and process until :func:`record` or :func:`clear`)."""
    hit = _memo.get(path)
    if hit is None:
        hit = parse(Path(path))
        with _state_lock:
            _memo[path] = hit
    return hit


def invalidate(path: str) -> None:
    """Forget the memoized read of cache file ``path``: the next :func:`read` parses it again."""
    with _state_lock:
        _memo.pop(path, None)


def reread(device: DeviceInfo) -> None:
    """Forget the memoized read of ``device``'s user cache file: the next lookup reads the file
    again (it sees entries other processes recorded since this one last read it)."""
    invalidate(str(user_cache_file(device)))


def cache_files(device: DeviceInfo) -> list[tuple[str, Path]]:
    """(label, path) of the cache files consulted for ``device``, in lookup order."""
    name = f"{device.model_slug}.json"
    return [("user cache", _paths.user_cache_dir() / name), ("shipped cache", _paths.shipped_cache_dir() / name)]


def user_cache_file(device: DeviceInfo) -> Path:
    """The read-write cache file of ``device``'s model."""
    return cache_files(device)[0][1]


def lookup(
    spec: KernelSpec, device: DeviceInfo, named_problem: Mapping[str, int], dtype: torch.dtype
) -> Iterator[tuple[dict, str]]:
    """Yield ``(config, where)`` for each cache holding a tuned entry, in lookup order: the
    in-memory overlay of an unwritable user cache, the user cache file, the shipped file."""
    key = None
    for label, path in cache_files(device):
        sources = []
        if label == "user cache":
            with _state_lock:  # (record() may change or drop it meanwhile)
                kept = dict(_overlay.get(str(path)) or {})
            if kept:
                sources.append((kept, f"{label} {path.name} (in memory)"))
        sources.append((read(str(path)), f"{label} {path.name}"))
        for entries, where in sources:
            if not entries:
                continue
            key = key or entry_key(spec, named_problem, dtype)
            hit = entries.get(key)
            if isinstance(hit, dict) and isinstance(hit.get("config"), dict):
                yield hit["config"], where


def lookup_entry(
    spec: KernelSpec, device: DeviceInfo, named_problem: Mapping[str, int], dtype: torch.dtype
) -> dict | None:
    """The full user-cache entry (overlay first) for this problem, or ``None``."""
    path = str(user_cache_file(device))
    key = entry_key(spec, named_problem, dtype)
    for entries in (_overlay.get(path, {}), read(path)):
        hit = entries.get(key)
        if isinstance(hit, dict):
            return hit
    return None


def clear() -> None:
    """Forget what was read and which warnings were given (not the in-memory overlay)."""
    with _state_lock:
        _memo.clear()
        _warned.clear()


def in_memory_only(device: DeviceInfo) -> bool:
    """Whether tuned entries of ``device``'s model are kept in memory only (for this process): its
    user cache file could not be written."""
    with _state_lock:
        return bool(_overlay.get(str(user_cache_file(device))))


def clear_overlay() -> None:
    with _state_lock:
        _overlay.clear()


def on_write(hook: Callable[[], None]) -> None:
    """Register a callable run after each :func:`record` (the resolver drops its memo)."""
    _write_hooks.append(hook)


# --------------------------------------------------------------------------- writing


# What flock() answers on a file system that does not lock (Lustre without -o flock, some network
# and FUSE mounts).
_NO_LOCKING = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _flock(fd: int, op: int) -> None:
    """``fcntl.flock``; a file system that does not lock raises :class:`NoTuningLock` (an
    ``OSError``: writes then fall back to memory, run-time tuning to this process alone)."""
    try:
        fcntl.flock(fd, op)
    except OSError as e:
        if e.errno in _NO_LOCKING:
            raise NoTuningLock(e.errno, f"the file system does not lock files ({os.strerror(e.errno)})") from e
        if e.errno == errno.EBADF:  # Linux NFS emulates flock with fcntl locks, which need a writable descriptor
            raise NoTuningLock(e.errno, "the file system locks only files this process may write (NFS), and this "
                                        "lock file is another user's") from e
        raise


@contextmanager
def _held(fd: int, timeout: float | None) -> Iterator[bool]:
    """Exclusive ``fcntl.flock`` on the open file ``fd``; yields whether it was taken.

    ``timeout=None`` blocks until the lock is free; otherwise gives up after ``timeout`` seconds
    (yields False, nothing held). The lock belongs to this open file: another open of the same
    path, in this process or another, waits for it, and the kernel releases it if the process dies.
    """
    got = False
    if timeout is None:
        _flock(fd, fcntl.LOCK_EX)
        got = True
    else:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = True
                break
            except OSError as e:  # NoTuningLock's errno is none of these: raised as it is
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.25)
    try:
        yield got
    finally:
        if got:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _open_lock_file(path: Path) -> int:
    """Open (or create) a lock file, refusing a symbolic link or anything but a regular file: a link
    planted in a shared cache folder would otherwise have its target truncated and written. Created
    with the permissions the umask leaves (a team's group-writable folder stays usable by all); one
    another user created and this one may not write is opened to read (flock needs no more). Raises
    ``OSError`` naming the file."""
    extra = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | extra, 0o666)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY | extra)  # exists, another user's: lock it to read
    except OSError as e:
        if os.path.islink(path):
            raise OSError(e.errno, f"{path} is a symbolic link; the package writes only regular files there: "
                                   "remove it") from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file; remove it")
    return fd


# A write holds its lock for milliseconds; one held longer belongs to a stopped or hung process (or a
# lock a crashed node left on a network file system): the writer then keeps its entry in memory.
WRITE_LOCK_TIMEOUT_S = 60.0

_writer_lock = threading.Lock()  # one writer of this process at a time (the file lock serialises processes)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock on ``<path>.lock`` (plus a thread lock in this process); an
    ``OSError`` naming the lock file if another process holds it for :data:`WRITE_LOCK_TIMEOUT_S`."""
    with _writer_lock:
        if fcntl is None:  # pragma: no cover - Windows
            _warn_once(
                "nolock",
                "liger_portable: no fcntl on this platform: autotune cache writes are not locked; "
                "run one tuning process at a time (e.g. `liger-portable warmup` before training)",
            )
            yield
            return
        lock = path.with_name(path.name + ".lock")
        fd = _open_lock_file(lock)
        try:
            with _held(fd, WRITE_LOCK_TIMEOUT_S) as got:
                if not got:
                    raise OSError(errno.ETIMEDOUT, f"another process held {lock} for {WRITE_LOCK_TIMEOUT_S:g} s "
                                                   "(stopped or hung?)")
                yield
        finally:
            os.close(fd)


class NoTuningLock(OSError):
    """The tuning lock cannot work here: no ``fcntl``, a file system that does not lock files, or
    the user cache is not writable (entries would stay in one process's memory, so other processes
    could not see them)."""


def tuning_lock_file(device: DeviceInfo) -> Path:
    """The lock file that serialises tuning for ``device``'s model: ``<user cache file>.tune.lock``."""
    path = user_cache_file(device)
    return path.with_name(path.name + ".tune.lock")


def lock_holder(device: DeviceInfo) -> str:
    """Who took ``device``'s tuning lock last (``host pid N``), for messages; ``""`` if unknown."""
    try:
        return tuning_lock_file(device).read_bytes()[:200].decode("utf-8", "replace").strip()
    except Exception:  # noqa: BLE001 - for a message only
        return ""


@contextmanager
def tuning_lock(device: DeviceInfo, timeout: float | None) -> Iterator[bool]:
    """Hold the exclusive tuning lock of ``device``'s model (one lock file in the user cache
    folder, shared by every process that uses that folder); yields False if ``timeout`` seconds
    passed first. The holder writes ``host pid N`` into the file (:func:`lock_holder`).

    Distinct from the write lock of :func:`record`, which the holder takes while it records.

    Raises:
        NoTuningLock: no ``fcntl``, a file system that does not lock files, or the user cache
            location is not writable (or already fell back to memory in this process): processes
            cannot share results through it.
    """
    if fcntl is None:  # pragma: no cover - Windows
        raise NoTuningLock("no fcntl on this platform")
    path = user_cache_file(device)
    if str(path) in _overlay:
        raise NoTuningLock(f"{path} could not be written in this process (tuned entries are kept in memory; see the warning)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK | os.X_OK):  # record() would fall back to memory
            raise PermissionError(errno.EACCES, "not writable", str(path.parent))
        fd = _open_lock_file(tuning_lock_file(device))
    except OSError as e:
        raise NoTuningLock(f"cannot lock in {path.parent}: {e}") from e
    try:
        with _held(fd, timeout) as got:
            if got:  # who holds it, for a waiter's timeout message; best effort
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
                except OSError:
                    pass
            yield got
    finally:
        os.close(fd)


# A writer's temporary file lives for milliseconds; one older than this was left by a killed writer.
STALE_TMP_S = 600.0


def _remove_stale_tmp(path: Path) -> None:
    """Delete the temporary files of ``path`` that killed writers left behind (regular files older
    than :data:`STALE_TMP_S`); best effort."""
    now = time.time()
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            st = os.lstat(tmp)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_TMP_S:
                os.unlink(tmp)
        except OSError:
            pass


_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _new_file_mode() -> int:
    """``0o666`` less this process's umask: the mode ``open()`` gives a new file. Read from
    /proc on Linux (setting the umask to read it would race with other threads); else 0o644."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o644


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync, and rename it over ``path``
    (removing temporary files that killed writers left)."""
    _remove_stale_tmp(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            try:
                os.fsync(f.fileno())
            except OSError as e:  # some FUSE mounts do not sync files
                if e.errno not in _UNSUPPORTED:
                    raise
        try:  # mkstemp's 0600 widened to what the umask allows a new file (a team's folder stays shared)
            os.chmod(tmp, _new_file_mode())
        except OSError:  # CIFS, gcsfuse and others refuse chmod
            pass
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename durable; best effort (not every filesystem allows opening a folder)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _entries_to_keep(path: Path) -> dict:
    """The entries of ``path`` that a write must keep: ``{}`` if it is missing, or corrupt or of an
    older or foreign format (it is replaced; :func:`parse` warns once); ``OSError`` if it cannot be
    read now (another user's file, a network error) or was written by a newer version (format above
    :data:`FORMAT`), rather than replace entries this process cannot see."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError:
        data = None
    if _newer_format(data):
        raise OSError(errno.EEXIST, f"{path} was written by a newer liger-portable (format {data['format']}, "
                                    f"this one writes {FORMAT}); not replaced")
    return parse(path)


def write_entries(path: Path, device_name: str, new: Mapping[str, dict]) -> None:
    """Merge ``new`` into cache file ``path`` under the lock (lock, re-read, merge, atomic replace).

    A corrupt or foreign file is replaced by one holding only ``new``. Raises ``OSError`` if the
    location is not writable, the file cannot be read or was written by a newer version
    (:func:`record` turns that into the in-memory overlay).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        current = _entries_to_keep(path)
        merged = {**current, **new}
        data = {"format": FORMAT, "device": device_name, "entries": dict(sorted(merged.items()))}
        _atomic_write(path, json.dumps(data, indent=1) + "\n")
    invalidate(str(path))


def make_entry(config: Mapping[str, Any], time_ms: float | None, default_ms: float | None) -> dict:
    """One cache entry: config, times, when and with which versions it was measured."""
    p = platform()
    return {
        "config": dict(config),
        "time_ms": None if time_ms is None else round(float(time_ms), 6),
        "default_ms": None if default_ms is None else round(float(default_ms), 6),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {"torch": p.torch_version, "triton": p.triton_version},
    }


def _write_fix(e: BaseException, path: Path) -> str:
    """What to do about a failed write of cache file ``path``, for the warning."""
    other = f"or set {_paths.ENV_CACHE_DIR} to a folder of your own on a local disk."
    if isinstance(e, NoTuningLock):
        return f"this file system does not lock files: set {_paths.ENV_CACHE_DIR} to a folder on a local disk."
    if isinstance(e, PermissionError) and os.access(path.parent, os.W_OK | os.X_OK):
        return (f"a file of {path.name} in {path.parent} belongs to another user: make it group-readable and "
                f"writable (and the folder not sticky), or remove it, {other}")
    if isinstance(e, OSError) and e.errno == errno.EEXIST:
        return f"use the newer liger-portable here too, {other}"
    return f"make {path.parent} writable, {other}"


def record(
    spec: KernelSpec,
    device: DeviceInfo,
    named_problem: Mapping[str, int],
    dtype: torch.dtype,
    config: Mapping[str, Any],
    time_ms: float | None,
    default_ms: float | None,
) -> str:
    """Store a tuned result in the user cache of ``device``'s model; returns the entry key.

    Never raises: an unwritable location keeps the entry in memory for this process (one warning
    naming the file and the fix), and lookups see it.
    """
    key = entry_key(spec, named_problem, dtype)
    entry = make_entry(config, time_ms, default_ms)
    path = user_cache_file(device)
    with _state_lock:
        kept = dict(_overlay.get(str(path), {}))  # entries an earlier failed write kept in memory
    try:
        write_entries(path, device.name, {**kept, key: entry})
    except Exception as e:  # noqa: BLE001 - OSError mostly; never let the cache stop a run
        with _state_lock:
            _overlay.setdefault(str(path), {})[key] = entry
        _warn_once(
            f"unwritable:{path}",
            f"liger_portable: cannot write the autotune cache {path}: {e}; tuned configs are kept in "
            f"memory for this process only. Fix: {_write_fix(e, path)}",
        )
    else:
        with _state_lock:
            left = _overlay.get(str(path))
            if left is not None:
                for k in kept:
                    left.pop(k, None)
                if not left:
                    del _overlay[str(path)]
    for hook in list(_write_hooks):
        hook()
    return key
