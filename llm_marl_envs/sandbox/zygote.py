"""Fork server for judge processes (trusted; never runs program or test code itself).

Starting an interpreter and importing the judge costs more CPU than judging a typical
HumanEval program, so the parent keeps one zygote with the judge pre-imported and asks it
to fork a fresh judge per program.  The untrusted worker is still a freshly exec'd
interpreter started by that judge, so every program gets a brand-new process that never
shared memory with the tests or with another program.

Protocol on the AF_UNIX control socket (fd in argv[1]): the parent sends b"spawn" with
three fds (the judge's stdin, stdout, stderr) as SCM_RIGHTS; the zygote replies with the
judge's pid as 8 bytes.  The judge is a session leader, so its pid is its process group.
EOF on the socket (the parent exited) ends the zygote.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import traceback

import judge


def _reap(signum: int, frame: object) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _become_judge(control: socket.socket, fds: list[int]) -> None:
    """In the forked child: detach, wire stdio to the parent's pipes, run one job."""
    code = 1
    try:
        control.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        judge.main()
        code = 0
    except BaseException:  # noqa: BLE001 - report any judge bug on its stderr
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def serve(control: socket.socket) -> None:
    signal.signal(signal.SIGCHLD, _reap)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 16, 3)
        except ConnectionError:
            return
        if not message:
            return
        if message != b"spawn" or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            _become_judge(control, fds)
        for fd in fds:
            os.close(fd)
        control.sendall(pid.to_bytes(8, "big"))


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
