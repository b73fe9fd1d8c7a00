"""Choosing the isolation mode and the interpreter the sandbox processes run.

"namespaces": the judge unshares mount, network, IPC and UTS namespaces, builds a minimal
read-only root on a size-limited tmpfs and chroots into it (see ``nsroot``); each worker
gets a fresh PID namespace, so everything it spawns dies with it.  "rlimits": resource
limits, a dedicated uid and an empty working directory only.  "auto" probes once per
process whether namespaces work here and logs the choice.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger("llm_marl_envs.sandbox")

_lock = threading.Lock()
_probe_result: str | None = None  # "" when namespaces work, else why not


class SandboxUnavailableError(RuntimeError):
    """The requested isolation cannot be provided on this machine."""


def resolve(requested: str, probe: Callable[[], str]) -> str:
    """Map "auto" to a concrete mode; fail closed when "namespaces" is unavailable."""
    global _probe_result
    if requested == "rlimits":
        return "rlimits"
    with _lock:
        if _probe_result is None:
            _probe_result = probe()
            if requested == "auto":
                logger.info(
                    "sandbox isolation: %s",
                    f"rlimits ({_probe_result})" if _probe_result else "namespaces",
                )
    if not _probe_result:
        return "namespaces"
    if requested == "namespaces":
        raise SandboxUnavailableError(
            f"isolation='namespaces' is unavailable: {_probe_result}. It needs root (with "
            "CAP_SYS_ADMIN) to create mount, PID and network namespaces; use "
            "isolation='rlimits' or 'auto' on this machine"
        )
    return "rlimits"


def sandbox_python(mode: str) -> str:
    """Interpreter of the zygote, judges and workers (workers are forks of the zygote, so
    it must be executable, with its standard library, by the unprivileged sandbox uid).

    In namespaces mode the judge bind-mounts the interpreter's prefix into a world-readable
    root, so the current interpreter always works.  In rlimits mode as root, the current
    interpreter may live under a private directory (pyenv in /root): fall back to a system
    interpreter of the same version.
    """
    current = os.path.realpath(sys.executable)
    if mode == "namespaces" or os.geteuid() != 0 or _world_usable(current, sys.base_prefix):
        return current
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for directory in ("/usr/bin", "/usr/local/bin", "/bin"):
        candidate = os.path.realpath(os.path.join(directory, version))
        if os.path.isfile(candidate) and _world_usable(candidate, os.path.dirname(candidate)):
            return candidate
    raise SandboxUnavailableError(
        f"rlimits isolation as root needs a {version} that an unprivileged uid can run; "
        f"{current} is not reachable (install the distribution's {version} or use namespaces)"
    )


def _world_usable(executable: str, prefix: str) -> bool:
    """Every directory on the way is world-searchable and the file world-executable."""
    paths = [executable]
    for start in (os.path.dirname(executable), os.path.realpath(prefix)):
        path = start
        while True:
            paths.append(path)
            if path == "/":
                break
            path = os.path.dirname(path)
    try:
        return all(os.stat(p).st_mode & stat.S_IXOTH for p in paths)
    except OSError:
        return False
