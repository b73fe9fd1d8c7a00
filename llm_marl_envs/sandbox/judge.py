"""Trusted side of a sandbox run: runs the instrumented ``check`` and reports to the parent.

Forked by the zygote (see ``zygote``) as a new session with a scrubbed environment, stdin,
stdout and stderr wired to the parent's pipes.  It reads one job frame on stdin, optionally
enters fresh namespaces and a minimal read-only root (``nsroot``), starts the untrusted
worker process, and runs the test code itself.  Every function the test code needs from
the program (the entry point, helpers like ``poly``) is a :class:`Proxy`: calling it sends
plain arguments to the worker and gets back a plain value or an exception name, under a
deadline.  So the outcome of
every assert is computed here, by code the program cannot reach, on values that cannot
carry program behaviour.

Records go to the parent on a private dup of fd 1 (stdout itself goes to /dev/null so test
code prints cannot interfere), each prefixed with the parent's per-run nonce.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import math
import os
import random
import resource
import signal
import subprocess
import sys
import time

import checks
import codec
import nsroot
import procs

JOB_LIMIT = 64 << 20
REQUEST_LIMIT = 64 << 20
ERROR_CAP = 300
UNSAFE_MODULES = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"})
BOOTSTRAP = (
    "import sys,types;m=types.ModuleType('codec');"
    "exec(compile(sys.argv[1],'codec.py','exec'),m.__dict__);sys.modules['codec']=m;"
    "exec(compile(sys.argv[2],'worker.py','exec'),{'__name__':'__main__'})"
)


class Abort(BaseException):
    """The total budget is spent: unwinds through test code that catches Exception."""


class CandidateError(Exception):
    """An exception raised in the program that has no builtin counterpart here."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class Timeout(CandidateError):
    def __init__(self) -> None:
        super().__init__("timeout", "")


def describe(exc: BaseException) -> str:
    """Deterministic, capped description of an exception seen by the judge."""
    name = exc.name if isinstance(exc, CandidateError) else type(exc).__name__
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - e.g. int too large to print
        message = "<unprintable>"
    text = f"{name}: {message}" if message else name
    return text if len(text) <= ERROR_CAP else text[: ERROR_CAP - 3] + "..."


def rebuild(name: str, message: str) -> Exception:
    """Turn a worker-reported exception into one test code can catch by builtin type."""
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls is not CandidateError:
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 - constructors with other signatures
            pass
    return CandidateError(name, message)


