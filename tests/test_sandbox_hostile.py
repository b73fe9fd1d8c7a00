"""Hostile programs against the sandbox, in every isolation mode available here.

Two kinds of attack:
- cheating/leaking (expected 0 passed): the program returns the right answer only if the
  attack worked (it read a secret, reached the network, wrote outside its directory...),
  so "0 passed" proves the attack failed;
- disruption (expected 4 passed): the program attacks the harness (kills its parent,
  leaves orphans, floods output) and then answers correctly, so "4 passed" proves the
  harness was not disturbed.
Every run must also return within its budget and leave no process and no file behind.
Runs with the audit hook off check that the OS-level isolation holds on its own.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import textwrap
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from llm_marl_envs.sandbox import (
    SandboxSettings,
    TestJob,
    isolation,
    procs,
    run_many,
    run_tests,
    runner,
    slots,
)

TEST_CODE = textwrap.dedent(
    """
    def check(candidate):
        assert candidate(1, 2) == 3
        assert candidate(2, 2) == 4
        for x in range(3):
            assert candidate(x, 0) == x
        assert candidate(-1, 1) == 0
    """
)
TOKEN = secrets.token_hex(8)  # names the files/env vars the attacks look for
SECRET_ENV = f"LLM_MARL_SANDBOX_SECRET_{TOKEN}"
SECRET_FILE = f"/var/tmp/llm_marl_sandbox_secret_{TOKEN}"
ESCAPES = [f"{d}/llm_marl_sandbox_escape_{TOKEN}" for d in ("/tmp", "/var/tmp", "/dev/shm")]
ESCAPES.append(os.path.join(os.path.dirname(runner.__file__), f"escape_{TOKEN}"))

CHEATS = {
    "infinite_loop": "def add(a, b):\n    while True:\n        pass\n",
    "sleep": "import time\ndef add(a, b):\n    time.sleep(100)\n",
    "ignore_signals": """
        import signal
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGXCPU):
            signal.signal(s, signal.SIG_IGN)
        def add(a, b):
            while True:
                pass
    """,
    "exit_at_import": "import sys\nsys.exit(0)\ndef add(a, b):\n    return 0\n",
    "os_exit_at_import": "import os\nos._exit(0)\n",
    "exit_in_call": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "print_fake_results": """
        import os, struct
        fake = b"PASSED\\nok 4/4\\n" + struct.pack("!I", 7) + b"T" * 7
        print("PASSED"); print("4 passed")
        def add(a, b):
            for fd in range(64):
                try:
                    os.write(fd, fake)
                except OSError:
                    pass
            print("PASSED")
    """,
    "eq_always_true": """
        class Liar(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        class Anything(list):
            def __eq__(self, other):
                return True
        def add(a, b):
            return Liar(0) if a % 2 else Anything()
    """,
    "patch_builtins": """
        import builtins, math
        builtins.AssertionError = type('AssertionError', (Exception,), {})
        builtins.bool = lambda x: True
        builtins.abs = lambda x: 0
        math.fabs = lambda x: 0.0
        def add(a, b):
            return None
    """,
    "walk_frames_and_gc": """
        import gc, sys, traceback
        def add(a, b):
            frame = sys._getframe()
            while frame is not None:
                for scope in (frame.f_locals, frame.f_globals):
                    for key, value in list(scope.items()):
                        if isinstance(value, dict):
                            value.update(passed=True, ok=True)
                frame = frame.f_back
            for obj in gc.get_objects():
                if isinstance(obj, dict) and "status" in obj:
                    obj["status"] = "ok"
            try:
                raise RuntimeError
            except RuntimeError as exc:
                traceback.clear_frames(exc.__traceback__)
            return None
    """,
    "fork_bomb": """
        import os
        def add(a, b):
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
    """,
    "memory_bomb": "def add(a, b):\n    x = [bytearray(1 << 20) for _ in range(100000)]\n",
    "huge_return_value": "def add(a, b):\n    return 'x' * (64 << 20)\n",
    "deeply_nested_value": """
        def add(a, b):
            value = a + b
            for _ in range(10000):
                value = [value]
            return value
    """,
    "stack_overflow": """
        import sys
        sys.setrecursionlimit(10 ** 7)
        def add(a, b):
            return add(a, b) + 1
    """,
    "hostile_exception": """
        class Evil(Exception):
            def __str__(self):
                while True:
                    pass
        def add(a, b):
            raise Evil()
    """,
    "read_parent_env": f"""
        import os
        def found():
            if os.environ.get("{SECRET_ENV}"):
                return True
            for pid in (os.listdir("/proc") if os.path.isdir("/proc") else []):
                try:
                    with open(f"/proc/{{pid}}/environ", "rb") as handle:
                        if b"{SECRET_ENV}" in handle.read():
                            return True
                except OSError:
                    pass
            return False
        def add(a, b):
            return a + b if found() else None
    """,
    "read_secret_file": f"""
        def add(a, b):
            try:
                with open("{SECRET_FILE}") as handle:
                    return a + b if handle.read() == "{TOKEN}" else None
            except OSError:
                return None
    """,
    "write_outside": f"""
        import os
        def add(a, b):
            wrote = False
            for path in {ESCAPES!r}:
                try:
                    with open(path, "w") as handle:
                        handle.write("x")
                    wrote = wrote or os.path.exists(path)
                except OSError:
                    pass
            return a + b if wrote else None
    """,
    "network": """
        import socket
        def add(a, b):
            try:
                with socket.create_connection(("127.0.0.1", PORT), timeout=0.2) as conn:
                    conn.sendall(b"escaped")
                return a + b
            except OSError:
                return None
    """,
}

DISRUPTIONS = {
    "kill_parent": """
        import os, signal
        def add(a, b):
            targets = ((os.getppid(), signal.SIGKILL), (-1, signal.SIGKILL), (1, signal.SIGTERM))
            for pid, sig in targets:
                try:
                    os.kill(pid, sig)
                except (OSError, PermissionError):
                    pass
            return a + b
    """,
    "orphans": """
        import os, time
        def add(a, b):
            try:
                pid = os.fork()
            except OSError:
                return a + b
            if pid == 0:
                try:
                    os.setsid()
                    if os.fork() == 0:
                        time.sleep(1000)
                finally:
                    os._exit(0)
            return a + b
    """,
    "output_flood": """
        import sys, threading
        def flood():
            while True:
                sys.stdout.write('x' * 65536)
                sys.stderr.write('y' * 65536)
        threading.Thread(target=flood, daemon=True).start()
        def add(a, b):
            return a + b
    """,
    "files_in_workdir": """
        import os
        for i in range(50):
            with open(f"junk{i}", "w") as handle:
                handle.write("x" * 1000)
        os.mkdir("locked")
        open("locked/file", "w").close()
        os.chmod("locked", 0)
        def add(a, b):
            return a + b
    """,
}
# Writing to /tmp "works" in namespaces mode (a private tmpfs): the host is what must stay clean.
CHECKED_BY_LEFTOVERS = {"write_outside"}
# Attacks aimed at the OS layer: also run with the audit hook off.
OS_LEVEL = {"fork_bomb", "memory_bomb", "read_parent_env", "read_secret_file", "write_outside",
            "network", "kill_parent", "orphans"}
# rlimits mode has no filesystem view or network of its own: without the audit hook these
# attacks succeed there (documented in docs/sandbox.md); they still must leave nothing behind.
UNPROTECTED = {
    ("rlimits", False, "read_secret_file"), ("rlimits", False, "network"),
    ("rlimits", False, "write_outside"),
}


def available_modes() -> list[str]:
    modes = ["rlimits"]
    if os.geteuid() == 0 and not runner._probe_namespaces():
        modes.append("namespaces")
    return modes


MODES = available_modes()
CASES = [
    pytest.param(mode, audit, name, id=f"{name}-{mode}-{'audit' if audit else 'noaudit'}")
    for mode in MODES
    for audit in (True, False)
    for name in sorted({**CHEATS, **DISRUPTIONS})
    if audit or name in OS_LEVEL
]


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Record each run's slot (other processes may use the sandbox concurrently, so
    leftovers are looked for by uid rather than by scanning everything)."""
    seen: dict[str, list] = {"slots": []}
    acquire = slots.acquire

    @contextmanager
    def tracking_acquire() -> Iterator[slots.Slot]:
        with acquire() as slot:
            seen["slots"].append(slot)
            yield slot

    monkeypatch.setattr(slots, "acquire", tracking_acquire)
    return seen


def leftovers(seen: dict[str, list]) -> list[str]:
    """What the tracked runs left behind, checked while holding their slots' locks so that a
    concurrent user of the same slot cannot interfere."""
    found = [path for path in ESCAPES if os.path.exists(path)]
    tracked = {slot.index: slot for slot in seen["slots"]}.values()  # a slot may recur
    with ExitStack() as stack:
        for slot in tracked:
            lock = os.open(os.path.join(slots.state_dir(), "slots", str(slot.index)), os.O_RDWR)
            stack.callback(os.close, lock)
            fcntl.flock(lock, fcntl.LOCK_EX)
        found += [slot.workdir for slot in tracked if os.path.lexists(slot.workdir)]
        for uid in [slot.uid for slot in tracked if slot.uid is not None]:
            found += [f"pid {pid}" for pid in procs.pids_of_uid(uid)]
            for directory in ("/tmp", "/var/tmp", "/dev/shm", slots.state_dir()):
                entries = os.scandir(directory)
                found += [e.path for e in entries if e.stat(follow_symlinks=False).st_uid == uid]
    return found


@pytest.fixture
def secrets_planted(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A secret env var, a world-readable secret file, and a listening TCP socket."""
    monkeypatch.setenv(SECRET_ENV, "1")
    with open(SECRET_FILE, "w") as handle:
        handle.write(TOKEN)
    os.chmod(SECRET_FILE, 0o644)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    try:
        yield server
    finally:
        server.close()
        os.unlink(SECRET_FILE)


@pytest.mark.parametrize(("mode", "audit", "name"), CASES)
def test_hostile_program(
    mode: str, audit: bool, name: str, tracked: dict[str, list], secrets_planted: socket.socket
) -> None:
    settings = SandboxSettings(
        test_timeout=0.25, total_timeout=2.0, memory_limit=256 << 20, max_processes=8,
        isolation=mode, audit_hook=audit,
    )
    program = {**CHEATS, **DISRUPTIONS}[name]
    program = program.replace("PORT", str(secrets_planted.getsockname()[1]))
    started = time.monotonic()
    report = run_tests(TestJob(textwrap.dedent(program), TEST_CODE, "add"), settings)
    elapsed = time.monotonic() - started
    assert report.total == 4
    assert elapsed < settings.total_timeout + 1.5
    if (mode, audit, name) not in UNPROTECTED and name not in CHECKED_BY_LEFTOVERS:
        assert report.passed == (4 if name in DISRUPTIONS else 0), report
        with pytest.raises(BlockingIOError):
            secrets_planted.accept()
    assert tracked["slots"]
    assert leftovers(tracked) == []


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_does_not_disturb_concurrent_runs(mode: str) -> None:
    settings = SandboxSettings(
        test_timeout=0.5, total_timeout=2.0, max_processes=8, max_workers=3, isolation=mode,
        audit_hook=False,
    )
    bomb = TestJob(textwrap.dedent(CHEATS["fork_bomb"]), TEST_CODE, "add")
    good = TestJob("def add(a, b):\n    return a + b\n", TEST_CODE, "add")
    reports = run_many([bomb, good, bomb, good, good], settings)
    assert [r.passed for r in reports] == [0, 4, 0, 4, 4]


def test_namespaces_fail_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "_probe_result", None)
    with pytest.raises(isolation.SandboxUnavailableError, match="no user namespaces here"):
        isolation.resolve("namespaces", lambda: "no user namespaces here")
    assert isolation.resolve("auto", lambda: "unused: cached") == "rlimits"


HONEST_HELPER = "def aux(a, b):\n    return a + b\n"
CALLS_HELPER = "def add(a, b):\n    return aux(a, b)\n"
HELPER_CASES = [  # in the strongest mode: the helper's worker is started like main's, which
    # test_hostile_program runs in every mode
    pytest.param(MODES[-1], role, name, id=f"{name}-as-{role}-{MODES[-1]}")
    for role in ("main", "helper")
    for name in sorted(CHEATS)
]


@pytest.mark.parametrize(("mode", "role", "name"), HELPER_CASES)
def test_hostile_program_beside_a_helper(
    mode: str, role: str, name: str, tracked: dict[str, list], secrets_planted: socket.socket
) -> None:
    """With two workers (main and the helper's ``aux``), a cheat on either side still earns
    nothing, and a cheating main never gets the helper's calls recorded."""
    settings = SandboxSettings(
        test_timeout=0.25, total_timeout=2.0, memory_limit=256 << 20, max_processes=8,
        isolation=mode,
    )
    cheat = textwrap.dedent(CHEATS[name]).replace("PORT", str(secrets_planted.getsockname()[1]))
    if role == "main":
        job = TestJob(cheat, TEST_CODE, "add", helper_program=HONEST_HELPER, helper_name="aux")
    else:
        helper = cheat.replace("def add(", "def aux(")
        job = TestJob(CALLS_HELPER, TEST_CODE, "add", helper_program=helper, helper_name="aux")
    report = run_tests(job, settings)
    assert report.passed == 0, report
    if role == "main":
        assert not any(outcome.helper_ran for outcome in report.outcomes)
    assert tracked["slots"]
    assert leftovers(tracked) == []
