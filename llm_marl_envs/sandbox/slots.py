"""Machine-wide allocation of a dedicated unprivileged uid per concurrent run.

Why a uid per run: RLIMIT_NPROC counts processes per real uid and root ignores it, so the
program must run as a non-root uid; if concurrent runs shared that uid, one fork bomb would
eat the others' process budget (non-deterministic reports), programs could signal each
other, and "kill every process of the uid" would hit innocent runs.  Slots are claimed with
flock() on files in a root-only directory, so they are exclusive across threads and across
processes, and released automatically if the holder dies.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from . import procs

UID_BASE = 2_000_000_000  # far above any real account; uid == gid == UID_BASE + slot
MAX_SLOTS = 4096
# World-writable places an unprivileged uid can write to outside its working directory.
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")


def state_dir() -> str:
    """Root-only directory holding slot locks and rlimits-mode working directories."""
    path = os.path.join(tempfile.gettempdir(), f"llm_marl_sandbox-{os.geteuid()}")
    os.makedirs(path, mode=0o711, exist_ok=True)
    info = os.lstat(path)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise RuntimeError(f"refusing to use {path}: not owned by us or writable by others")
    return path


@contextmanager
def acquire() -> Iterator[int | None]:
    """Yield a free sandbox uid (None when not running as root: no uid switch possible)."""
    if os.geteuid() != 0:
        yield None
        return
    lock_dir = os.path.join(state_dir(), "slots")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    for slot in range(MAX_SLOTS):
        path = os.path.join(lock_dir, str(slot))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        uid = UID_BASE + slot
        try:
            release(uid)  # leftovers of a holder that died mid-run
            yield uid
        finally:
            release(uid)
            os.close(fd)
        return
    raise RuntimeError(f"all {MAX_SLOTS} sandbox slots are busy")


def release(uid: int) -> None:
    """Kill every process of ``uid``, then remove what it created in shared directories."""
    procs.kill_uid(uid)
    for directory in SHARED_DIRS:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue
