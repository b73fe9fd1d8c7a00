"""Run untrusted, LLM-generated Python against HumanEval-style tests.

Each program runs in a fresh, unprivileged, resource-limited process (in fresh namespaces
when the machine allows it); the tests run in a separate trusted judge process that only
ever receives plain values from the program.  See docs/sandbox.md for the threat model.

    report = run_tests(TestJob(program, problem["test"], problem["entry_point"]))
    report.passed, report.total, report.outcomes
"""

from .api import TestJob, TestOutcome, TestReport
from .isolation import SandboxUnavailableError
from .runner import count_tests, run_many, run_tests
from .settings import SandboxSettings

__all__ = [
    "SandboxSettings",
    "SandboxUnavailableError",
    "TestJob",
    "TestOutcome",
    "TestReport",
    "count_tests",
    "run_many",
    "run_tests",
]
