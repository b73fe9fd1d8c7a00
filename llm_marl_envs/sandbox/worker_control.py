"""Judge-side management of the untrusted worker process.

The first worker of a run is forked from the judge *before* the judge reads the secret
part of the job (test code, nonce): it costs a fork instead of an interpreter start, and it
holds nothing worth stealing.  After a timeout or a crash the worker is replaced by a
freshly exec'd interpreter (the judge has the test code in memory by then, so it must not
fork again).  Either way the worker gets its own session, resource limits, the sandbox
uid, no-new-privileges, /dev/null as stdio, only its two protocol pipes, and (namespaces
mode) a fresh PID namespace in which it is PID 1.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import codec
import nsroot
import procs
import worker

JOB_LIMIT = 64 << 20
REQUEST_LIMIT = 64 << 20
ERROR_CAP = 300
BOOTSTRAP = (
    "import sys,types;m=types.ModuleType('codec');"
    "exec(compile(sys.argv[1],'codec.py','exec'),m.__dict__);sys.modules['codec']=m;"
    "exec(compile(sys.argv[2],'worker.py','exec'),{'__name__':'__main__'})"
)


def _read_sources() -> list[str]:
    """Code of a re-exec'd worker, passed on its command line so that no file of the package
    has to be reachable inside the sandbox (read at import, before any chroot)."""
    sources = []
    for module in (codec, worker):
        with open(module.__file__, encoding="utf-8") as handle:
            sources.append(handle.read())
    return sources


SOURCES = _read_sources()


class CandidateError(Exception):
    """An exception raised in (or by the death of) the program, named as it was there."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.sandbox_message = message


class Timeout(CandidateError):
    def __init__(self) -> None:
        super().__init__("timeout", "")


