"""Machine-wide allocation of run slots, each with a dedicated unprivileged uid.

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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Slot:
    """A claimed run slot: its sandbox uid (None when not root: no uid switch possible) and
    the working directory rlimits mode uses (a fixed path per slot, so a directory left by
    a holder that died is found and removed by the next one)."""

    index: int
    uid: int | None
    workdir: str


@contextmanager
def acquire() -> Iterator[Slot]:
    """Claim a free slot; everything left by its previous holder is cleaned up first."""
    state = state_dir()
    lock_dir = os.path.join(state, "slots")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    root = os.geteuid() == 0
    for index in range(MAX_SLOTS):
        path = os.path.join(lock_dir, str(index))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        slot = Slot(index, UID_BASE + index if root else None, os.path.join(state, f"run-{index}"))
        try:
            _clean(slot)
            yield slot
        finally:
            _clean(slot)
            os.close(fd)
        return
    raise RuntimeError(f"all {MAX_SLOTS} sandbox slots are busy")


def _clean(slot: Slot) -> None:
    if slot.uid is not None:
        release(slot.uid)
    if os.path.lexists(slot.workdir):
        shutil.rmtree(slot.workdir, onerror=_force_remove)


def _force_remove(function: object, path: str, exc_info: object) -> None:
    """The program may have made its files or directories read-only: fix, retry."""
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


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
