"""Remove the shared memory and file locks that killed Streaming runs leave behind, sparing live ones.

Every `StreamingDataset` registers a numeric prefix and creates `/dev/shm/<prefix:06>_<name>`
blocks (`locals`, `barrier`, `epoch_data`, ...) and `<tempdir>/<prefix:06>_{barrier,cache}_filelock`
files; they are removed only by an `atexit` handler (or multiprocessing's resource tracker, for
the shared memory). A run killed with SIGKILL (a scheduler, the OOM killer, a launcher tearing
down its ranks) leaves them, and they accumulate: every new run skips the prefixes they occupy.

Streaming's own `clean_stale_shared_memory()` unlinks *every* prefix, including those of runs
still alive on the machine. This module removes a prefix only when no live process maps or holds
open any of its shared memory blocks and none holds one of its file locks (Linux `/proc`);
elsewhere it does nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
from collections import defaultdict

log = logging.getLogger(__name__)

__all__ = ["SHM_DIR", "clean_stale_streaming_resources"]

SHM_DIR = "/dev/shm"

# streaming.base.constant.SHM_TO_CLEAN and the two filelock names (Streaming 0.13); kept here so
# that this module imports nothing heavy.
_SHM_NAMES = (
    "locals",
    "barrier",
    "next_epoch",
    "cache_usage",
    "shard_states",
    "shard_access_times",
    "resume",
    "epoch_shape",
    "epoch_data",
)
_LOCK_NAMES = ("barrier_filelock", "cache_filelock")
_SHM_RE = re.compile(rf"^(\d{{6}})_({'|'.join(_SHM_NAMES)})$")
_LOCK_RE = re.compile(rf"^(\d{{6}})_({'|'.join(_LOCK_NAMES)})$")


def clean_stale_streaming_resources(shm_dir: str | None = None, lock_dir: str | None = None) -> list[str]:
    """Unlink the Streaming shared memory and file locks of prefixes no live process uses.

    A prefix is live when a process maps or has open one of its shared memory blocks, or has
    open or flock-ed one of its lock files; a live prefix is left whole. Entries that cannot be
    removed (another user's) are skipped. When a Python process of this user cannot be
    inspected, nothing is removed.

    Args:
        shm_dir: Where shared memory blocks live (default `/dev/shm`).
        lock_dir: Where Streaming puts its file locks (default `tempfile.gettempdir()`).

    Returns:
        The paths removed.
    """
    shm_dir = shm_dir or SHM_DIR
    lock_dir = lock_dir or tempfile.gettempdir()
    if not os.path.isdir("/proc/self/fd"):
        return []
    by_prefix: dict[str, list[tuple[str, bool]]] = defaultdict(list)  # prefix -> [(path, is_lock)]
    for directory, pattern, is_lock in ((shm_dir, _SHM_RE, False), (lock_dir, _LOCK_RE, True)):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            if m:
                by_prefix[m.group(1)].append((os.path.realpath(os.path.join(directory, name)), is_lock))
    if not by_prefix:
        return []
    in_use = _files_in_use()
    if in_use is None:
        log.warning(
            "not cleaning stale Streaming shared memory: some processes of this user cannot be inspected"
        )
        return []
    removed = []
    for prefix in sorted(by_prefix):
        entries = by_prefix[prefix]
        if any(_file_key(path) in in_use or (is_lock and _is_flocked(path)) for path, is_lock in entries):
            continue
        for path, _ in entries:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
            except PermissionError:
                log.debug("cannot remove %s (owned by another user)", path)
    if removed:
        log.info("removed %d stale Streaming shared memory blocks and file locks: %s", len(removed), removed)
    return removed


def _file_key(path: str) -> tuple[str, int] | None:
    try:
        return path, os.stat(path).st_ino
    except OSError:
        return None


def _files_in_use() -> set[tuple[str, int]] | None:
    """(path, inode) of every file mapped or open by a live process, or None if a Python process
    of ours is unreadable. The inode tells a block from an unlinked older one of the same name
    that some process still maps."""
    me = os.getuid()
    paths: set[tuple[str, int]] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        proc = f"/proc/{pid}"
        try:
            with open(f"{proc}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6:
                        paths.add((parts[5].rstrip("\n").removesuffix(" (deleted)"), int(parts[4])))
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    target = os.readlink(f"{proc}/fd/{fd}").removesuffix(" (deleted)")
                    paths.add((target, os.stat(f"{proc}/fd/{fd}").st_ino))
                except OSError:
                    pass  # closed meanwhile
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        except PermissionError:
            try:
                owner = os.stat(proc).st_uid
            except OSError:
                continue
            # Python's shared memory is created 0600: only its owner (or root) can hold it, and only
            # a Python process can be a Streaming user (a sandbox's init is unreadable even to root).
            if owner == me and _is_python(proc):
                return None
    return paths


def _is_python(proc: str) -> bool:
    """Whether `/proc/<pid>` runs a Python interpreter (True when that cannot be told)."""
    try:
        with open(f"{proc}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode("utf-8", "replace")
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return "python" in os.path.basename(argv0) or not argv0


def _is_flocked(path: str) -> bool:
    """Whether another open file description holds a flock on `path` right now."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