class LoadFailure(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class Worker:
    """The untrusted process answering calls for one run; replaced after it times out or
    dies, so later asserts still get a fair run."""

    def __init__(
        self,
        job: dict,
        enter_pid_namespace: Callable[[], None] | None,
        helper: Worker | None = None,
    ) -> None:
        self.job = job
        self.enter_pid_namespace = enter_pid_namespace
        self.pid: int | None = None
        self.req_fd = self.rep_fd = -1
        self.names: list[str] = []
        #: The worker running the other agent's function (``job["helper_name"]``), if any.
        self.helper = helper
        #: Calls of the helper's function that returned a value (not None) to this worker's
        #: program: counted here, in the judge, so the program cannot inflate it.
        self.helper_returns = 0
        home = job["workdir"]
        self.env = {
            "PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
        }

    def fork(self) -> None:
        """Start the first worker by forking (call before reading any secret)."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        if self.enter_pid_namespace is not None:
            self.enter_pid_namespace()
        pid = os.fork()
        if pid == 0:
            try:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):  # fd 0 is the judge's stdin: the secrets are queued there
                    os.dup2(devnull, fd)
                low, high = sorted((req_r, rep_w))
                os.closerange(3, low)
                os.closerange(low + 1, high)
                os.closerange(high + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                os.chdir(self.job["workdir"])
                os.environ.clear()
                os.environ.update(self.env)
                self.drop_privileges()
                sys.path[:] = [p for p in sys.path if p != os.path.dirname(worker.__file__)]
                worker.serve(req_r, rep_w, self.job["output_limit"], self.job["audit_hook"])
            finally:
                os._exit(0)
        os.close(req_r)
        os.close(rep_w)
        self._attach(pid, req_w, rep_r)

    def spawn(self) -> None:
        """Start a replacement worker as a fresh interpreter."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        job = self.job
        if self.enter_pid_namespace is not None:
            self.enter_pid_namespace()
        argv = [
            job["python"], "-S", "-s", "-B", "-c", BOOTSTRAP, *SOURCES,
            str(req_r), str(rep_w), str(job["output_limit"]), "1" if job["audit_hook"] else "0",
        ]
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd=job["workdir"], env=self.env,
            pass_fds=(req_r, rep_w), preexec_fn=self.drop_privileges,
        )
        proc.returncode = 0  # we reap it ourselves with waitpid; keep Popen from trying
        os.close(req_r)
        os.close(rep_w)
        self._attach(proc.pid, req_w, rep_r)

    def _attach(self, pid: int, req_fd: int, rep_fd: int) -> None:
        self.pid, self.req_fd, self.rep_fd = pid, req_fd, rep_fd
        os.set_blocking(req_fd, False)

    def drop_privileges(self) -> None:
        """In the child: own session, rlimits, unprivileged uid, no new privileges."""
        job = self.job
        os.setsid()
        cpu = math.ceil(job["total_timeout"]) + 1
        limits = [
            (resource.RLIMIT_CPU, cpu, cpu + 1),
            (resource.RLIMIT_AS, job["memory_limit"], job["memory_limit"]),
            (resource.RLIMIT_FSIZE, job["max_file_size"], job["max_file_size"]),
            (resource.RLIMIT_NOFILE, job["max_open_files"], job["max_open_files"]),
            (resource.RLIMIT_CORE, 0, 0),
            (resource.RLIMIT_NPROC, job["max_processes"], job["max_processes"]),
        ]
        for which, soft, hard in limits:
            resource.setrlimit(which, (soft, hard))
        if job["uid"] is not None:
            os.setgroups([])
            os.setgid(job["uid"])
            os.setuid(job["uid"])
        nsroot.no_new_privileges()

    def load(self, names: list[str], deadline: float) -> dict:
        """Send the program; return the kinds of the requested names or raise LoadFailure."""
        if self.pid is None:
            self.spawn()
        try:
            remote = [self.job["helper_name"]] if self.helper is not None else []
            request = codec.encode((self.job["program"], names, remote), JOB_LIMIT)
            codec.write_frame(self.req_fd, request, deadline)
            reply = self._read(deadline)
        except TimeoutError:
            self.kill()
            raise LoadFailure("timeout", "program did not load within the test timeout") from None
        except EOFError:
            raise LoadFailure(*self._death("while loading")) from None
        except CandidateError as exc:
            raise LoadFailure("error", str(exc)) from None
        if reply[0] != "ok" or not isinstance(reply[1], dict):
            self.kill()
            raise LoadFailure("error", str(reply[1])[:ERROR_CAP])
        self.names = names
        return reply[1]

    def call(self, name: str, args: tuple, kwargs: dict, deadline: float) -> object:
        try:
            request = codec.encode((name, args, kwargs), REQUEST_LIMIT)
        except codec.CodecError as exc:
            raise TypeError(f"cannot pass this value to the program: {exc}") from None
        if self.pid is None:
            try:
                self.load(self.names, deadline)
            except LoadFailure as exc:
                raise CandidateError("RuntimeError", f"program failed to restart: {exc}") from None
        try:
            codec.write_frame(self.req_fd, request, deadline)
            reply = self._read(deadline)
            while reply[0] == "call" and self.helper is not None and len(reply) == 4:
                answer = self._call_helper(reply[1], reply[2], reply[3], deadline)
                codec.write_frame(self.req_fd, codec.encode(answer, REQUEST_LIMIT), deadline)
                reply = self._read(deadline)
        except TimeoutError:
            self.kill()
            raise Timeout() from None
        except (EOFError, BrokenPipeError):
            raise CandidateError("crashed", self._death("during the call")[1]) from None
        if reply[0] == "ok" and len(reply) == 2:
            return reply[1]
        if reply[0] == "raise" and len(reply) == 3:
            raise rebuild(str(reply[1]), str(reply[2]))
        self.kill()
        raise CandidateError("TypeError", "malformed reply from the program")

    def _call_helper(self, name: object, args: object, kwargs: object, deadline: float) -> tuple:
        """Run one call that this worker's program made to the helper's function.

        An exception raised by the helper's code goes back to the caller, which may catch
        it.  A helper process that times out or dies ends the whole call as failed (this
        worker is killed too), the same way in every isolation mode.
        """
        helper = self.helper
        if name != self.job["helper_name"] or type(args) is not tuple or type(kwargs) is not dict:
            self.kill()
            raise CandidateError("TypeError", "malformed call from the program")
        try:
            if not helper.names:
                helper.load([name], deadline)
            value = helper.call(name, args, kwargs, deadline)
        except LoadFailure as exc:
            return ("raise", "RuntimeError", f"{name}() failed to load: {exc}"[:ERROR_CAP])
        except Exception as exc:  # noqa: BLE001 - the helper's own exception, or its death
            if helper.pid is None:
                self.kill()
                if isinstance(exc, Timeout):
                    raise
                raise CandidateError("crashed", f"{name}(): {exc}"[:ERROR_CAP]) from None
            name_of = exc.name if isinstance(exc, CandidateError) else type(exc).__name__
            return ("raise", name_of, getattr(exc, "sandbox_message", str(exc))[:ERROR_CAP])
        if value is not None:  # a helper that returns nothing has not helped
            self.helper_returns += 1
        return ("ok", value)

    def _read(self, deadline: float) -> tuple:
        try:
            frame = codec.read_frame(self.rep_fd, self.job["output_limit"] + 64, deadline)
            if frame is None:
                raise EOFError
            reply = codec.decode(frame)
        except codec.CodecError as exc:
            self.kill()
            raise CandidateError("TypeError", f"malformed reply from the program: {exc}") from None
        if not isinstance(reply, tuple) or not reply:
            self.kill()
            raise CandidateError("TypeError", "malformed reply from the program")
        return reply

    def _death(self, when: str) -> tuple[str, str]:
        """The worker closed its pipe: reap it (killing it after 1 s) and say how it ended."""
        status = None
        for _ in range(100):
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.01)
        else:
            status = None
        self.kill(reaped=status is not None)
        if status is not None and os.WIFSIGNALED(status):
            try:
                name = signal.Signals(os.WTERMSIG(status)).name
            except ValueError:
                name = f"signal {os.WTERMSIG(status)}"
            return "killed", f"program killed by {name} {when}"
        code = os.WEXITSTATUS(status) if status is not None else None
        return "error", f"program exited {when} (exit status {code})"

    def kill(self, reaped: bool = False) -> None:
        """Kill the worker and everything it spawned."""
        if self.pid is None:
            return
        for fd in (self.req_fd, self.rep_fd):
            os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        if not reaped:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        if self.job["uid"] is not None and self.enter_pid_namespace is None:
            procs.kill_uid(self.job["uid"])  # the helper's process too: it shares the uid
            if self.helper is not None:
                self.helper.kill()
        self.pid = None


def rebuild(name: str, message: str) -> Exception:
    """Turn a worker-reported exception into one test code can catch by builtin type."""
    found = getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, Exception):
        try:
            exc = found(message)
        except Exception:  # noqa: BLE001 - constructors with other signatures
            return CandidateError(name, message)
        exc.sandbox_message = message  # str(KeyError("k")) would add quotes
        return exc
    return CandidateError(name, message)
