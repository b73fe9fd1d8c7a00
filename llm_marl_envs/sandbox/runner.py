"""Parent side: run jobs through judge processes and turn their records into reports.

The parent never parses or executes program text.  It validates the (trusted) test code,
claims a run slot (sandbox uid), has the zygote fork a judge in a new session
(``zygote_client``), sends the job on its stdin, and reads nonce-tagged records from the
judge's stdout.  The judge's session is killed shortly after the total budget; releasing
the slot kills every process of the sandbox uid and removes its files.
A report is built only from records that carry the nonce; asserts without a record count
as failed ("not reached").
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from . import checks, codec, isolation, slots, zygote_client
from .api import STATUSES, TestJob, TestOutcome, TestReport
from .settings import SandboxSettings

logger = logging.getLogger("llm_marl_envs.sandbox")

OUTPUT_CAP = 16 << 20  # bytes kept from the judge's stdout/stderr
KILL_GRACE = 1.0  # seconds after total_timeout before the parent kills the judge
NONCE_BYTES = 16
NS_WORKDIR = "/sandbox"


def count_tests(test_code: str) -> int:
    """Number of counted asserts in ``check`` (static; never runs anything)."""
    return checks.count_tests(test_code)


def run_tests(job: TestJob, settings: SandboxSettings | None = None) -> TestReport:
    """Run one program against its tests in a fresh sandbox."""
    settings = settings or SandboxSettings()
    return _run(job, settings, isolation.resolve(settings.isolation, _probe_namespaces))


def run_many(jobs: Sequence[TestJob], settings: SandboxSettings | None = None) -> list[TestReport]:
    """Run many programs concurrently (at most ``settings.max_workers``), order preserved."""
    settings = settings or SandboxSettings()
    mode = isolation.resolve(settings.isolation, _probe_namespaces)
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=min(settings.max_workers, len(jobs))) as pool:
        return list(pool.map(lambda job: _run(job, settings, mode), jobs))


def _probe_namespaces() -> str:
    """Can this machine give us namespaces? Runs one trivial job; "" if it worked."""
    if os.geteuid() != 0:
        return "not running as root"
    job = TestJob("def f():\n    return 1\n", "def check(c):\n    assert c() == 1\n", "f")
    try:
        report = _run(job, SandboxSettings(isolation="namespaces"), "namespaces")
    except isolation.SandboxUnavailableError as exc:
        return str(exc)
    return "" if report.passed == 1 else f"probe run failed: {report.status} {report.error}"


def _run(job: TestJob, settings: SandboxSettings, mode: str) -> TestReport:
    if not job.entry_point.isidentifier():
        raise ValueError(f"entry_point must be an identifier, got {job.entry_point!r}")
    if job.helper_program and not job.helper_name.isidentifier():
        raise ValueError(f"helper_name must be an identifier, got {job.helper_name!r}")
    module, check = checks.parse_test_code(job.test_code)  # ValueError on broken test code
    if check is None:
        raise ValueError("test_code defines no check() function")
    sources = checks.assert_sources(job.test_code)
    names = sorted(set(checks.free_names(module)) | {job.entry_point})
    nonce = secrets.token_bytes(NONCE_BYTES)
    python = isolation.sandbox_python(mode)
    with slots.acquire() as slot:
        public = {
            **asdict(settings), "program": job.program, "entry_point": job.entry_point,
            "helper_program": job.helper_program, "helper_name": job.helper_name,
            "names": names, "isolation": mode, "uid": slot.uid,
            "workdir": _workdir(mode, slot), "python": python,
        }
        secret = {"test_code": job.test_code, "nonce": nonce}
        output, timed_out, stderr = _drive(python, [public, secret], settings.total_timeout)
    records = _parse(output, nonce)
    if records and records[-1][0] == "fatal":
        raise isolation.SandboxUnavailableError(f"sandbox setup failed: {records[-1][1]}")
    if not any(r[0] == "done" for r in records) and not timed_out:
        logger.warning("sandbox judge died: %s", stderr[-2000:].decode("utf-8", "replace"))
    return _report(sources, records, timed_out, settings.total_timeout)


def _workdir(mode: str, slot: slots.Slot) -> str:
    """Create the program's empty working directory (removed when the slot is released).

    In namespaces mode the judge creates it on its private tmpfs: it vanishes with it.
    """
    if mode == "namespaces":
        return NS_WORKDIR
    os.mkdir(slot.workdir, 0o700)
    if slot.uid is not None:
        os.chown(slot.workdir, slot.uid, slot.uid)
    return slot.workdir


def _drive(python: str, frames: list[dict], total_timeout: float) -> tuple[bytes, bool, bytes]:
    """Fork a judge, feed it the job frames, collect its output; kill it at the deadline."""
    deadline = time.monotonic() + total_timeout + KILL_GRACE
    pid, stdin_w, stdout_r, stderr_r = zygote_client.spawn(python)
    timed_out = True
    try:
        os.set_blocking(stdin_w, False)
        with contextlib.suppress(TimeoutError, BrokenPipeError):
            for frame in frames:
                codec.write_frame(stdin_w, codec.encode(frame, 1 << 30), deadline)
        os.close(stdin_w)
        stdin_w = -1
        streams = {stdout_r: bytearray(), stderr_r: bytearray()}
        timed_out = not _collect(streams, deadline)
        return bytes(streams[stdout_r]), timed_out, bytes(streams[stderr_r])
    finally:
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for fd in (stdin_w, stdout_r, stderr_r):
            if fd >= 0:
                os.close(fd)


def _collect(streams: dict[int, bytearray], deadline: float) -> bool:
    """Read every stream to EOF (capped); False if the deadline came first."""
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        open_fds = set(streams)
        while open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    open_fds.discard(key.fd)
                elif len(streams[key.fd]) < OUTPUT_CAP:
                    streams[key.fd] += chunk
    return True


def _parse(output: bytes, nonce: bytes) -> list[tuple]:
    """Decode records up to the first frame that is truncated, untagged or malformed."""
    records = []
    pos = 0
    while pos + 4 <= len(output):
        size = int.from_bytes(output[pos : pos + 4], "big")
        frame = output[pos + 4 : pos + 4 + size]
        if len(frame) < size or not frame.startswith(nonce):
            break
        try:
            record = codec.decode(frame[len(nonce) :])
        except codec.CodecError:
            break
        if not isinstance(record, tuple) or not record:
            break
        records.append(record)
        pos += 4 + size
    return records


def _report(sources: list[str], records: list[tuple], timed_out: bool, budget: float) -> TestReport:
    total = len(sources)
    state: dict[int, tuple[bool, str, bool]] = {}
    status, error = ("timeout", f"timeout after {budget}s") if timed_out else (
        "killed", "sandbox harness died"
    )
    for record in records:
        if record[0] == "outcomes":
            for entry in record[1]:
                if len(entry) != 4:
                    continue
                index, ok, message, helper_ran = entry
                if isinstance(index, int) and 0 <= index < total:
                    state[index] = (ok is True and message == "", str(message)[:300],
                                    helper_ran is True)
        elif record[0] == "done" and len(record) == 3 and record[1] in STATUSES:
            status, error = record[1], str(record[2])[:300]
    outcomes = tuple(
        TestOutcome(i, sources[i], *state.get(i, (False, "not reached", False)))
        for i in range(total)
    )
    if status == "ok":
        error = ""
    return TestReport(status, sum(o.passed for o in outcomes), total, outcomes, error)