def _read_sources() -> list[str]:
    """The worker's code, passed on its command line: nothing of the package needs to be
    reachable from inside the sandbox (read at import, before any chroot)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sources = []
    for name in ("codec.py", "worker.py"):
        with open(os.path.join(here, name), encoding="utf-8") as handle:
            sources.append(handle.read())
    return sources


SOURCES = _read_sources()


class Worker:
    """One untrusted worker process; restarted (fresh process, program reloaded) after it
    times out or dies, so later asserts still get a fair run."""

    def __init__(self, job: dict, names: list[str], enter_pid_namespace) -> None:
        self.job = job
        self.names = names
        self.enter_pid_namespace = enter_pid_namespace
        self.proc: subprocess.Popen | None = None
        self.req_fd = self.rep_fd = -1

    def start(self, deadline: float) -> dict:
        """Spawn and load the program; return its name kinds, or raise LoadFailure."""
        req_r, self.req_fd = os.pipe()
        self.rep_fd, rep_w = os.pipe()
        job = self.job
        if self.enter_pid_namespace is not None:
            self.enter_pid_namespace()
        argv = [
            job["worker_python"], "-S", "-s", "-B", "-c", BOOTSTRAP, *job["sources"],
            str(req_r), str(rep_w), str(job["output_limit"]), "1" if job["audit_hook"] else "0",
        ]
        home = job["workdir"]
        env = {
            "PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
        }
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd=home, env=env, pass_fds=(req_r, rep_w),
            preexec_fn=self._drop_privileges,
        )
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(self.req_fd, False)
        try:
            codec.write_frame(self.req_fd, codec.encode((job["program"], self.names), JOB_LIMIT),
                              deadline)
            reply = self._read(deadline)
        except TimeoutError:
            self.kill()
            raise LoadFailure("timeout", "program did not load within the test timeout") from None
        except EOFError:
            raise LoadFailure(*self._death("while loading")) from None
        if reply[0] != "ok":
            self.kill()
            raise LoadFailure("error", str(reply[1])[:ERROR_CAP])
        return reply[1]

    def _drop_privileges(self) -> None:
        """Runs in the child before exec: own session, rlimits, unprivileged uid."""
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

    def call(self, name: str, args: tuple, kwargs: dict, deadline: float) -> object:
        try:
            request = codec.encode((name, args, kwargs), REQUEST_LIMIT)
        except codec.CodecError as exc:
            raise TypeError(f"cannot pass this value to the program: {exc}") from None
        if self.proc is None:
            try:
                self.start(deadline)
            except LoadFailure as exc:
                raise CandidateError("RuntimeError", f"program failed to restart: {exc}") from None
        try:
            codec.write_frame(self.req_fd, request, deadline)
            reply = self._read(deadline)
        except TimeoutError:
            self.kill()
            raise Timeout() from None
        except EOFError:
            raise CandidateError("crashed", self._death("during the call")[1]) from None
        if reply[0] == "ok":
            return reply[1]
        raise rebuild(str(reply[1]), str(reply[2]))

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
        """Reap a worker that closed its pipe; describe how it ended."""
        proc = self.proc
        try:
            code = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return "killed", f"program killed by {name} {when}"
        return "error", f"program exited {when} (exit status {code})"

    def kill(self) -> None:
        """Kill the worker and everything it spawned."""
        if self.proc is None:
            return
        for fd in (self.req_fd, self.rep_fd):
            os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.job["uid"] is not None and self.enter_pid_namespace is None:
            procs.kill_uid(self.job["uid"])
        self.proc = None


class LoadFailure(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class Proxy:
    """Stands in for a program function inside the test namespace."""

    def __init__(self, name: str, worker: Worker, recorder: Recorder) -> None:
        self._name = name
        self._worker = worker
        self._recorder = recorder

    def __call__(self, *args: object, **kwargs: object) -> object:
        deadline, binding_total = self._recorder.call_deadline()
        try:
            return self._worker.call(self._name, args, kwargs, deadline)
        except Timeout:
            if binding_total:
                self._recorder.abort()
                raise Abort from None
            raise

    def __repr__(self) -> str:
        return f"<program function {self._name}>"


class Recorder:
    """The ``_sandbox_`` object the instrumented check calls; streams outcomes."""

    Abort = Abort

    def __init__(self, channel: int, nonce: bytes, test_timeout: float, deadline: float) -> None:
        self.channel = channel
        self.nonce = nonce
        self.test_timeout = test_timeout
        self.deadline = deadline
        self.assert_deadline: float | None = None
        self.current: int | None = None
        self.state: dict[int, tuple[bool, str]] = {}
        self.dirty: set[int] = set()

    def send(self, record: tuple) -> None:
        codec.write_frame(self.channel, self.nonce + codec.encode(record, JOB_LIMIT))

    def call_deadline(self) -> tuple[float, bool]:
        """Deadline for a call into the program and whether it is the total budget's."""
        local = self.assert_deadline or time.monotonic() + self.test_timeout
        return min(local, self.deadline), self.deadline <= local

    def begin(self, index: int) -> None:
        self.current = index
        self.assert_deadline = time.monotonic() + self.test_timeout

    def abort(self) -> None:
        """The total budget ran out inside a call: the running assert timed out."""
        if self.current is not None:
            self._record(self.current, False, "timeout")

    @staticmethod
    def truth(value: object) -> bool:
        return bool(value)

    def passed(self, index: int) -> None:
        self._record(index, True, "")

    def failed(self, index: int, message: object) -> None:
        if message is None:
            self._record(index, False, "AssertionError")
        else:
            self._record(index, False, describe(AssertionError(message)))

    def fail(self, index: int, exc: BaseException) -> None:
        self._record(index, False, describe(exc))

    def block_failed(self, indices: tuple[int, ...], exc: BaseException) -> None:
        for index in indices:
            self._record(index, False, describe(exc))

    def block_done(self) -> None:
        if self.dirty:
            self.send(("outcomes", [(i, *self.state[i]) for i in sorted(self.dirty)]))
            self.dirty.clear()

    def _record(self, index: int, ok: bool, error: str) -> None:
        self.assert_deadline = self.current = None
        before_ok, before_error = self.state.get(index, (True, ""))
        self.state[index] = (before_ok and ok, before_error or error)
        self.dirty.add(index)


