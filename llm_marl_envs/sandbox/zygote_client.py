"""Parent-side client of the judge zygote (see ``zygote``).

One zygote per parent process and interpreter, started lazily and shared by all threads.
Requests are serialized by one lock, which is also taken around every fork() of the parent
(os.register_at_fork): a child forked while a judge's pipe ends are open in the parent would
keep the judge's stdout open and stall the run until its deadline.  If the zygote died it is
restarted once per request.  A forked child forgets the inherited zygotes and starts its
own: sharing a control socket across processes would interleave replies.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import threading

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0"}
CONTROL_TIMEOUT = 10.0  # seconds for the zygote to answer a spawn request


_lock = threading.RLock()  # reentrant: starting a zygote forks while holding it


class ForkServer:
    def __init__(self, python: str) -> None:
        self.python = python
        self._socket: socket.socket | None = None
        self._proc: subprocess.Popen | None = None

    def forget(self) -> None:
        """After fork, in the child: the zygote and its socket belong to the parent."""
        self._socket = None
        self._proc = None

    def spawn(self) -> tuple[int, int, int, int]:
        """Fork a judge; return (pid, stdin write end, stdout read end, stderr read end).
        Call with ``_lock`` held."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        try:
            pid = self._request([stdin_r, stdout_w, stderr_w])
        except BaseException:
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
        return pid, stdin_w, stdout_r, stderr_r

    def _request(self, fds: list[int]) -> int:
        for attempt in range(2):
            if self._socket is None or self._proc is None or self._proc.poll() is not None:
                self.stop()
                self._start()
            try:
                socket.send_fds(self._socket, [b"spawn"], fds)
                reply = b""
                while len(reply) < 8:
                    chunk = self._socket.recv(8 - len(reply))
                    if not chunk:
                        raise ConnectionError("judge zygote exited")
                    reply += chunk
                return int.from_bytes(reply, "big")
            except OSError:
                self.stop()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [self.python, "-S", "-s", "-B", ZYGOTE, str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True, cwd="/", env=ENV,
            )
        finally:
            theirs.close()
        ours.settimeout(CONTROL_TIMEOUT)  # a wedged zygote must not block parent forks forever
        self._socket = ours

    def stop(self) -> None:
        """Close our end: the zygote sees EOF and exits (judges in flight finish alone)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None



_servers: dict[str, ForkServer] = {}


def spawn(python: str) -> tuple[int, int, int, int]:
    """Fork a judge from the zygote running ``python`` (started on first use)."""
    with _lock:
        return _servers.setdefault(python, ForkServer(python)).spawn()


def cpu_seconds() -> float:
    """CPU time used so far by the zygotes and every judge/worker they reaped (benchmarks)."""
    total = 0.0
    for server in list(_servers.values()):
        if server._proc is not None:
            with open(f"/proc/{server._proc.pid}/stat") as handle:
                fields = handle.read().rpartition(")")[2].split()
            total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def _close_all() -> None:
    with _lock:
        for server in _servers.values():
            server.stop()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    for server in _servers.values():
        server.forget()


atexit.register(_close_all)
os.register_at_fork(
    before=lambda: _lock.acquire(),
    after_in_parent=lambda: _lock.release(),
    after_in_child=_after_fork_in_child,
)
