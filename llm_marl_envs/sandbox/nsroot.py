"""Namespaces and a minimal read-only root for the judge and its workers (Linux, root),
plus the two prctl() hardening calls used in every mode.

The judge calls :func:`enter` once: it moves into new mount, network, IPC and UTS
namespaces, mounts a size-limited tmpfs, bind-mounts read-only (nosuid, nodev) only what an
interpreter needs (/usr and its /bin, /lib symlinks, the Python prefix, four /dev nodes)
and chroots into it.  Everything else (the project, datasets with canonical solutions,
/root, /home, /proc, the host's /tmp) is simply absent; writes can only land on the tmpfs,
which disappears with the namespace.  The new network namespace has only a down loopback.
Each worker is then started in a fresh PID namespace (see the returned callable), so it is
PID 1 there and everything it forks is killed by the kernel when it dies.

Uses ctypes (standard library) because Python 3.11 has no os.unshare/os.mount.  Imported
only by the judge, which is trusted and has not run any untrusted code at that point.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
NEW_ROOT = "/tmp"  # the tmpfs is mounted over the (private copy of the) host /tmp
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
DEVICES = ("null", "zero", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    result = _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data))
    _check(result, f"mount {target}")


def _bind_readonly(path: str, new_root: str) -> None:
    """Mirror ``path`` (a directory, file or symlink) read-only at the same place."""
    target = new_root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        open(target, "w").close()
    _mount(path, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
    _mount(None, target, None, flags if path.startswith("/dev/") else flags | MS_NODEV)


def enter(job: dict) -> Callable[[], None]:
    """Isolate this process; return the hook to call before spawning each worker."""
    os.umask(0o022)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _check(_libc.sethostname(b"sandbox", 7), "sethostname")
    size = 4 * job["max_file_size"] + (1 << 20)
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes=4096,mode=755")
    python_prefix = os.path.dirname(os.path.dirname(job["python"]))
    prefixes = {os.path.realpath(sys.base_prefix), python_prefix}
    for path in [*SYSTEM_PATHS, *sorted(prefixes)]:
        if os.path.lexists(path) and not os.path.exists(NEW_ROOT + path):
            _bind_readonly(path, NEW_ROOT)
    for device in DEVICES:
        _bind_readonly(f"/dev/{device}", NEW_ROOT)
    os.mkdir(NEW_ROOT + "/tmp")
    os.chmod(NEW_ROOT + "/tmp", 0o1777)
    os.mkdir(NEW_ROOT + job["workdir"], 0o700)
    if job["uid"] is not None:
        os.chown(NEW_ROOT + job["workdir"], job["uid"], job["uid"])
    # unshare(CLONE_NEWPID) works once per process; setns() back to our own PID namespace
    # first resets it, so each replacement worker gets a fresh namespace too.
    own_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    os.chroot(NEW_ROOT)
    os.chdir("/")

    def enter_pid_namespace() -> None:
        _check(_libc.setns(own_pid_namespace, CLONE_NEWPID), "setns(CLONE_NEWPID)")
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")

    return enter_pid_namespace


def undumpable() -> None:
    """No ptrace and no /proc/<pid>/mem for processes of the same uid.  Matters when not
    root: the worker then shares the judge's uid and could otherwise read the nonce and the
    test code out of the judge's memory."""
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def no_new_privileges() -> None:
    """In the worker before exec: setuid binaries can never raise its privileges."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
