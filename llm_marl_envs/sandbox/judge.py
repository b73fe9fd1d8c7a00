"""Trusted side of a sandbox run: runs the instrumented ``check`` and reports to the parent.

Forked by the zygote (see ``zygote``) as a new session with a scrubbed environment, stdin,
stdout and stderr wired to the parent's pipes.  It reads the public job frame on stdin,
optionally enters fresh namespaces and a minimal read-only root (``nsroot``), forks the
untrusted worker, reads the secret frame (test code, nonce) and runs the test code itself.
Every function the test code needs from the program (the entry point, helpers like
``poly``) is a :class:`Proxy`: calling it sends plain arguments to the worker and gets back
a plain value or an exception name, under a deadline.  So the outcome of every assert is
computed here, by code the program cannot reach, on values that cannot carry program
behaviour.

With a helper program (``job["helper_program"]``, the other agent's ``aux``), a second
worker runs it, and the first worker's program reaches it only through the judge, which
notes every call that returned a value during each assert (``TestOutcome.helper_ran``).

Records go to the parent on a private dup of fd 1 (stdout itself goes to /dev/null so test
code prints cannot interfere), each prefixed with the parent's per-run nonce.
"""

from __future__ import annotations

import builtins
import importlib
import os
import random
import re
import resource
import sys
import time

import checks
import codec
import nsroot
from worker_control import CandidateError, LoadFailure, Timeout, Worker

JOB_LIMIT = 64 << 20
ERROR_CAP = 300
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
UNSAFE_MODULES = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"})


class Abort(BaseException):
    """The total budget is spent: unwinds through test code that catches Exception."""


def describe(exc: BaseException) -> str:
    """Deterministic, capped description of an exception seen by the judge (object
    addresses, as in "<Foo object at 0x7f...>", are masked)."""
    name = exc.name if isinstance(exc, CandidateError) else type(exc).__name__
    try:
        message = getattr(exc, "sandbox_message", None) or str(exc)
    except Exception:  # noqa: BLE001 - e.g. int too large to print
        message = "<unprintable>"
    message = ADDRESS.sub(" at 0x...", message)
    text = f"{name}: {message}" if message else name
    return text if len(text) <= ERROR_CAP else text[: ERROR_CAP - 3] + "..."


class Proxy:
    """Stands in for a program function inside the test namespace."""

    def __init__(self, name: str, worker: Worker, recorder: Recorder) -> None:
        self._name = name
        self._worker = worker
        self._recorder = recorder

    def __call__(self, *args: object, **kwargs: object) -> object:
        deadline, binding_total = self._recorder.call_deadline()
        helper_returns = self._worker.helper_returns
        try:
            return self._worker.call(self._name, args, kwargs, deadline)
        except Timeout:
            if binding_total:
                self._recorder.abort()
                raise Abort from None
            raise
        finally:
            if self._worker.helper_returns != helper_returns:
                self._recorder.helper_returned()

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
        self.state: dict[int, tuple[bool, str, bool]] = {}
        self.helper_ran = False  # in the assert now running
        self.dirty: set[int] = set()

    def send(self, record: tuple) -> None:
        codec.write_frame(self.channel, self.nonce + codec.encode(record, JOB_LIMIT))

    def call_deadline(self) -> tuple[float, bool]:
        """Deadline for a call into the program and whether it is the total budget's."""
        local = self.assert_deadline or time.monotonic() + self.test_timeout
        return min(local, self.deadline), self.deadline <= local

    def begin(self, index: int) -> None:
        self.current = index
        self.helper_ran = False
        self.assert_deadline = time.monotonic() + self.test_timeout

    def helper_returned(self) -> None:
        """A call of the helper's function returned a value while an assert was running."""
        if self.current is not None:
            self.helper_ran = True

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
        helper_ran = self.helper_ran and self.current == index
        self.assert_deadline = self.current = None
        self.helper_ran = False
        before_ok, before_error, before_ran = self.state.get(index, (True, "", False))
        self.state[index] = (before_ok and ok, before_error or error, before_ran or helper_ran)
        self.dirty.add(index)


def build_namespace(
    kinds: dict, names: list[str], worker: Worker, recorder: Recorder
) -> dict:
    """Test globals: the program's names the test code uses, as proxies or plain copies.

    ``kinds`` comes from the worker, so it is untrusted: only the requested ``names`` are
    taken, and malformed entries are ignored.
    """
    namespace: dict[str, object] = {
        "__name__": "__sandbox_test__", "__builtins__": builtins, checks.HOOK: recorder,
    }
    for name in names:
        entry = kinds.get(name)
        if not (isinstance(entry, tuple) and len(entry) == 2):
            continue
        kind, payload = entry
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


def run(job: dict, worker: Worker, recorder: Recorder) -> tuple[str, str]:
    """Load the program, run the instrumented check; return (status, error)."""
    module = checks.instrument(job["test_code"])
    try:
        try:
            deadline = min(time.monotonic() + job["test_timeout"], recorder.deadline)
            kinds = worker.load(job["names"], deadline)
        except LoadFailure as exc:
            return exc.status, str(exc)
        namespace = build_namespace(kinds, job["names"], worker, recorder)
        # Taken before the test code runs: a test-code function of the same name must not
        # replace the program as the candidate.
        candidate = namespace.get(job["entry_point"])
        if not isinstance(candidate, Proxy):
            return "error", f"the program defines no function {job['entry_point']!r}"
        random.seed(0)  # test code that draws inputs from the global RNG stays deterministic
        try:
            exec(compile(module, "<test>", "exec"), namespace)
            check = namespace["check"]
        except Exception as exc:  # noqa: BLE001 - broken test code is reported, not raised
            return "error", f"test code failed: {describe(exc)}"
        try:
            check(candidate)
        except Abort:
            return "timeout", f"timeout after {job['total_timeout']}s"
        except Exception as exc:  # noqa: BLE001
            return "ok", f"check() raised {describe(exc)}"
        return "ok", ""
    finally:
        worker.kill()
        if worker.helper is not None:
            worker.helper.kill()
        recorder.block_done()


def main() -> None:
    """Frame 1 on stdin: everything but the secrets.  The first worker is forked right
    after it, then frame 2 (test code and nonce) is read: the worker never held them."""
    started = time.monotonic()
    nsroot.undumpable()
    job = codec.decode(codec.read_frame(0, JOB_LIMIT))
    channel = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    memory = job["memory_limit"] + (256 << 20)  # the judge runs trusted code: headroom
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    enter_pid_namespace = None
    setup_error = ""
    if job["isolation"] == "namespaces":
        try:
            enter_pid_namespace = nsroot.enter(job)
        except OSError as exc:
            setup_error = str(exc)
    helper = None
    if job["helper_program"]:  # a copy made before the secrets are read: it never holds them
        helper = Worker({**job, "program": job["helper_program"]}, enter_pid_namespace)
    worker = Worker(job, enter_pid_namespace, helper)
    if not setup_error:
        worker.fork()
        if helper is not None:
            helper.fork()
    job.update(codec.decode(codec.read_frame(0, JOB_LIMIT)))
    os.dup2(devnull, 0)
    if setup_error:
        codec.write_frame(channel, job["nonce"] + codec.encode(("fatal", setup_error), JOB_LIMIT))
        return
    recorder = Recorder(channel, job["nonce"], job["test_timeout"], started + job["total_timeout"])
    status, error = run(job, worker, recorder)
    recorder.send(("done", status, error))
