"""Find and kill every process of a sandbox uid by scanning /proc.

Killing a process group is not enough: a program can call setsid() or double-fork out of
it.  Each concurrent run owns a dedicated uid (see ``slots``), so "all processes of that
uid" is exactly the set of processes the program created.  Used by the parent and by the
judge, so it imports nothing from the package.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time


def pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose effective uid is ``uid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as handle:
                state = handle.read().rpartition(b")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            found.append(int(name))
    return found


def kill_uid(uid: int, rounds: int = 200) -> bool:
    """SIGKILL every process of ``uid`` until none is left; False if some survived.

    Processes with a pending SIGKILL cannot complete a fork, so a fork bomb converges.
    """
    for _ in range(rounds):
        pids = pids_of_uid(uid)
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)
    return not pids_of_uid(uid)