def build_namespace(kinds: dict, worker: Worker, recorder: Recorder) -> dict:
    """Test globals: the program's names the test code uses, as proxies or plain copies."""
    namespace: dict[str, object] = {
        "__name__": "__sandbox_test__", "__builtins__": builtins, checks.HOOK: recorder,
    }
    for name, (kind, payload) in kinds.items():
        if kind == "call":
            namespace[name] = Proxy(name, worker, recorder)
        elif kind == "value":
            namespace[name] = payload
        elif (
            kind == "module"
            and isinstance(payload, str)
            and payload.split(".")[0] in sys.stdlib_module_names
            and payload.split(".")[0] not in UNSAFE_MODULES
        ):
            namespace[name] = importlib.import_module(payload)
    return namespace


def run(job: dict, recorder: Recorder, enter_pid_namespace) -> tuple[str, str]:
    """Load the program, run the instrumented check; return (status, error)."""
    module = checks.instrument(job["test_code"])
    names = sorted(set(checks.free_names(module)) | {job["entry_point"]})
    worker = Worker(job, names, enter_pid_namespace)
    try:
        try:
            kinds = worker.start(min(time.monotonic() + job["test_timeout"], recorder.deadline))
        except LoadFailure as exc:
            return exc.status, str(exc)
        if kinds.get(job["entry_point"], ("",))[0] != "call":
            return "error", f"the program defines no function {job['entry_point']!r}"
        namespace = build_namespace(kinds, worker, recorder)
        random.seed(0)  # test code that draws inputs from the global RNG stays deterministic
        try:
            exec(compile(module, "<test>", "exec"), namespace)
            check = namespace["check"]
        except Exception as exc:  # noqa: BLE001 - broken test code is reported, not raised
            return "error", f"test code failed: {describe(exc)}"
        try:
            check(namespace[job["entry_point"]])
        except Abort:
            return "timeout", f"timeout after {job['total_timeout']}s"
        except Exception as exc:  # noqa: BLE001
            return "ok", f"check() raised {describe(exc)}"
        return "ok", ""
    finally:
        worker.kill()
        recorder.block_done()


def main() -> None:
    started = time.monotonic()
    frame = codec.read_frame(0, JOB_LIMIT)
    job = codec.decode(frame)
    channel = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    memory = job["memory_limit"] + (256 << 20)  # the judge runs trusted code: headroom
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    job["sources"] = SOURCES
    enter_pid_namespace = None
    if job["isolation"] == "namespaces":
        try:
            enter_pid_namespace = nsroot.enter(job)
        except OSError as exc:
            codec.write_frame(channel, job["nonce"] + codec.encode(("fatal", str(exc)), JOB_LIMIT))
            return
    recorder = Recorder(channel, job["nonce"], job["test_timeout"], started + job["total_timeout"])
    status, error = run(job, recorder, enter_pid_namespace)
    recorder.send(("done", status, error))

